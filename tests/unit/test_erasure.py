"""Erasure without a broker: superseding snapshots, the journal and receipt, taint
markers, changelog key ownership, the demo's drill and how qualification reads it
(the canary scanner: test_canary.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hebrus_flywheel.consumers.erasure import EraseConfig, erase_owner, finish_erasures
from hebrus_flywheel.consumers.supersede import (
    SUPERSEDED_DIR,
    build_superseding,
    snapshot_owner_rows,
    supersede_epoch,
    verify_live,
)
from hebrus_flywheel.consumers.tombstones import TABLES, owner_of_key, table_key
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, OwnerKeyDestroyedError
from hebrus_flywheel.core.snapshot import default_kek_path, load_manifest, verify_snapshot
from hebrus_flywheel.core.taint import TaintedCheckpointError, add_taint, refuse_tainted
from tests.support.planted import PlantedConfig, make_writable, write_planted_snapshot

OWNER_FMT = "o{thread:032x}"
ERASED = "o" + "0" * 31 + "1"
KEPT = "o" + "0" * 32
CONFIG = PlantedConfig(threads={"train": 3, "validation": 1}, owner_format=OWNER_FMT)


@pytest.fixture
def dataset(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "dataset"
    write_planted_snapshot(root, CONFIG)
    (root / "dataset.json").write_text("{}")  # found by the default dataset search
    yield root
    make_writable(root)


# -- changelog keys ----------------------------------------------------------------------


def test_state_keys_name_their_owner() -> None:
    from hebrus_flywheel.streams.processors.app import CAPTURE_TABLE, DEDUP_TABLE
    from hebrus_flywheel.streams.processors.band_agents import BAND_TABLE, HOME_TABLE

    assert TABLES == (CAPTURE_TABLE, DEDUP_TABLE, BAND_TABLE, HOME_TABLE)
    sep = "\x1f"
    assert owner_of_key(f"h{sep}{ERASED}{sep}t1{sep}0") == ERASED
    assert owner_of_key(f"t{sep}{ERASED}{sep}t1{sep}0{sep}3") == ERASED
    assert owner_of_key(f"d{sep}{ERASED}{sep}t1{sep}0") == ERASED
    assert owner_of_key(f"s{sep}{ERASED}/t1") == ERASED
    assert owner_of_key(f"c{sep}producer{sep}topic{sep}0") is None
    assert owner_of_key(f"n{sep}seq") is None
    assert table_key(json.dumps(f"h{sep}x").encode()) == f"h{sep}x"


# -- superseding snapshots ---------------------------------------------------------------


def test_supersede_removes_only_the_owners_rows_and_verifies(dataset: Path) -> None:
    old = load_manifest(dataset / "epoch=0")
    mine, total = snapshot_owner_rows(dataset / "epoch=0", ERASED)
    kept_before, _ = snapshot_owner_rows(dataset / "epoch=0", KEPT)
    assert mine > 0
    new = supersede_epoch(dataset, 0, old.snapshot_id, ERASED, grace_ms=60_000)
    assert new["supersedes"] == old.snapshot_id and new["erasure"]["rows_removed"] == mine
    assert snapshot_owner_rows(dataset / "epoch=0", ERASED) == (0, total - mine)
    assert snapshot_owner_rows(dataset / "epoch=0", KEPT)[0] == kept_before
    assert verify_snapshot(dataset / "epoch=0", keys=True)["snapshot_id"] == new["snapshot_id"]
    # shards without the owner are kept byte-identical; the validation split has none
    old_entries = {s.path: s.sha256 for s in old.shards}
    for entry in load_manifest(dataset / "epoch=0").shards:
        if entry.path not in new["erasure"]["shards_rewritten"]:
            assert old_entries[entry.path] == entry.sha256
    assert (dataset / SUPERSEDED_DIR / old.snapshot_id / "epoch=0" / "manifest.json").is_file()
    # a rerun changes nothing
    assert supersede_epoch(dataset, 0, old.snapshot_id, ERASED, grace_ms=60_000) == new


def test_supersede_resumes_between_the_two_renames(dataset: Path) -> None:
    from hebrus_flywheel.consumers.supersede import _move_dir, _paths

    old_id = load_manifest(dataset / "epoch=0").snapshot_id
    built = build_superseding(dataset, 0, ERASED)
    paths = _paths(dataset.resolve(), 0, old_id)
    _move_dir(paths["live"], paths["old"])  # killed here: no live epoch=0
    assert not (dataset / "epoch=0").exists()
    assert supersede_epoch(dataset, 0, old_id, ERASED, grace_ms=0) == built
    assert verify_live(dataset, 0) == (True, None)


def test_grace_period_then_finish_deletes_the_superseded_files(dataset: Path,
                                                                tmp_path: Path) -> None:
    old_id = load_manifest(dataset / "epoch=0").snapshot_id
    home = tmp_path / "home"
    receipt = erase_owner(EraseConfig(owner=ERASED, datasets=(dataset,), home=home,
                                      grace_ms=3_600_000))
    files = receipt["snapshots"][0]["superseded_files"]
    assert files["state"] == "kept for the grace period"
    assert (dataset / SUPERSEDED_DIR / old_id).is_dir()
    assert finish_erasures([dataset], home=home) == []  # not due yet
    done = finish_erasures([dataset], home=home, now_ms=int(time.time() * 1000) + 7_200_000)
    assert [d["snapshot_id"] for d in done] == [old_id]
    assert not (dataset / SUPERSEDED_DIR / old_id).exists()
    refreshed = json.loads((home / "erasure" / ERASED / "receipt.json").read_text())
    assert refreshed["snapshots"][0]["superseded_files"]["state"] == "deleted"


def test_unsealed_shards_are_rewritten_and_staging_leftovers_deleted(tmp_path: Path) -> None:
    from hebrus_flywheel.consumers.dataset import dataset_record
    from hebrus_flywheel.consumers.supersede import erase_unsealed
    from hebrus_flywheel.core.snapshot import read_parquet

    root = tmp_path / "open"
    planted = write_planted_snapshot(root, CONFIG, read_only=False)
    (root / "epoch=0" / "manifest.json").unlink()  # an epoch the workers are still writing
    (root / "dataset.json").write_text(json.dumps(dataset_record(
        identity=planted.manifest["identity"], determinism=planted.manifest["determinism"],
        source={"prefix": "", "group_id": "planted"})))
    (root / ".staging" / "half.parquet.host.1.ab.tmp").write_bytes(b"partial")
    done = erase_unsealed(root, ERASED)
    rewritten = [d for d in done if d["action"] == "rewritten"]
    assert rewritten and sum(d["rows_removed"] for d in rewritten) > 0
    assert [d["action"] for d in done if d not in rewritten] == ["deleted staging file"]
    for shard in (root / "epoch=0").rglob("*.parquet"):
        assert ERASED not in read_parquet(shard, ["owner"]).column("owner").to_pylist()
    assert erase_unsealed(root, ERASED) == []  # nothing left to do


# -- the erasure and its receipt ---------------------------------------------------------


def _checkpoint(directory: Path, snapshot_id: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "lineage.json").write_text(json.dumps(
        {"checkpoint_id": "c" * 64, "snapshot": {"snapshot_id": snapshot_id}}))
    return directory


def test_erase_owner_receipt_keys_and_taint(dataset: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("FLYWHEEL_OWNER_KEYS", str(home / "keys"))
    store = LocalOwnerKeyStore(create=True)
    generation = store.data_key(ERASED, create=True).generation
    old_id = load_manifest(dataset / "epoch=0").snapshot_id
    before = snapshot_owner_rows(dataset / "epoch=0", ERASED)[0]
    seen = _checkpoint(tmp_path / "ck" / "a", old_id)
    other = _checkpoint(tmp_path / "ck" / "b", "f" * 64)
    receipt = erase_owner(EraseConfig(owner=ERASED, datasets=(dataset,), grace_ms=0, home=home,
                                      checkpoints=(tmp_path / "ck",)))
    assert receipt["owner"] == ERASED and receipt["owner_rows_before"] == before
    assert receipt["owner_rows_after"] == 0 and receipt["superseding_snapshots_verify"]
    assert receipt["keys_destroyed"]["generations_destroyed"] == [generation]
    assert receipt["changelog_tombstones"]["skipped"]
    snap = receipt["snapshots"][0]
    assert snap["snapshot_id"] == old_id and snap["rows_removed"] == before
    assert snap["superseded_files"]["state"] == "deleted"
    assert not (dataset / SUPERSEDED_DIR / old_id).exists()
    assert [t["path"] for t in receipt["tainted_checkpoints"]] == [str(seen.resolve())]
    with pytest.raises(TaintedCheckpointError, match=ERASED):
        refuse_tainted(seen, action="resume from")
    refuse_tainted(other, action="resume from")
    with pytest.raises(OwnerKeyDestroyedError):
        LocalOwnerKeyStore().data_key(ERASED)
    # a rerun reads the journal and ends in the same receipt
    assert erase_owner(EraseConfig(owner=ERASED, datasets=(dataset,), grace_ms=0,
                                   home=home)) == receipt


@pytest.mark.slow
@pytest.mark.parametrize("point", ["erase_after_keys", "erase_before_swap",
                                   "erase_between_renames", "erase_after_snapshot",
                                   "erase_after_checkpoints"])
def test_killed_erasure_rerun_ends_in_the_same_receipt(dataset: Path, tmp_path: Path,
                                                       point: str) -> None:
    home = tmp_path / "home"
    argv = [sys.executable, "-m", "hebrus_flywheel.cli", "erase", "--owner-pseudonym", ERASED,
            "--dataset", str(dataset), "--checkpoints", str(tmp_path / "ck"), "--grace", "0",
            "--no-changelogs", "--json"]
    _checkpoint(tmp_path / "ck" / "a", load_manifest(dataset / "epoch=0").snapshot_id)
    LocalOwnerKeyStore(tmp_path / "keys", create=True).data_key(ERASED, create=True)
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "FLYWHEEL_FAULT": point,
           "FLYWHEEL_KEK_FILE": str(default_kek_path()),
           "FLYWHEEL_OWNER_KEYS": str(tmp_path / "keys")}
    killed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 137, killed.stderr[-2000:]
    env.pop("FLYWHEEL_FAULT")
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    receipt = json.loads(first.stdout)
    assert json.loads(again.stdout) == receipt
    assert receipt["owner_rows_after"] == 0 and receipt["superseding_snapshots_verify"]
    assert len(receipt["tainted_checkpoints"]) == 1
    assert receipt["rows_removed"] == receipt["owner_rows_before"] > 0
    assert receipt["keys_destroyed"]["generations_destroyed"] == [0]
    assert not list((dataset / ".erasure").glob("*/epoch=*"))
    # the same receipt as an uninterrupted erasure of the same data (up to the ids and
    # sizes that random encryption keys change, paths and times)
    twin = tmp_path / "twin"
    write_planted_snapshot(twin, CONFIG)
    _checkpoint(tmp_path / "ck2" / "a", load_manifest(twin / "epoch=0").snapshot_id)
    LocalOwnerKeyStore(tmp_path / "keys2", create=True).data_key(ERASED, create=True)
    try:
        straight = erase_owner(EraseConfig(owner=ERASED, datasets=(twin,), grace_ms=0,
                                           home=tmp_path / "home2", key_store=tmp_path / "keys2",
                                           checkpoints=(tmp_path / "ck2",)))
    finally:
        make_writable(twin)
    assert _normalized(straight) == _normalized(receipt)


def _normalized(receipt: dict[str, object]) -> object:
    """A receipt without what differs between two erasures of the same content."""
    text = json.dumps(receipt, sort_keys=True)
    for item in receipt["snapshots"]:  # type: ignore[attr-defined]
        for key, name in (("snapshot_id", "OLD"), ("superseded_by", "NEW"),
                          ("dataset", "DATASET")):
            text = text.replace(item[key], name)
    body = json.loads(text)
    body.pop("started_at")
    for item in body["snapshots"]:
        item["superseded_files"] = {k: v for k, v in item["superseded_files"].items()
                                    if k not in ("deleted_at", "bytes")}
    for item in body["tainted_checkpoints"]:
        item["path"] = Path(item["path"]).name
    return body


def test_erase_config_refuses_raw_ids_and_negative_grace(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"EraseConfig\.owner"):
        EraseConfig(owner="alice", home=tmp_path)
    with pytest.raises(ConfigError, match=r"EraseConfig\.grace_ms"):
        EraseConfig(owner=ERASED, grace_ms=-1, home=tmp_path)


def test_taint_is_idempotent_and_unreadable_markers_fail_closed(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "ck", "a" * 64)
    assert add_taint(ck, {"owner": ERASED, "snapshots": ["a" * 64]})
    assert not add_taint(ck, {"owner": ERASED, "snapshots": ["a" * 64]})
    (ck / "tainted.json").write_text("{not json")
    with pytest.raises(TaintedCheckpointError, match="tainted"):
        refuse_tainted(ck / "checkpoint.pt", action="resume from")


def test_train_refuses_to_resume_from_a_tainted_checkpoint(tmp_path: Path) -> None:
    from hebrus_flywheel.train.config import TrainConfig
    from hebrus_flywheel.train.trainer import train

    ck = _checkpoint(tmp_path / "ck", "a" * 64)
    add_taint(ck, {"owner": ERASED, "snapshots": ["a" * 64]})
    with pytest.raises(TaintedCheckpointError, match="cannot resume from"):
        train(tmp_path / "nowhere", tmp_path / "out", TrainConfig(), resume=ck)
    with pytest.raises(TaintedCheckpointError, match="cannot write over"):
        train(tmp_path / "nowhere", ck, TrainConfig())


# -- the demo's erasure drill and how qualification reads it ------------------------------


def test_erasure_drill_erases_a_copy_and_measures_what_is_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hebrus_flywheel.consumers.erasure_drill import run_drill
    from hebrus_flywheel.train.qualify.collect_data import deletion_evidence

    home = tmp_path / "home"
    monkeypatch.setenv("FLYWHEEL_HOME", str(home))
    monkeypatch.delenv("FLYWHEEL_KEK_FILE", raising=False)
    monkeypatch.delenv("FLYWHEEL_OWNER_KEYS", raising=False)
    store = LocalOwnerKeyStore(create=True)
    store.data_key(ERASED, create=True)
    snap = write_planted_snapshot(home / "datasets" / "d", CONFIG)
    ck = _checkpoint(home / "run" / "checkpoint", snap.snapshot_id)
    try:
        drill = run_drill(snap.directory, ck, home / "run")
    finally:
        make_writable(home / "datasets")
    assert drill["state"] == "run" and drill["owner"] in (ERASED, KEPT)
    assert drill["owner_rows_before"] > 0 and drill["owner_rows_after"] == 0
    assert drill["plaintext_canary_hits"] == 0 and drill["plaintext_canary_scan"]["files"] > 0
    assert drill["superseding_snapshot"]["verifies"] is True
    assert drill["tainted_checkpoints"] == ["c" * 64]
    assert json.loads((home / "run" / "erasure-receipt.json").read_text()) == drill
    # the live demo data are untouched: same snapshot, same key
    assert load_manifest(snap.directory).snapshot_id == snap.snapshot_id
    assert LocalOwnerKeyStore().data_key(ERASED).generation == 0
    works, figures = deletion_evidence(drill)
    assert works is True and figures is not None and figures["owner_rows_after"] == 0


def test_erasure_drill_is_not_run_on_raw_owner_ids(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from hebrus_flywheel.consumers.erasure_drill import run_drill
    from hebrus_flywheel.train.qualify.collect_data import deletion_evidence

    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FLYWHEEL_KEK_FILE", raising=False)
    snap = write_planted_snapshot(tmp_path / "d", PlantedConfig(threads={"train": 2}))
    try:
        drill = run_drill(snap.directory, None, tmp_path)
    finally:
        make_writable(tmp_path / "d")
    assert drill["state"] == "not run" and "pseudonym" in drill["reason"]
    assert deletion_evidence(drill) == (None, {"state": "not run", "reason": drill["reason"]})


@pytest.mark.parametrize(("change", "works"), [
    ({}, True), ({"owner_rows_after": 3}, False), ({"plaintext_canary_hits": 2}, False),
    ({"superseding_snapshot": {"verifies": False}}, False), ({"owner_rows_before": 0}, None),
    ({"plaintext_canary_hits": None}, None)])
def test_deletion_is_measured_from_the_drill(change: dict[str, object],
                                             works: bool | None) -> None:
    from hebrus_flywheel.train.qualify.collect_data import deletion_evidence

    drill = {"state": "run", "owner_rows_before": 10, "owner_rows_after": 0,
             "plaintext_canary_hits": 0, "superseding_snapshot": {"verifies": True},
             "tainted_checkpoints": ["c"], **change}
    assert deletion_evidence(drill)[0] is works


def test_declared_deletion_support_is_refused() -> None:
    from types import SimpleNamespace

    from hebrus_flywheel.train.qualify.collect_data import authorization_evidence
    from hebrus_flywheel.train.qualify.errors import InputError

    info = SimpleNamespace(identity={"runtime_name": "reference"})
    declared = {"policy": "p", "approved": True, "production_transcripts": True}
    with pytest.raises(InputError, match="--erasure-receipt"):
        authorization_evidence(info, {**declared, "deletion_supported": True})  # type: ignore[arg-type]
    got = authorization_evidence(info, declared)  # type: ignore[arg-type]
    assert got is not None and got.deletion_supported is None and got.erasure_drill is None


def test_falsifier_8_falsified_when_the_drill_leaves_data() -> None:
    from types import SimpleNamespace

    from hebrus_flywheel.train.qualify import Authorization
    from hebrus_flywheel.train.qualify.config import QualificationConfig
    from hebrus_flywheel.train.qualify.falsifiers import f8_privacy

    drill = {"state": "run", "owner_rows_before": 10, "owner_rows_after": 0,
             "plaintext_canary_hits": 4, "plaintext_canary_hits_broker_logs": 4,
             "superseding_snapshot_verifies": True, "tainted_checkpoints": 1}

    def judge(deletion: bool | None, production: bool = True) -> tuple[str, str]:
        a = Authorization(policy="p", approved=True, production_transcripts=production,
                          deletion_supported=deletion, erasure_drill=drill)
        status, reason, figures, _, _ = f8_privacy(
            SimpleNamespace(integrity=SimpleNamespace(  # type: ignore[arg-type]
                authorization=a, consent=SimpleNamespace(rows=10, rows_granted=10))),
            QualificationConfig())
        assert figures["erasure_drill"] == drill
        return status, reason

    status, reason = judge(False)
    assert status == "falsified" and "4 plaintext canary hits (4 in broker logs)" in reason
    assert judge(True)[0] == "not_falsified"
    assert "10 owner rows before, 0 after" in judge(None, production=False)[1]


def test_a_later_erasure_taints_checkpoints_of_superseded_snapshots(dataset: Path,
                                                                     tmp_path: Path) -> None:
    from hebrus_flywheel.consumers.erasure import start_again

    original = load_manifest(dataset / "epoch=0").snapshot_id
    old = _checkpoint(tmp_path / "ck" / "old", original)
    first = erase_owner(EraseConfig(owner=ERASED, datasets=(dataset,), grace_ms=0,
                                    home=tmp_path / "h", checkpoints=(tmp_path / "ck",)))
    assert [t["path"] for t in first["tainted_checkpoints"]] == [str(old.resolve())]
    # the original snapshot (deleted) held KEPT's rows as well
    second = erase_owner(EraseConfig(owner=KEPT, datasets=(dataset,), grace_ms=0,
                                     home=tmp_path / "h", checkpoints=(tmp_path / "ck",)))
    assert second["snapshots"][0]["snapshot_id"] == first["snapshots"][0]["superseded_by"]
    assert [t["path"] for t in second["tainted_checkpoints"]] == [str(old.resolve())]
    with pytest.raises(TaintedCheckpointError, match=KEPT):
        refuse_tainted(old, action="resume from")
    # --again keeps the finished run's receipt and plans afresh
    config = EraseConfig(owner=KEPT, datasets=(dataset,), grace_ms=0, home=tmp_path / "h")
    kept = start_again(config)
    assert kept is not None and (kept / "receipt.json").is_file()
    third = erase_owner(config)
    assert third["snapshots"] == [] and third["owner_rows_after"] == 0


def test_shards_of_only_the_owner_stay_listed_with_zero_rows(tmp_path: Path) -> None:
    from hebrus_flywheel.core.snapshot import open_snapshot

    snap = write_planted_snapshot(tmp_path / "d", PlantedConfig(
        threads={"train": 1, "validation": 1}, owner_format=OWNER_FMT))
    try:
        new = supersede_epoch(tmp_path / "d", 0, snap.snapshot_id, KEPT, grace_ms=0)
        assert new["totals"]["rows"] == 0 and new["totals"]["shards"] == len(
            snap.manifest["shards"])
        assert verify_snapshot(snap.directory, keys=True)["rows"] == 0
        sealed = open_snapshot(snap.directory)
        assert all(sealed.read_shard(i, None).num_rows == 0
                   for i in range(len(sealed.manifest.shards)))
    finally:
        make_writable(tmp_path / "d")


# -- the command line ---------------------------------------------------------------------


def test_snapshots_expire_deletes_superseded_files_whose_grace_ended(dataset: Path,
                                                                      tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from hebrus_flywheel.consumers.cli import snapshots_app

    old_id = load_manifest(dataset / "epoch=0").snapshot_id
    erase_owner(EraseConfig(owner=ERASED, datasets=(dataset,), grace_ms=3_600_000,
                            home=tmp_path / "h"))
    marker = dataset / SUPERSEDED_DIR / f"{old_id}.json"
    body = json.loads(marker.read_text())
    marker.write_text(json.dumps({**body, "delete_after_ms": body["delete_after_ms"] - 7_200_000}))
    out = CliRunner().invoke(snapshots_app, ["expire", "--dataset", str(dataset),
                                             "--older-than", "30d"])
    assert out.exit_code == 0, out.output
    assert f"superseded snapshot {old_id}" in out.output
    assert not (dataset / SUPERSEDED_DIR / old_id).exists()


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLYWHEEL_HOME": str(home)}
    env.pop("FLYWHEEL_OWNER_KEYS", None)
    return subprocess.run([sys.executable, "-m", "hebrus_flywheel.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_errors_say_what_to_do(tmp_path: Path) -> None:
    no_store = _cli("erase", "--owner", "alice", "--no-changelogs", home=tmp_path)
    assert no_store.returncode == 2 and "--owner-pseudonym" in no_store.stderr
    assert "alice" not in no_store.stderr.replace("--owner alice", "")
    both = _cli("erase", "--owner", "a", "--owner-pseudonym", ERASED, home=tmp_path)
    assert both.returncode == 2 and "not both" in both.stderr
    bad = _cli("erase", "--owner-pseudonym", "o123", home=tmp_path)
    assert bad.returncode == 2 and "32 hex digits" in bad.stderr
    canary = tmp_path / "scan" / "log.txt"
    canary.parent.mkdir()
    canary.write_text("tokens: 50211, 7, 131072, 99\n")
    scan = _cli("erase", "--scan-canary", "50211,7,131072,99", "--scan-root",
                str(canary.parent), "--json", home=tmp_path)
    assert scan.returncode == 1 and json.loads(scan.stdout)["hits"] == 1


def test_erasure_refuses_while_workers_run_here(dataset: Path, tmp_path: Path) -> None:
    from hebrus_flywheel.consumers.erasure import EraseError
    from hebrus_flywheel.core.progress import write_health

    home = tmp_path / "h"
    write_health(home, {"kind": "streams", "name": "w1", "pid": os.getpid()})
    with pytest.raises(EraseError, match=r"streams worker w1 .*--allow-running-workers"):
        erase_owner(EraseConfig(owner=ERASED, datasets=(dataset,), home=home))
    done = erase_owner(EraseConfig(owner=ERASED, datasets=(dataset,), home=home,
                                   allow_running_workers=True, grace_ms=0))
    assert done["owner_rows_after"] == 0
