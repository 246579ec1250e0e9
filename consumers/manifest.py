"""Build and write a sealed epoch's manifest (the writer side of the snapshot contract).

The manifest format, its ``Manifest`` type, digest (= snapshot id), parsing and
verification are the contract's (:mod:`hebrus_flywheel.core.snapshot`,
``docs/snapshot-format.md``). This module describes the shards on disk, checks them
against the epoch boundary and writes ``epoch=N/manifest.json`` atomically. It records
no timestamps or host names, so sealing the same shards twice gives the same id.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers.epochs import EpochBoundary, offsets_json
from hebrus_flywheel.consumers.exceptions import SealError
from hebrus_flywheel.consumers.shards import STAGING_DIR, ShardName, iter_shards, shard_summary
from hebrus_flywheel.core.files import (
    SEALED_DIR_MODE,
    SEALED_FILE_MODE,
    atomic_write_json,
    make_dirs,
    set_tree_modes,
)
from hebrus_flywheel.core.snapshot import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    ShardLayout,
    content_digest,
    manifest_digest,
    sha256_file,
    shard_product,
)

_GEOMETRY_KEYS = ("layers", "top_k", "feature_dim", "hidden_dim", "weight_encoding",
                  "feature_dtype", "route", "projection", "identity_id", "config_digest")


def _shard_entry(root: Path, epoch: int, split: str, path: Path) -> dict[str, Any]:
    name = ShardName.parse(path.name)
    summary = shard_summary(path)
    meta = summary["shard"]
    claimed = (meta.get("epoch"), meta.get("split"), meta.get("topic"), meta.get("partition"),
               meta.get("first_offset"), meta.get("last_offset"))
    if claimed != (epoch, split, name.topic, name.partition, name.first_offset, name.last_offset):
        raise SealError(
            f"{path} says it holds {claimed} in its metadata but its place and name say "
            f"epoch {epoch}, split {split}, {name}; it was moved or renamed — remove it"
        )
    return {
        "path": f"split={split}/{path.name}", "sha256": sha256_file(path),
        "plaintext_sha256": summary["plaintext_sha256"],
        "bytes": path.stat().st_size, "rows": summary["rows"], "windows": meta["windows"],
        "split": split, "topic": name.topic, "partition": name.partition,
        "first_offset": name.first_offset, "last_offset": name.last_offset,
        "geometry": {k: meta.get(k) for k in _GEOMETRY_KEYS},
        "encryption": summary["encryption"],
    }


def describe_shards(root: Path, epoch: int) -> list[dict[str, Any]]:
    """Manifest entries of every shard of ``epoch``, sorted by path (reads footers)."""
    return sorted((_shard_entry(root, e, s, p) for e, s, p in iter_shards(root, epoch)),
                  key=lambda entry: entry["path"])


def check_ranges(root: Path, boundary: EpochBoundary) -> None:
    """SealError when a shard of any epoch lies across, or wrongly beside, ``boundary``."""
    problems = []
    for epoch, _, path in iter_shards(root):
        name = ShardName.parse(path.name)
        start = boundary.start_of(name.topic, name.partition)
        end = boundary.end_of(name.topic, name.partition)
        first, last = name.first_offset, name.last_offset
        inside = epoch == boundary.epoch and start <= first and last < end
        before = epoch < boundary.epoch and last < start
        after = epoch > boundary.epoch and first >= end
        if not (inside or before or after):
            problems.append(f"epoch={epoch}/{path.name} (epoch {boundary.epoch} covers "
                            f"[{start}, {end}) of {name.topic}[{name.partition}])")
    if problems:
        raise SealError(
            "shards lie across the recorded epoch boundary: " + "; ".join(problems[:5])
            + ". A worker closed a block while the seal intent had expired; stop the workers, "
            "move those shards out, reset the group to the boundary and replay"
        )


def _geometry(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    kinds = {json.dumps(s["geometry"], sort_keys=True) for s in shards}
    if len(kinds) > 1:
        raise SealError(
            f"the epoch's shards disagree on geometry, identity or config: {sorted(kinds)}; "
            "they were written by differently configured workers — rebuild the epoch"
        )
    return dict(shards[0]["geometry"]) if shards else None


def _encryption(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    kinds = {json.dumps(s["encryption"], sort_keys=True) for s in shards}
    if len(kinds) > 1:
        raise SealError(
            f"the epoch's shards disagree on encryption (plaintext, KEK or key split): "
            f"{sorted(kinds)}; they were written by differently configured workers or with "
            "another key file — rebuild the epoch with one key file"
        )
    return shards[0]["encryption"] if shards else None


def _label_encoding(geometry: Mapping[str, Any] | None) -> dict[str, Any]:
    weights = None if geometry is None else ShardLayout.from_dict(geometry).weight_quantization()
    return {"expert_ids": "uint16, rank 0 first (exact)", "weights": weights,
            "features": None if geometry is None else geometry["feature_dtype"]}


def _splits(shards: Sequence[Mapping[str, Any]], layers: int) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for s in shards:
        entry = out.setdefault(s["split"], {"shards": 0, "windows": 0, "rows": 0, "labels": 0,
                                            "bytes": 0})
        entry["shards"] += 1
        entry["windows"] += s["windows"]
        entry["rows"] += s["rows"]
        entry["labels"] += s["rows"] * layers
        entry["bytes"] += s["bytes"]
    return dict(sorted(out.items()))


def _source(boundary: EpochBoundary, splits_by_topic: Mapping[str, str],
            source: Mapping[str, Any]) -> dict[str, Any]:
    start, end = offsets_json(boundary.start), offsets_json(boundary.end)
    topics = {
        t: {"split": splits_by_topic.get(t),
            "partitions": {p: {"start": start.get(t, {}).get(p, 0), "end": end[t][p]}
                           for p in end[t]}}
        for t in end
    }
    return {**dict(source), "topics": topics}


def build_manifest(*, epoch: int, dataset: Mapping[str, Any], boundary: EpochBoundary,
                   splits_by_topic: Mapping[str, str], shards: Sequence[Mapping[str, Any]],
                   parity: Mapping[str, Any] | None, parity_override: str | None,
                   previous_snapshot: str | None,
                   consent: Mapping[str, Any] | None = None,
                   replay_throughput: Mapping[str, Any] | None = None,
                   product: str | None = None) -> dict[str, Any]:
    """The manifest of one epoch, ``snapshot_id`` included; ``consent`` is the seal's
    consent measurement (:mod:`consumers.consent_seal`), absent from a rebuild's;
    ``replay_throughput`` the replay's measured speed (:mod:`consumers.throughput`);
    ``product`` the replay product the shards hold (None: no field, read as clean-path,
    what rebuilds of snapshots sealed before the field existed must reproduce)."""
    geometry = _geometry(shards)
    encryption = _encryption(shards)
    identity = dict(dataset["identity"])
    layers = int(dataset["determinism"]["geometry"]["layers"])
    entries = [{k: v for k, v in s.items() if k not in ("geometry", "encryption")}
               for s in shards]
    totals = {k: sum(s[k] for s in entries) for k in ("windows", "rows", "bytes")}
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT, "epoch": epoch, "previous_snapshot": previous_snapshot,
        "identity": identity,
        "teacher": {"model_family": identity.get("model_family"),
                    "model_artifact_digest": identity.get("model_artifact_digest"),
                    "dtype": identity.get("dtype"),
                    "kernel_path": identity.get("kernel_path") or ""},
        "tokenizer": {"tokenizer_digest": identity.get("tokenizer_digest"),
                      "chat_template_digest": identity.get("chat_template_digest")},
        "determinism": dataset["determinism"], "writer": dataset["writer"],
        "source": _source(boundary, splits_by_topic, dataset["source"]),
        "geometry": geometry,
        "label_encoding": _label_encoding(geometry),
        "shards": entries, "splits": _splits(entries, layers),
        "totals": {**totals, "shards": len(entries), "labels": totals["rows"] * layers},
        "parity": None if parity is None else dict(parity),
        "parity_override": None if parity_override is None else {"reason": parity_override},
        "encryption": encryption,
    }
    if product is not None:
        manifest["product"] = shard_product({"product": product})
    if consent is not None:
        manifest["consent"] = dict(consent)
    if replay_throughput is not None:
        manifest["replay_throughput"] = dict(replay_throughput)
    manifest["content_id"] = content_digest(manifest)
    manifest["snapshot_id"] = manifest_digest(manifest)
    return manifest


def write_manifest(root: Path, epoch_dir: Path, manifest: Mapping[str, Any]) -> Path:
    """Write ``manifest.json`` into ``epoch_dir`` atomically (via a temporary file)."""
    path = epoch_dir / MANIFEST_FILE
    make_dirs(epoch_dir)
    staging = root / STAGING_DIR
    make_dirs(staging)
    atomic_write_json(path, dict(manifest), tmp_dir=staging)
    return path


def make_read_only(epoch_dir: Path) -> None:
    """Seal: every file 0440 and every directory 0550 (owner and group read, nobody
    writes, others nothing), deepest first."""
    set_tree_modes(epoch_dir, file_mode=SEALED_FILE_MODE, dir_mode=SEALED_DIR_MODE)
