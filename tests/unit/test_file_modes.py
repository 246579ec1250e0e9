"""File modes do not depend on the umask: files 0640, directories 0750, sealed 0440/0550."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hebrus_flywheel.core.files import (
    append_file,
    atomic_replace_dir,
    atomic_write_bytes,
    atomic_write_json,
    create_file,
    make_dirs,
)
from hebrus_flywheel.train.checkpoint import save_checkpoint
from hebrus_flywheel.train.evaluate import write_report
from hebrus_flywheel.train.models import SidecarConfig
from tests.unit.test_manifest import sealed, write_block

UMASKS = [0o000, 0o022, 0o002]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def modes(root: Path) -> dict[str, int]:
    """``relative path -> mode`` of ``root`` and everything under it."""
    out = {".": mode(root)}
    for path in root.rglob("*"):
        out[str(path.relative_to(root))] = mode(path)
    return out


@pytest.fixture(params=UMASKS, ids=[f"umask{u:03o}" for u in UMASKS])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_helpers_create_0640_files_in_0750_dirs(umask: int, tmp_path: Path) -> None:
    deep = make_dirs(tmp_path / "a" / "b" / "c")
    atomic_write_bytes(deep / "x.bin", b"x")
    atomic_write_json(deep / "x.json", {"a": 1})
    with create_file(deep / "y.bin") as handle:
        handle.write(b"y")
    with append_file(deep / "h.jsonl") as handle:
        handle.write(b"{}\n")
    atomic_write_bytes(deep / "x.bin", b"again")  # a replacement keeps the mode
    assert modes(tmp_path / "a") == {".": 0o750, "b": 0o750, "b/c": 0o750,
                                     "b/c/x.bin": 0o640, "b/c/x.json": 0o640,
                                     "b/c/y.bin": 0o640, "b/c/h.jsonl": 0o640}


def test_make_dirs_leaves_existing_directories_alone(umask: int, tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o711)
    make_dirs(tmp_path / "new")
    assert (mode(tmp_path), mode(tmp_path / "new")) == (0o711, 0o750)
    os.chmod(tmp_path, 0o700)


def test_a_replaced_directory_gets_the_modes_whatever_wrote_it(umask: int,
                                                                tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    (staging / "sub").mkdir(parents=True, mode=0o777)
    (staging / "sub" / "f").write_bytes(b"library output")
    os.chmod(staging / "sub" / "f", 0o666)
    atomic_replace_dir(staging, tmp_path / "final")
    assert modes(tmp_path / "final") == {".": 0o750, "sub": 0o750, "sub/f": 0o640}


def test_shards_manifests_and_the_seal(umask: int, tmp_path: Path) -> None:
    root = tmp_path / "dataset"
    shard = write_block(root, 1, 0, 3)  # an unsealed epoch: writable by its owner
    assert mode(shard) == 0o640
    for directory in [root, *[root / p for p in shard.relative_to(root).parents if str(p) != "."]]:
        assert mode(directory) == 0o750, directory
    assert mode(root / ".staging") == 0o750
    sealed(root)  # epoch 0: two shards, the manifest, then the seal
    epoch = modes(root / "epoch=0")
    assert epoch["."] == 0o550 and "manifest.json" in epoch
    for name, got in epoch.items():
        want = 0o550 if (root / "epoch=0" / name).is_dir() else 0o440
        assert got == want, name
    for dirpath, _, _ in os.walk(root):  # let pytest clean up
        os.chmod(dirpath, 0o755)


def test_checkpoints_and_reports(umask: int, tmp_path: Path) -> None:
    config = SidecarConfig(feature_dim=8, rank=6, hidden=12, layer_count=3, expert_count=16)
    save_checkpoint(tmp_path / "run" / "best", config, {"w": torch.zeros(2)}, {"run": "x"})
    write_report({"ok": True}, tmp_path / "reports" / "eval" / "report.json")
    assert modes(tmp_path / "run") == {".": 0o750, "best": 0o750,
                                       "best/checkpoint.pt": 0o640, "best/lineage.json": 0o640}
    assert modes(tmp_path / "reports") == {".": 0o750, "eval": 0o750,
                                           "eval/report.json": 0o640}


def test_teacher_checkpoints_under_umask_0(tmp_path: Path) -> None:
    from hebrus_flywheel.replay.teacher import init_teacher

    old = os.umask(0)
    try:
        out = init_teacher(tmp_path / "teachers" / "tiny", preset="tiny-qwen3-next", seed=0)
    finally:
        os.umask(old)
    got = modes(out)
    assert got["."] == 0o750 and mode(out.parent) == 0o750 and len(got) > 3
    assert {m for name, m in got.items() if name != "."} == {0o640}, got
