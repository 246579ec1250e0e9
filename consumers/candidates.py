"""The candidate-path snapshot product: pack, write and seal candidate rows.

Rows are :func:`core.snapshot.candidate_shard_schema`: one per (proposal, path,
candidate position), with the clean rows' source lineage (where the window was read,
its split, owner, thread, generation, identity, domain tags) and the route at that
position; rejected-suffix rows are kept with ``accepted`` False. Rows are sorted by
:data:`core.snapshot.CANDIDATE_SORT_COLUMNS`, every writer option is the clean shards'
(:mod:`consumers.shards`: atomic, encrypted by default, ``plaintext_sha256`` in the
footer), and the footer's ``flywheel.shard`` record carries ``product:
candidate_path``. Shards live in their OWN dataset root (never beside clean shards),
named by the same block arithmetic (``<topic>.pNNN.o<first>-<last>.parquet`` under
``epoch=N/split=S/``), and the epoch is sealed by :func:`seal_candidate_epoch` with the
clean manifest builder (same checksums, epoch boundary and content id rules) plus
``product: candidate_path``, so :func:`core.snapshot.open_snapshot` refuses it for
clean-path readers.

Tensor legend: R rows, L routed layers, K top-k, D feature width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hebrus_flywheel.consumers.epochs import EpochBoundary
from hebrus_flywheel.consumers.exceptions import ShardError
from hebrus_flywheel.consumers.labels import SourceRef, _list_array
from hebrus_flywheel.consumers.manifest import (
    build_manifest,
    describe_shards,
    make_read_only,
    write_manifest,
)
from hebrus_flywheel.consumers.shards import (
    DEFAULT_CRYPTO,
    ShardConfig,
    ShardInfo,
    ShardName,
    epoch_dir,
    shard_relpath,
    write_shard,
)
from hebrus_flywheel.core.snapshot import (
    FEATURE_DTYPES,
    PRODUCT_CANDIDATE,
    ShardCrypto,
    ShardLayout,
    candidate_shard_schema,
    shard_metadata,
)

_SOURCE = ("source_topic", "source_partition", "source_offset", "window_id", "split", "owner",
           "thread", "generation", "identity_id", "domain_tags")
_PER_ANCHOR = ("proposal_id", "anchor_ordinal", "drafter_id")


@dataclass
class _Columns:
    scalars: dict[str, list[Any]]
    arrays: dict[str, list[np.ndarray]]


def _anchor_pieces(anchor: Any, source: SourceRef, g: ShardLayout, cols: _Columns) -> None:
    rows = len(anchor.path_id_R)
    shape = (rows, g.layers, g.top_k)
    ids = np.asarray(anchor.expert_ids_RLK)
    features = np.asarray(anchor.features_RLD, dtype=FEATURE_DTYPES[g.feature_dtype][0])
    if ids.shape != shape or features.shape != (rows, g.layers, g.feature_dim):
        raise ShardError(f"proposal {anchor.proposal_id}: expert_ids {ids.shape} / features "
                         f"{features.shape} do not match the layout {shape} / D={g.feature_dim}")
    weights = np.asarray(anchor.weights_RLK, dtype=np.float32)
    if not (np.isfinite(weights).all() and np.isfinite(features).all()):
        raise ShardError(f"proposal {anchor.proposal_id} has non-finite weights or features")
    accepted_W = np.asarray(anchor.accepted_W, dtype=np.int32)
    path_R = np.asarray(anchor.path_id_R, dtype=np.int32)
    position_R = np.asarray(anchor.position_R, dtype=np.int32)
    cols.arrays["path_id"].append(path_R)
    cols.arrays["candidate_position"].append(position_R)
    cols.arrays["candidate_token_id"].append(np.asarray(anchor.token_id_R, dtype=np.int32))
    cols.arrays["drafter_logprob"].append(np.asarray(anchor.logprob_R, dtype=np.float32))
    cols.arrays["expert_ids"].append(ids.astype(np.uint16))
    cols.arrays["weights_f16"].append(weights.astype(np.float16))
    cols.arrays["features"].append(features)
    cols.arrays["accepted_prefix_length"].append(accepted_W[path_R])
    cols.arrays["accepted"].append(position_R <= accepted_W[path_R])
    cols.scalars["accepted_prefix_digest"].extend(anchor.digests[p] for p in path_R.tolist())
    values = {
        "source_topic": source.topic, "source_partition": source.partition,
        "source_offset": source.offset, "window_id": anchor.window_id, "split": anchor.split,
        "owner": anchor.owner, "thread": anchor.thread, "generation": int(anchor.generation),
        "identity_id": anchor.identity_id, "domain_tags": list(anchor.domain_tags),
        "proposal_id": anchor.proposal_id, "anchor_ordinal": int(anchor.anchor_ordinal),
        "drafter_id": anchor.drafter_id,
    }
    for name, value in values.items():
        cols.scalars[name].extend([value] * rows)


def _sort_key(item: tuple[Any, SourceRef]) -> tuple[Any, ...]:
    anchor, source = item
    return (source.topic, source.partition, source.offset, anchor.anchor_ordinal,
            anchor.drafter_id)


def pack_candidate_rows(items: Sequence[tuple[Any, SourceRef]], layout: ShardLayout) -> pa.Table:
    """One table of every candidate row of ``items`` (``AnchorCandidates`` with the record
    each came from), sorted by the candidate sort columns; exactly the candidate schema."""
    schema = candidate_shard_schema(layout)
    typ = {f.name: f.type for f in schema}
    arrays = ("path_id", "candidate_position", "candidate_token_id", "drafter_logprob",
              "expert_ids", "weights_f16", "features", "accepted_prefix_length", "accepted")
    cols = _Columns(scalars={n: [] for n in (*_SOURCE, *_PER_ANCHOR, "accepted_prefix_digest")},
                    arrays={n: [] for n in arrays})
    for anchor, source in sorted(items, key=_sort_key):
        _anchor_pieces(anchor, source, layout, cols)
    if not cols.arrays["path_id"]:
        return schema.empty_table()
    cat = {n: np.concatenate(v) for n, v in cols.arrays.items()}
    data = {n: pa.array(v, type=typ[n]) for n, v in cols.scalars.items()}
    for name in ("path_id", "candidate_position", "candidate_token_id", "drafter_logprob",
                 "accepted_prefix_length", "accepted"):
        data[name] = pa.array(cat[name], type=typ[name])
    for name in ("expert_ids", "weights_f16", "features"):
        data[name] = _list_array(cat[name], typ[name])
    return pa.table([data[f.name] for f in schema], schema=schema)


def candidate_layout(route: Any, *, feature_dim: int, feature_dtype: str = "float16",
                     projection: Mapping[str, Any] | None = None) -> ShardLayout:
    """The layout of a candidate dataset (weights are always ``float16``)."""
    contract = projection or {}
    return ShardLayout(route=route, feature_dim=feature_dim, hidden_dim=route.hidden_size,
                       weight_encoding="float16", feature_dtype=feature_dtype,
                       projection_id=contract.get("projection_digest"),
                       projection_seed=contract.get("seed"))


@dataclass(frozen=True, kw_only=True)
class CandidateBlock:
    """One block of window records (``[first, last]`` offsets of one topic partition)
    and the anchors replayed from them."""

    epoch: int
    split: str
    topic: str
    partition: int
    first_offset: int
    last_offset: int
    windows: int

    @property
    def relpath(self) -> str:
        """The shard's path under the dataset root: the clean shard name of the block."""
        name = ShardName(topic=self.topic, partition=self.partition,
                         first_offset=self.first_offset, last_offset=self.last_offset)
        return shard_relpath(self.epoch, self.split, name)


