"""``flywheel snapshots expire``: delete the files of old sealed snapshots under a dataset root.

Which epochs go: every *sealed* epoch (``epoch=N/manifest.json`` readable and the epoch
directory read-only, i.e. ``flywheel seal`` finished) except the newest ``keep`` ones
(by epoch number, whatever their age), whose manifest was written more than
``older_than`` ago (the manifest file's mtime is the seal time: manifests carry no
timestamps). An epoch without a manifest is being written by replay workers, one with a
manifest but still writable is being sealed, one whose manifest cannot be read cannot be
identified: none of them is ever touched.

How, resumably: for each epoch a marker ``ROOT/.expiring/epoch=N.json`` (epoch, snapshot
id) is written first, then the read-only tree is made writable and deleted, then the
marker is removed. A run killed half-way leaves the marker; the next run finishes every
marked epoch first (state ``resumed``), so the result is the same as an uninterrupted
run. Running it again changes nothing. ``--dry-run`` writes and deletes nothing.

What it does not do: later manifests still name the deleted snapshot as
``previous_snapshot``; the topics it was made from are governed by the topic retention
(``streams.retention``) and are not touched; the key file is shared and is kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers.exceptions import ConsumersError, ExpireError
from hebrus_flywheel.core.durations import format_duration_ms
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write_json, make_dirs
from hebrus_flywheel.core.snapshot import MANIFEST_FILE, load_manifest
from hebrus_flywheel.core.snapshot.errors import SnapshotContractError

EXPIRING_DIR = ".expiring"
_EPOCH_RE = re.compile(r"^epoch=(?P<n>[0-9]+)$")
_MARKER_RE = re.compile(r"^epoch=(?P<n>[0-9]+)\.json$")


@dataclass(frozen=True, kw_only=True)
class ExpireConfig:
    """One ``flywheel snapshots expire`` run.

    Fields:
        root: dataset root holding ``epoch=N`` directories.
        older_than_ms: only snapshots sealed more than this long ago go (> 0).
        keep: the newest ``keep`` sealed snapshots stay whatever their age (>= 0).
        dry_run: report what would go; write and delete nothing.
        now_s: the current time (seconds since the epoch); None reads the clock.
    """

    root: Path
    older_than_ms: int
    keep: int = 1
    dry_run: bool = False
    now_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 0:
            raise ConfigError(f"ExpireConfig.keep must be an integer >= 0, got {self.keep!r}")
        if (isinstance(self.older_than_ms, bool) or not isinstance(self.older_than_ms, int)
                or self.older_than_ms <= 0):
            raise ConfigError("ExpireConfig.older_than_ms must be a positive number of "
                              f"milliseconds, got {self.older_than_ms!r}")
        if not Path(self.root).is_dir():
            raise ConfigError(f"ExpireConfig.root: {self.root} is not a directory; pass the "
                              "dataset root (the folder holding epoch=N directories)")


@dataclass(frozen=True, kw_only=True)
class EpochOutcome:
    """One epoch the run looked at."""

    epoch: int
    state: str
    """``removed``, ``resumed`` (finished a killed run's deletion), ``would remove``,
    ``would resume``, or ``kept`` / ``skipped`` with a reason."""
    snapshot_id: str | None = None
    reason: str = ""
    files: int = 0
    bytes: int = 0
    sealed_age: str | None = None


@dataclass(kw_only=True)
class ExpireResult:
    root: str
    dry_run: bool
    epochs: list[EpochOutcome] = field(default_factory=list)

    @property
    def removed(self) -> list[EpochOutcome]:
        return sorted((e for e in self.epochs if e.state in (
            "removed", "resumed", "would remove", "would resume")), key=lambda e: e.epoch)

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "dry_run": self.dry_run,
                "removed": [asdict(e) for e in self.removed],
                "files": sum(e.files for e in self.removed),
                "bytes": sum(e.bytes for e in self.removed),
                "epochs": [asdict(e) for e in sorted(self.epochs, key=lambda e: e.epoch)]}

    def lines(self) -> list[str]:
        out = []
        for e in sorted(self.epochs, key=lambda e: e.epoch):
            what = f"epoch={e.epoch}" + (f" snapshot {e.snapshot_id}" if e.snapshot_id else "")
            size = f": {e.files} files, {e.bytes} bytes" if e in self.removed else ""
            age = f", sealed {e.sealed_age} ago" if e.sealed_age else ""
            out.append(f"{e.state:12} {what}{size}{age}{f' ({e.reason})' if e.reason else ''}")
        verb = "would remove" if self.dry_run else "removed"
        out.append(f"{verb} {len(self.removed)} snapshot(s), "
                   f"{sum(e.files for e in self.removed)} files, "
                   f"{sum(e.bytes for e in self.removed)} bytes under {self.root}")
        return out


@dataclass(frozen=True, kw_only=True)
class _Epoch:
    epoch: int
    path: Path
    snapshot_id: str | None
    sealed_at: float | None
    skip: str = ""


def _tree_size(path: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            files += 1
            size += (Path(dirpath) / name).lstat().st_size
    return files, size


def _inspect(path: Path, epoch: int) -> _Epoch:
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return _Epoch(epoch=epoch, path=path, snapshot_id=None, sealed_at=None,
                      skip="not sealed: no manifest (replay workers may be writing it)")
    if path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return _Epoch(epoch=epoch, path=path, snapshot_id=None, sealed_at=None,
                      skip="being sealed: the epoch directory is still writable")
    try:
        snapshot_id = load_manifest(path).snapshot_id
    except (SnapshotContractError, ConsumersError) as exc:
        return _Epoch(epoch=epoch, path=path, snapshot_id=None, sealed_at=None,
                      skip=f"manifest unreadable, not touched: {exc}")
    return _Epoch(epoch=epoch, path=path, snapshot_id=snapshot_id,
                  sealed_at=manifest.stat().st_mtime)


def _epochs(root: Path) -> list[_Epoch]:
    found = []
    for child in root.iterdir():
        match = _EPOCH_RE.match(child.name)
        if match and child.is_dir() and not child.is_symlink():
            found.append(_inspect(child, int(match["n"])))
    return sorted(found, key=lambda e: e.epoch, reverse=True)


def _delete_tree(path: Path) -> None:
    """Make a read-only tree writable (directories first, top down) and delete it."""
    if not path.exists():
        return
    for dirpath, _, _ in os.walk(path):
        os.chmod(dirpath, 0o700)
    shutil.rmtree(path)


def _remove(root: Path, epoch: int, snapshot_id: str | None, state: str) -> EpochOutcome:
    markers = root / EXPIRING_DIR
    marker = markers / f"epoch={epoch}.json"
    target = root / f"epoch={epoch}"
    files, size = _tree_size(target) if target.exists() else (0, 0)
    if not marker.exists():
        make_dirs(markers)
        atomic_write_json(marker, {"epoch": epoch, "snapshot_id": snapshot_id})
    try:
        _delete_tree(target)
    except OSError as exc:
        raise ExpireError(f"cannot delete {target}: {exc}; fix the permissions and run "
                          "`flywheel snapshots expire` again (it resumes from the marker "
                          f"{marker})") from exc
    marker.unlink()
    return EpochOutcome(epoch=epoch, state=state, snapshot_id=snapshot_id, files=files,
                        bytes=size)


def _pending(root: Path) -> dict[int, str | None]:
    """Epochs a killed run began to delete: epoch -> snapshot id."""
    markers = root / EXPIRING_DIR
    out: dict[int, str | None] = {}
    if not markers.is_dir():
        return out
    for marker in markers.iterdir():
        match = _MARKER_RE.match(marker.name)
        if match is None:
            continue
        try:
            out[int(match["n"])] = json.loads(marker.read_text(encoding="utf-8")).get(
                "snapshot_id")
        except (OSError, ValueError, AttributeError):
            out[int(match["n"])] = None
    return out


def _age(now: float, sealed_at: float) -> str:
    return format_duration_ms(max(0, int(now - sealed_at)) * 1000)


def expire_snapshots(config: ExpireConfig) -> ExpireResult:
    """Delete old sealed snapshots' files as the module doc says (oldest first); what
    happened per epoch."""
    root = Path(config.root).resolve()
    now = time.time() if config.now_s is None else config.now_s
    result = ExpireResult(root=str(root), dry_run=config.dry_run)
    pending = _pending(root)
    for epoch, snapshot_id in sorted(pending.items()):
        result.epochs.append(
            EpochOutcome(epoch=epoch, state="would resume", snapshot_id=snapshot_id)
            if config.dry_run else _remove(root, epoch, snapshot_id, "resumed"))
    decided = _decide(config, [e for e in _epochs(root) if e.epoch not in pending], now)
    for e, outcome in sorted(decided, key=lambda pair: pair[0].epoch):
        if outcome.state == "would remove" and not config.dry_run:
            outcome = _with(_remove(root, e.epoch, e.snapshot_id, "removed"),
                            sealed_age=outcome.sealed_age)
        result.epochs.append(outcome)
    return result


def _decide(config: ExpireConfig, epochs: list[_Epoch],
            now: float) -> list[tuple[_Epoch, EpochOutcome]]:
    """Newest first: skipped, kept (newest ``keep`` or too young) or ``would remove``."""
    out, sealed_seen = [], 0
    for e in epochs:
        if e.skip or e.sealed_at is None:
            out.append((e, EpochOutcome(epoch=e.epoch, state="skipped", reason=e.skip)))
            continue
        sealed_seen += 1
        outcome = EpochOutcome(epoch=e.epoch, state="kept", snapshot_id=e.snapshot_id,
                               sealed_age=_age(now, e.sealed_at))
        if sealed_seen <= config.keep:
            outcome = _with(outcome, reason=f"one of the newest {config.keep}")
        elif (now - e.sealed_at) * 1000 <= config.older_than_ms:
            outcome = _with(outcome, reason="not older than "
                            f"{format_duration_ms(config.older_than_ms)}")
        else:
            files, size = _tree_size(e.path)
            outcome = _with(outcome, state="would remove", files=files, bytes=size)
        out.append((e, outcome))
    return out


def _with(outcome: EpochOutcome, **changes: Any) -> EpochOutcome:
    return EpochOutcome(**{**asdict(outcome), **changes})
