"""The base package: geometry, canonical JSON, atomic files, counters, install layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_replace_dir, atomic_write_bytes, atomic_write_json
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.core.identity import compute_identity_id
from hebrus_flywheel.core.jsonio import canonical_digest, canonical_json

GEOMETRY = RouteGeometry(family="qwen3_next", routed_layers=(1, 3), layer_count=4,
                         expert_count=512, top_k=10, hidden_size=64,
                         routed_intermediate_size=32)


def test_geometry_round_trips_and_maps_slots() -> None:
    assert RouteGeometry.from_dict(json.loads(json.dumps(GEOMETRY.to_dict()))) == GEOMETRY
    assert GEOMETRY.routed_layer_count == 2
    assert [GEOMETRY.slot_of(1), GEOMETRY.slot_of(3)] == [0, 1]
    with pytest.raises(ConfigError, match="not routed"):
        GEOMETRY.slot_of(2)
    assert GEOMETRY.expert_bytes(2) == 3 * 64 * 32 * 2


def test_geometry_is_frozen_and_rejects_unknown_fields() -> None:
    with pytest.raises(AttributeError):
        GEOMETRY.top_k = 8  # type: ignore[misc]
    with pytest.raises(ConfigError, match="unknown RouteGeometry fields"):
        RouteGeometry.from_dict({**GEOMETRY.to_dict(), "experts": 4})
    with pytest.raises(ConfigError, match="incomplete"):
        RouteGeometry.from_dict({"family": "x"})


def test_geometry_from_identity_record() -> None:
    identity = {"model_family": "qwen3_next", "routed_layer_count": 4, "expert_count": 512,
                "top_k": 10, "hidden_size": 64, "routed_intermediate_size": 32,
                "weight_rule": "softmax_topk_renormalized",
                "tie_break_rule": "score_desc_then_expert_id_asc"}
    geometry = RouteGeometry.from_identity(identity)
    assert geometry.routed_layers == (0, 1, 2, 3) and geometry.layer_count == 4
    assert geometry.tie_break_rule == identity["tie_break_rule"]


def test_canonical_json_is_key_order_free_and_utf8() -> None:
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()
    assert canonical_digest({"b": 1, "a": 2}) == canonical_digest({"a": 2, "b": 1})
    assert compute_identity_id({"a": 1, "identity_id": "x"}) == canonical_digest({"a": 1})


def test_atomic_writes_replace_whole_files(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_write_json(target, {"b": 1, "a": [1, 2]})
    assert json.loads(target.read_text()) == {"a": [1, 2], "b": 1}
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]  # no temporary left

    def boom(handle: object) -> None:
        raise RuntimeError("disk full")

    from hebrus_flywheel.core.files import atomic_write
    with pytest.raises(RuntimeError):
        atomic_write(target, boom)
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_atomic_replace_dir(tmp_path: Path) -> None:
    staging = tmp_path / ".staging"
    (staging / "sub").mkdir(parents=True)
    (staging / "sub" / "x").write_bytes(b"1")
    atomic_replace_dir(staging, tmp_path / "final")
    assert (tmp_path / "final" / "sub" / "x").read_bytes() == b"1" and not staging.exists()


def test_counters_by_stage() -> None:
    counters = Counters()
    counters.inc("validate", "ok", 3)
    counters.inc("validate", "quarantined")
    counters.merge({"window/emitted": 2})
    with counters.timer("validate"):
        pass
    assert counters.stage("validate") == {"ok": 3, "quarantined": 1}
    assert counters.as_dict() == {"validate/ok": 3, "validate/quarantined": 1,
                                  "window/emitted": 2}
    assert set(counters.report()) == {"counts", "seconds"}


@pytest.mark.parametrize("name", ["train", "schemas", "streams", "replay", "consumers",
                                  "core", "flywheel"])
def test_installing_claims_no_generic_top_level_name(name: str, tmp_path: Path) -> None:
    """Outside the repository, only ``hebrus_flywheel`` is ours."""
    ours = "core" if name == "flywheel" else name
    code = ("import importlib.util as u, sys\n"
            f"spec = u.find_spec({name!r})\n"
            "assert spec is None or 'hebrus' not in str(spec.origin), spec.origin\n"
            f"import hebrus_flywheel.{ours}\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_pid_alive_sees_live_dead_and_zombie_processes() -> None:
    from hebrus_flywheel.core.processes import pid_alive

    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while pid_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # exited but not reaped: a zombie, which counts as dead
    assert not pid_alive(child.pid)
    child.wait()
    assert not pid_alive(child.pid)
