"""Close one block: replay its windows in fixed batches, pack the rows, write the shard.

Shared by the worker and the rebuild, so both turn the same block into the same bytes.
Batches are consecutive runs of ``batch_windows`` accepted windows of ONE block in
offset order: the engine always sees the same batches for the same block, whatever the
poll timing, so labels do not depend on which other partitions happened to be polled
(the engine need not be batch-invariant for shards to be deterministic).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hebrus_flywheel.consumers import faults
from hebrus_flywheel.consumers.epochs import Block
from hebrus_flywheel.consumers.exceptions import ShardError, WorkerError
from hebrus_flywheel.consumers.intake import Accepted
from hebrus_flywheel.consumers.labels import SourceRef, pack_rows
from hebrus_flywheel.consumers.shards import (
    ShardConfig,
    ShardInfo,
    ShardName,
    shard_relpath,
    write_shard,
)
from hebrus_flywheel.consumers.throughput import record_block
from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.core.snapshot import ShardLayout, shard_metadata

log = logging.getLogger(__name__)


class Replayer(Protocol):
    """What the worker needs from ``replay.prefill.PrefillReplayer``."""

    def replay(self, windows: Sequence[Any]) -> list[Any]: ...


@dataclass(frozen=True, kw_only=True)
class BlockSettings:
    """Everything besides the engine that decides a shard's bytes.

    Fields:
        root: dataset root the shards go under.
        shard: cutting and Parquet writer settings.
        batch_windows: windows per engine call (consecutive, within one block).
        route: the teacher's routing geometry (slots, experts, top-k, hidden width).
        identity_id: runtime identity every label is produced under.
        config_digest: digest of the determinism config, stamped into each shard.
        feature_contract: the engine's feature projection contract (digest and seed are
            stamped into each shard); None when the engine records none.
    """

    root: Path
    shard: ShardConfig
    batch_windows: int
    route: RouteGeometry
    identity_id: str
    config_digest: str
    feature_contract: Mapping[str, Any] | None = None


@dataclass
class ReplayMeasure:
    """Window tokens the teacher replayed in one block and the wall seconds it took."""

    tokens: int = 0
    batches: int = 0
    seconds: float = 0.0


def _replay_batches(engine: Replayer, items: Sequence[Accepted], batch: int,
                    stats: Counters, measure: ReplayMeasure) -> list[tuple[Any, SourceRef]]:
    out: list[tuple[Any, SourceRef]] = []
    for start in range(0, len(items), batch):
        chunk = items[start:start + batch]
        started = time.perf_counter()
        with stats.timer("replay"):
            labels = engine.replay([a.window for a in chunk])
        measure.seconds += time.perf_counter() - started
        tokens = sum(len(a.window.get("token_ids") or ()) for a in chunk)
        measure.tokens += tokens
        measure.batches += 1
        stats.inc("replay", "tokens", tokens)
        got = [getattr(lab, "window_id", None) for lab in labels]
        want = [a.window["window_id"] for a in chunk]
        if got != want:
            raise WorkerError(
                f"the replay engine returned labels for {got[:3]}... but was given {want[:3]}...; "
                "it must return one WindowLabels per window, in order"
            )
        stats.inc("replay", "windows", len(chunk))
        stats.inc("replay", "batches")
        out.extend(zip(labels, (a.source for a in chunk), strict=True))
        faults.hit("after_batch")
    return out


def _layout(settings: BlockSettings, first: Any) -> ShardLayout:
    route = settings.route
    shape: tuple[int, ...] = tuple(getattr(first.expert_ids_ALK, "shape", ()))
    features: tuple[int, ...] = tuple(getattr(first.features_ALD, "shape", ()))
    if len(shape) != 3 or tuple(shape[1:]) != (route.routed_layer_count, route.top_k):
        raise ShardError(
            f"engine labels have expert_ids shape {shape}, but the teacher routes "
            f"{route.routed_layer_count} layers x top-{route.top_k}; engine and teacher disagree"
        )
    if len(features) != 3:
        raise ShardError(f"engine features have shape {features}, expected [anchors, L, D]")
    dtype = "float32" if first.features_ALD.dtype == np.float32 else "float16"
    contract = settings.feature_contract or {}
    return ShardLayout(route=route, feature_dim=int(features[2]), hidden_dim=route.hidden_size,
                       weight_encoding=settings.shard.weight_encoding, feature_dtype=dtype,
                       projection_id=contract.get("projection_digest"),
                       projection_seed=contract.get("seed"))


def close_block(engine: Replayer, settings: BlockSettings, block: Block, split: str,
                items: Sequence[Accepted], stats: Counters) -> ShardInfo | None:
    """Replay and write one block; None (no file) when no window of it was accepted."""
    if not items:
        stats.inc("write", "empty_blocks")
        return None
    measure = ReplayMeasure()
    labelled = _replay_batches(engine, items, settings.batch_windows, stats, measure)
    layout = _layout(settings, labelled[0][0])
    with stats.timer("pack"):
        table = pack_rows(labelled, layout)
    name = ShardName(topic=block.topic, partition=block.partition,
                     first_offset=block.first, last_offset=block.last)
    table = table.replace_schema_metadata(shard_metadata(layout, {
        "epoch": block.epoch, "split": split, "topic": block.topic,
        "partition": block.partition, "first_offset": block.first, "last_offset": block.last,
        "identity_id": settings.identity_id, "config_digest": settings.config_digest,
        "windows": len(items), "rows": table.num_rows,
    }))
    with stats.timer("write"):
        info = write_shard(settings.root, shard_relpath(block.epoch, split, name), table,
                           settings.shard, windows=len(items))
    record_block(settings.root, block.epoch, info.relpath, windows=len(items), rows=info.rows,
                 tokens=measure.tokens, batches=measure.batches, seconds=measure.seconds)
    stats.inc("write", "shards")
    stats.inc("write", "rows", info.rows)
    stats.inc("write", "bytes", info.bytes)
    log.info("shard %s: %d windows, %d rows, %d bytes", info.relpath, info.windows, info.rows,
             info.bytes)
    return info
