"""``flywheel snapshots expire``: which sealed snapshots go, what stays, and resuming a
killed run (sealed snapshots in temporary dataset roots, no broker)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hebrus_flywheel.consumers.cli import snapshots_app
from hebrus_flywheel.consumers.expire import EXPIRING_DIR, ExpireConfig, expire_snapshots
from hebrus_flywheel.consumers.manifest import make_read_only
from hebrus_flywheel.core.errors import ConfigError
from tests.support.planted import PlantedConfig, make_writable, write_planted_snapshot

NOW = float(int(time.time()))  # the CLI reads the clock
DAY = 86_400.0
WEEK_MS = 7 * 86_400_000
CONFIG = PlantedConfig(threads={"train": 1}, tokens_per_thread=16, layers=2, experts=8,
                       top_k=2, hidden_dim=8, feature_dim=8)


@pytest.fixture(scope="module")
def sealed_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("template")
    write_planted_snapshot(root, CONFIG, read_only=False)
    return root / "epoch=0"


@pytest.fixture
def root(tmp_path: Path, sealed_template: Path) -> Path:
    """Sealed epochs 0..4 sealed 40, 30, 20, 10 and 1 days before NOW, an epoch 5 being
    written (no manifest) and an epoch 6 being sealed (manifest, still writable)."""
    ds = tmp_path / "ds"
    ds.mkdir()
    for epoch, age_days in enumerate((40, 30, 20, 10, 1)):
        target = ds / f"epoch={epoch}"
        shutil.copytree(sealed_template, target)
        os.utime(target / "manifest.json", (NOW - age_days * DAY, NOW - age_days * DAY))
        make_read_only(target)
    shutil.copytree(sealed_template, ds / "epoch=5")
    (ds / "epoch=5" / "manifest.json").unlink()
    shutil.copytree(sealed_template, ds / "epoch=6")
    yield ds
    make_writable(ds)


def _states(result) -> dict[int, str]:
    return {e.epoch: e.state for e in result.epochs}


def test_keeps_the_newest_and_the_young_deletes_the_rest(root: Path) -> None:
    result = expire_snapshots(ExpireConfig(root=root, keep=2, older_than_ms=15 * 86_400_000,
                                           now_s=NOW))
    assert _states(result) == {0: "removed", 1: "removed", 2: "removed", 3: "kept", 4: "kept",
                               5: "skipped", 6: "skipped"}
    assert sorted(p.name for p in root.glob("epoch=*")) == [
        "epoch=3", "epoch=4", "epoch=5", "epoch=6"]
    assert list((root / EXPIRING_DIR).iterdir()) == []
    removed = {e.epoch: e for e in result.removed}
    assert all(e.files > 0 and e.bytes > 0 and e.snapshot_id for e in removed.values())
    lines = result.lines()
    assert lines[0].startswith("removed      epoch=0 snapshot ")
    assert "sealed 40d ago" in lines[0]
    assert "(one of the newest 2)" in lines[3] and "(one of the newest 2)" in lines[4]
    assert "no manifest" in lines[5] and "still writable" in lines[6]
    assert lines[-1].startswith("removed 3 snapshot(s), ")
    again = expire_snapshots(ExpireConfig(root=root, keep=2, older_than_ms=15 * 86_400_000,
                                          now_s=NOW))
    assert again.removed == []  # idempotent


def test_age_decides_beyond_keep(root: Path) -> None:
    result = expire_snapshots(ExpireConfig(root=root, keep=0, older_than_ms=25 * 86_400_000,
                                           now_s=NOW))
    assert _states(result) == {0: "removed", 1: "removed", 2: "kept", 3: "kept", 4: "kept",
                               5: "skipped", 6: "skipped"}
    assert "(not older than 25d)" in result.lines()[2]


def test_dry_run_deletes_nothing_and_json_lists_it(root: Path) -> None:
    before = sorted(p.name for p in root.iterdir())
    out = CliRunner().invoke(snapshots_app, ["expire", "--dataset", str(root), "--keep", "1",
                                             "--older-than", "7d", "--dry-run", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["dry_run"] is True
    assert [e["epoch"] for e in report["removed"]] == [0, 1, 2, 3]
    assert {e["state"] for e in report["removed"]} == {"would remove"}
    assert sorted(p.name for p in root.iterdir()) == before
    assert not (root / EXPIRING_DIR).exists()


def test_a_killed_run_is_finished_by_the_next(root: Path) -> None:
    # what a run killed after the marker and half of the deletion leaves behind
    (root / EXPIRING_DIR).mkdir()
    (root / EXPIRING_DIR / "epoch=1.json").write_text('{"epoch": 1, "snapshot_id": "s1"}')
    target = root / "epoch=1"
    os.chmod(target, 0o750)
    (target / "manifest.json").unlink()
    dry = expire_snapshots(ExpireConfig(root=root, keep=10, older_than_ms=WEEK_MS, now_s=NOW,
                                        dry_run=True))
    assert _states(dry)[1] == "would resume" and target.exists()
    result = expire_snapshots(ExpireConfig(root=root, keep=10, older_than_ms=WEEK_MS,
                                           now_s=NOW))
    assert _states(result)[1] == "resumed"
    assert result.removed[0].snapshot_id == "s1" and result.removed[0].files > 0
    assert not target.exists()
    assert list((root / EXPIRING_DIR).iterdir()) == []
    assert all((root / f"epoch={n}").is_dir() for n in (0, 2, 3, 4))  # keep=10 kept them


def test_a_damaged_manifest_is_never_deleted(root: Path) -> None:
    os.chmod(root / "epoch=0", 0o750)
    os.chmod(root / "epoch=0" / "manifest.json", 0o640)
    (root / "epoch=0" / "manifest.json").write_text("{not json")
    os.chmod(root / "epoch=0", 0o550)
    result = expire_snapshots(ExpireConfig(root=root, keep=0, older_than_ms=1, now_s=NOW))
    assert _states(result)[0] == "skipped"
    assert "manifest unreadable" in result.epochs[[e.epoch for e in result.epochs].index(0)].reason
    assert (root / "epoch=0").is_dir()


@pytest.mark.parametrize(("field", "value"), [("keep", -1), ("keep", True),
                                              ("older_than_ms", 0), ("root", "/nonexistent")])
def test_config_validation_names_the_field(tmp_path: Path, field: str, value: object) -> None:
    base = {"root": tmp_path, "keep": 1, "older_than_ms": WEEK_MS}
    with pytest.raises(ConfigError, match=f"ExpireConfig.{field}"):
        ExpireConfig(**{**base, field: value})  # type: ignore[arg-type]