def write_candidate_shard(root: Path, block: CandidateBlock,
                          items: Sequence[tuple[Any, SourceRef]], layout: ShardLayout, *,
                          identity_id: str, config_digest: str, shard: ShardConfig,
                          crypto: ShardCrypto | str | None = DEFAULT_CRYPTO) -> ShardInfo:
    """Pack and atomically write one candidate shard (see the module doc)."""
    table = pack_candidate_rows(items, layout)
    table = table.replace_schema_metadata(shard_metadata(layout, {
        "product": PRODUCT_CANDIDATE, "epoch": block.epoch, "split": block.split,
        "topic": block.topic, "partition": block.partition,
        "first_offset": block.first_offset, "last_offset": block.last_offset,
        "identity_id": identity_id, "config_digest": config_digest,
        "windows": block.windows, "rows": table.num_rows,
    }))
    return write_shard(root, block.relpath, table, shard, windows=block.windows, crypto=crypto)


def seal_candidate_epoch(root: Path, *, epoch: int, dataset: Mapping[str, Any],
                         boundary: EpochBoundary, splits_by_topic: Mapping[str, str],
                         parity: Mapping[str, Any] | None, parity_override: str | None = None,
                         previous_snapshot: str | None = None) -> dict[str, Any]:
    """Describe the epoch's candidate shards, write the manifest (``product:
    candidate_path``) and make the epoch read-only; the manifest."""
    shards = describe_shards(root, epoch)
    wrong = [s["path"] for s in shards if (s["geometry"] or {}).get("weight_encoding")
             != "float16"]
    if wrong:
        raise ShardError(f"{wrong[:3]} are not candidate shards; a candidate epoch holds only "
                         "candidate-path shards")
    manifest = build_manifest(
        epoch=epoch, dataset=dataset, boundary=boundary, splits_by_topic=splits_by_topic,
        shards=shards, parity=parity, parity_override=parity_override,
        previous_snapshot=previous_snapshot, product=PRODUCT_CANDIDATE)
    edir = epoch_dir(root, epoch)
    write_manifest(root, edir, manifest)
    make_read_only(edir)
    return manifest
