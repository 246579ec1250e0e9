"""Measured replay throughput: what collection-time projections are computed from.

The design note's only honest collection estimate is
``collection_seconds = replay_tokens / sustained_teacher_prefill_tokens_per_second``.
Every closed block records, beside (never inside) its shard, how many window tokens the
frozen teacher replayed in prefill and the wall seconds of those engine calls
(``ROOT/.replay-throughput/epoch=N/<shard stem>.json``; written before the block's
offset is committed, rewritten by a restarted worker). The seal sums the records of the
shards it lists into the manifest's ``replay_throughput``: a measurement of the machine
that replayed, left out of ``content_id`` (a rebuild replays the same content at
another speed). Serialization, checkpoint loading and failed shards are not in it.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers.shards import SHARD_SUFFIX, STAGING_DIR
from hebrus_flywheel.core.files import atomic_write_json, make_dirs

log = logging.getLogger(__name__)

THROUGHPUT_DIR = ".replay-throughput"
MEASURED = ("teacher prefill wall seconds of each block's replay engine calls "
            "(consumers.blocks), summed over the epoch's shards, on the machine that "
            "replayed; serialization, shard writing and checkpoint loading excluded")
_SUMMED = ("windows", "rows", "tokens", "batches")


def record_path(root: Path, epoch: int, shard_relpath: str) -> Path:
    """Where the record of the shard at ``shard_relpath`` (under ``root``) lives."""
    name = Path(shard_relpath).name
    stem = name[: -len(SHARD_SUFFIX)] if name.endswith(SHARD_SUFFIX) else name
    split = Path(shard_relpath).parent.name
    return root / THROUGHPUT_DIR / f"epoch={epoch}" / split / f"{stem}.json"


def record_block(root: Path, epoch: int, shard_relpath: str, *, windows: int, rows: int,
                 tokens: int, batches: int, seconds: float) -> Path:
    """Write one block's measurement (atomically; replaces an earlier run's)."""
    path = record_path(root, epoch, shard_relpath)
    make_dirs(path.parent)
    body = {"shard": shard_relpath, "windows": windows, "rows": rows, "tokens": tokens,
            "batches": batches, "seconds": seconds, "cpu_count": os.cpu_count(),
            "machine": platform.machine()}
    staging = root / STAGING_DIR
    make_dirs(staging)
    atomic_write_json(path, body, tmp_dir=staging)
    return path


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("replay throughput record %s unreadable (%s): left out", path, exc)
        return None
    ok = isinstance(value, dict) and all(isinstance(value.get(k), int) for k in _SUMMED)
    return value if ok and isinstance(value.get("seconds"), int | float) else None


def summarize(root: Path, epoch: int, shards: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The manifest's ``replay_throughput`` for ``shards`` (manifest entries, paths
    relative to the epoch directory); None when no shard has a record."""
    found = []
    for entry in shards:
        record = _read(record_path(root, epoch, str(entry["path"])))
        if record is not None and record["rows"] == entry["rows"]:
            found.append(record)
    if not found:
        return None
    totals = {k: sum(int(r[k]) for r in found) for k in _SUMMED}
    seconds = sum(float(r["seconds"]) for r in found)
    machines = sorted({f"{r.get('machine')} ({r.get('cpu_count')} CPUs)" for r in found})
    return {
        "measured": MEASURED, "shards_measured": len(found), "shards": len(shards),
        **totals, "seconds": round(seconds, 6),
        "tokens_per_s": round(totals["tokens"] / seconds, 3) if seconds > 0 else None,
        "rows_per_s": round(totals["rows"] / seconds, 3) if seconds > 0 else None,
        "machines": machines,
    }
