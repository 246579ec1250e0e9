"""A dataset root: ``dataset.json``, the Hive-style shard tree and the staging folder.

::

    ROOT/dataset.json                     identity, determinism config, writer versions
    ROOT/.staging/                        in-progress files (never read by anyone)
    ROOT/epoch=N/split=S/<shard>.parquet  durable shards
    ROOT/epoch=N/manifest.json            written by ``flywheel seal --epoch N``

One dataset holds the labels of ONE runtime identity made with ONE determinism config
(shard cutting, batching, thread count, replay options) and one set of writer library
versions, because a snapshot is only rebuildable if all of its shards were produced the
same way. The first worker writes ``dataset.json``; a worker started later with a
different identity, config or library versions is refused with the differing fields.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers.exceptions import DatasetError
from hebrus_flywheel.consumers.shards import STAGING_DIR, ShardName, iter_shards, read_window_ids
from hebrus_flywheel.core.files import atomic_write_json, make_dirs
from hebrus_flywheel.core.jsonio import canonical_digest, canonical_json

DATASET_FILE = "dataset.json"
DATASET_FORMAT = "hebrus-flywheel-dataset/v1"
_COMPARED = ("identity", "determinism", "writer", "source")


def writer_versions() -> dict[str, str]:
    """Library versions that decide the bytes of a shard (read without importing torch)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("pyarrow", "torch", "transformers", "numpy", "hebrus-flywheel"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def config_digest(determinism: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the canonical JSON of a determinism record (stamped into shards)."""
    return canonical_digest(determinism)


def dataset_record(*, identity: Mapping[str, Any], determinism: Mapping[str, Any],
                   source: Mapping[str, Any]) -> dict[str, Any]:
    """The ``dataset.json`` body for a worker with this identity, config and source."""
    return {
        "format": DATASET_FORMAT,
        "identity": dict(identity),
        "determinism": json.loads(canonical_json(determinism)),
        "writer": writer_versions(),
        "source": dict(source),
    }


def read_dataset(root: Path) -> dict[str, Any]:
    """The ``dataset.json`` of ``root``; DatasetError when there is none."""
    path = root / DATASET_FILE
    if not path.is_file():
        raise DatasetError(
            f"{root} has no {DATASET_FILE}: no replay worker has written to it. Start "
            "`flywheel replay worker --dataset ROOT` first, or point at the right root"
        )
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}; restore it from a snapshot") from exc
    if not isinstance(value, dict) or value.get("format") != DATASET_FORMAT:
        raise DatasetError(f"{path} is not a {DATASET_FORMAT} file")
    return value


def _differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key}: dataset={a!r} now={b!r}")
    return out


def open_dataset(root: Path, record: Mapping[str, Any]) -> Path:
    """Create ``root`` with ``record`` as its ``dataset.json``, or check it matches."""
    root = Path(root).resolve()
    make_dirs(root / STAGING_DIR)
    path = root / DATASET_FILE
    if not path.exists():
        atomic_write_json(path, dict(record))
        return root
    existing = read_dataset(root)
    diffs = [d for field in _COMPARED
             for d in _differences(existing.get(field) or {}, record.get(field) or {}, f"{field}.")]
    if diffs:
        raise DatasetError(
            f"{root} was started with another identity, config or library versions: "
            + "; ".join(diffs[:8]) + (" ..." if len(diffs) > 8 else "")
            + ". Run with the dataset's settings (and library versions), or use a new --dataset"
        )
    return root


def written_ids(root: Path, topic: str, partition: int, *, before: int) -> set[str]:
    """Window ids in every shard of ``topic[partition]`` that ends before offset ``before``.

    These are exactly the windows a worker accepted at earlier offsets, so a restarted
    worker drops the same repeats an uninterrupted one would have dropped.
    """
    ids: set[str] = set()
    for _, _, path in iter_shards(root):
        name = ShardName.parse(path.name)
        if name.topic == topic and name.partition == partition and name.last_offset < before:
            ids.update(read_window_ids(path))
    return ids
