"""The embedded store's SeaweedFS: its command line, identities and the pinned build (the
go command is replaced here; tests/integration/test_snapshot_s3.py runs the real one)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from hebrus_flywheel.core.storage import StorageError
from hebrus_flywheel.streams import seaweedfs, storage_server

LAYOUT = seaweedfs.ServerLayout(s3_port=19480, s3_bind="127.0.0.1", data_dir=Path("/d"),
                                security_dir=Path("/s"))


def _flags(args: list[str]) -> dict[str, str]:
    return dict(a.lstrip("-").split("=", 1) for a in args if "=" in a)


def test_only_the_s3_port_may_leave_loopback_and_it_serves_tls() -> None:
    flags = _flags(seaweedfs.server_args(
        seaweedfs.ServerLayout(s3_port=9443, s3_bind="0.0.0.0", data_dir=Path("/d"),
                               security_dir=Path("/s"))))
    assert flags["ip"] == flags["ip.bind"] == "127.0.0.1"
    assert flags["s3.ip.bind"] == "0.0.0.0" and flags["s3.port"] == "9443"
    assert flags["s3.cert.file"] == "/s/ca.crt" and flags["s3.key.file"] == "/s/tls.key"
    assert flags["s3.config"] == "/s/s3.json"
    assert flags["master.telemetry"] == "false"
    assert flags["s3.port.iceberg"] == flags["s3.port.lance"] == "0"


def test_internal_ports_follow_the_s3_port_and_do_not_collide() -> None:
    flags = _flags(seaweedfs.server_args(LAYOUT))
    ports = [int(v) for k, v in flags.items() if k.endswith("port") or k.endswith(".grpc")]
    assert sorted(ports) == list(range(19480, 19488))


def test_each_role_gets_only_its_actions() -> None:
    keys = {r: {"access_key": f"{r}-id", "secret_key": f"{r}-secret"}
            for r in ("sealer", "trainer", "admin")}
    config = seaweedfs.identities(keys, checkpoint_bucket="ckpt")
    actions = {i["name"]: i["actions"] for i in config["identities"]}  # type: ignore[index]
    assert actions == {"sealer": ["Read", "List", "Write"],
                       "trainer": ["Read", "List", "Write:ckpt"], "admin": ["Admin"]}


def test_material_is_private_and_kept(tmp_path: Path) -> None:
    files = storage_server.ensure_material(tmp_path)
    assert stat.S_IMODE(files.stat().st_mode) == 0o700
    for name in ("tls.key", "s3.json", "sealer.json", "trainer.json", "admin.json"):
        assert stat.S_IMODE((files / name).stat().st_mode) == 0o600, name
    first = (files / "s3.json").read_text()
    storage_server.ensure_material(tmp_path)
    assert (files / "s3.json").read_text() == first
    sealer = json.loads((files / "sealer.json").read_text())
    assert sealer["secret_key"] in first


def test_a_module_with_another_checksum_is_not_built(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_go(args: list[str], what: str, *, cwd: Path | None = None) -> str:
        calls.append(args)
        return json.dumps({"Dir": str(tmp_path), "Sum": "h1:tampered="})

    monkeypatch.setattr(seaweedfs, "_go", fake_go)
    with pytest.raises(StorageError, match="pinned"):
        seaweedfs.ensure_binary(tmp_path / "bin")
    assert [c[0] for c in calls] == ["mod"]  # never reached `go build`


def test_a_built_binary_of_the_pin_is_reused_and_another_is_rebuilt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_go(args: list[str], what: str, *, cwd: Path | None = None) -> str:
        calls.append(args)
        if args[0] == "build":
            Path(args[args.index("-o") + 1]).write_text("binary")
            assert cwd == tmp_path
        return json.dumps({"Dir": str(tmp_path), "Sum": seaweedfs.MODULE_SUM})

    monkeypatch.setattr(seaweedfs, "_go", fake_go)
    weed = seaweedfs.ensure_binary(tmp_path / "bin")
    assert weed.read_text() == "binary" and [c[0] for c in calls] == ["mod", "build"]
    seaweedfs.ensure_binary(tmp_path / "bin")
    assert len(calls) == 2  # reused
    (tmp_path / "bin" / "weed.version").write_text("another pin\n")
    seaweedfs.ensure_binary(tmp_path / "bin")
    assert len(calls) == 4
