"""Taint markers of trained checkpoints: a checkpoint saw rows that were later erased.

``flywheel erase`` writes ``tainted.json`` beside a checkpoint's ``lineage.json`` when the
checkpoint was trained on a snapshot that held the erased owner's rows. The marker names
the owner's pseudonym (never a raw id), the snapshot(s) and the erasure receipt; it is a
separate file, so the checkpoint's id and bytes are unchanged. ``flywheel train`` refuses
to resume from, or write over, a tainted checkpoint (:func:`refuse_tainted`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.core.files import atomic_write_json

TAINT_FILE = "tainted.json"
PUBLISHED_FILE = "published.json"
"""Beside a checkpoint staged for an object store: ``{"url": ...}`` where it was published."""
TAINT_FORMAT = "hebrus-flywheel-taint/v1"


class TaintedCheckpointError(FlywheelError):
    """A checkpoint trained on erased rows was about to be reused."""


def checkpoint_dir(path: Path) -> Path:
    """The checkpoint directory of ``path`` (a directory, or a file such as
    ``checkpoint.pt`` inside one, existing or not)."""
    path = Path(path)
    return path.parent if path.is_file() or (not path.is_dir() and path.suffix) else path


def read_taint(path: Path) -> list[dict[str, Any]]:
    """Every erasure that tainted the checkpoint at ``path`` (empty when it is clean)."""
    marker = checkpoint_dir(path) / TAINT_FILE
    if not marker.is_file():
        return []
    try:
        body = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        # an unreadable marker still says "tainted": fail closed
        return [{"owner": "unknown", "reason": f"{marker} is unreadable"}]
    taints = body.get("taints") if isinstance(body, dict) else None
    return [t for t in taints if isinstance(t, dict)] if isinstance(taints, list) else [
        {"owner": "unknown", "reason": f"{marker} is not a {TAINT_FORMAT} file"}]


def add_taint(path: Path, taint: Mapping[str, Any]) -> bool:
    """Record ``taint`` (owner, snapshots, receipt) on the checkpoint at ``path``;
    False when the same owner's taint is already recorded (idempotent)."""
    taints = read_taint(path)
    if any(t.get("owner") == taint.get("owner") for t in taints):
        return False
    atomic_write_json(checkpoint_dir(path) / TAINT_FILE,
                      {"format": TAINT_FORMAT, "taints": [*taints, dict(taint)]})
    return True


def refuse_tainted(path: Path, *, action: str) -> None:
    """TaintedCheckpointError when the checkpoint at ``path`` is tainted."""
    taints = read_taint(path)
    if not taints:
        return
    owners = ", ".join(sorted({str(t.get("owner")) for t in taints}))
    snapshots = sorted({s for t in taints for s in t.get("snapshots", [])})
    raise TaintedCheckpointError(
        f"cannot {action} the checkpoint {checkpoint_dir(path)}: it is tainted, it was "
        f"trained on rows of erased owner(s) {owners} (snapshot(s) "
        f"{', '.join(s[:12] for s in snapshots) or 'unknown'}; see "
        f"{checkpoint_dir(path) / TAINT_FILE}). Train from scratch on the superseding "
        "snapshot instead (`flywheel train --snapshot DATA/epoch=N --out NEW_DIR`)")


def taint_published(path: Path) -> str | None:
    """Copy the taint marker of a checkpoint staged for an object store to where it was
    published (``published.json``), with the sealer's keys; the URL, or None when the
    checkpoint was never published."""
    from hebrus_flywheel.core.storage import WRITE_ROLE, S3Store, StorageError, s3_target

    directory = checkpoint_dir(path)
    try:
        url = str(json.loads((directory / PUBLISHED_FILE).read_text(encoding="utf-8"))["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        S3Store(url, s3_target(WRITE_ROLE)).put_file(TAINT_FILE, directory / TAINT_FILE)
    except StorageError as exc:
        raise TaintedCheckpointError(f"the checkpoint published at {url} could not be marked "
                                     f"tainted ({exc}); re-run the erasure") from exc
    return url
