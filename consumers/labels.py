"""Pack the replay engine's labels into shard rows (the writer side of the contract).

Pure functions from the replay engine's ``WindowLabels`` (plus where each window came
from) to an Arrow table with exactly :func:`hebrus_flywheel.core.snapshot.shard_schema`.
No I/O here; :mod:`consumers.shards` writes the table. The row format, every column and
its error bounds are the contract's (``core/snapshot``, ``docs/snapshot-format.md``);
this module only encodes into it:

* ``weights_u8``: ``q = round(w * 255)`` over [0, 1] (router weights after softmax /
  top-k renormalisation lie there), refused outside it; rank order is not re-derived
  from the weights, so ties introduced by rounding never change a label.
* ``margins`` float16, ``features`` in the engine's dtype, ``hidden`` null except for
  the engine's bounded diagnostic sample.

Tensor legend: A anchors, L routed layers, K top-k, D feature width, H hidden width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from hebrus_flywheel.consumers.exceptions import ShardError
from hebrus_flywheel.core.snapshot import FEATURE_DTYPES, U8_LEVELS, ShardLayout, shard_schema

_WEIGHT_TOLERANCE = 1e-5


@dataclass(frozen=True, kw_only=True)
class SourceRef:
    """Where one window record was read: topic, partition and offset."""

    topic: str
    partition: int
    offset: int


def quantize_weights_u8(weights: np.ndarray) -> np.ndarray:
    """``round(w * 255)`` as uint8; refuses non-finite weights or weights outside [0, 1]."""
    w = np.asarray(weights, dtype=np.float32)
    if not np.isfinite(w).all():
        raise ShardError("router weights contain NaN or infinity; the replay engine is broken")
    low, high = float(w.min(initial=0.0)), float(w.max(initial=0.0))
    if low < -_WEIGHT_TOLERANCE or high > 1.0 + _WEIGHT_TOLERANCE:
        raise ShardError(
            f"router weights span [{low}, {high}], outside [0, 1]; uint8 encoding needs "
            "probabilities — use weight_encoding='float16' for this weight rule"
        )
    return np.rint(np.clip(w, 0.0, 1.0) * U8_LEVELS).astype(np.uint8)


def _array(labels: Any, name: str, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    value = getattr(labels, name, None)
    if value is None:
        raise ShardError(f"WindowLabels.{name} is missing for window {labels.window_id}")
    arr = np.asarray(value)
    if arr.shape != shape:
        raise ShardError(
            f"WindowLabels.{name} of window {labels.window_id} has shape {arr.shape}, expected "
            f"{shape}; the engine and the dataset geometry disagree"
        )
    return arr.astype(dtype, copy=False)


@dataclass
class _Columns:
    """Per-window pieces, concatenated once at the end."""

    scalars: dict[str, list[Any]]
    arrays: dict[str, list[np.ndarray]]
    hidden: list[np.ndarray]
    hidden_valid: list[np.ndarray]


def _window_pieces(labels: Any, source: SourceRef, g: ShardLayout, cols: _Columns) -> None:
    ordinals = np.asarray(labels.anchor_ordinals_A, dtype=np.int64)
    if ordinals.ndim != 1 or len(ordinals) == 0:
        raise ShardError(f"window {labels.window_id} has no anchors; nothing to label")
    a, lk = len(ordinals), (len(ordinals), g.layers, g.top_k)
    order = np.argsort(ordinals, kind="stable")
    if np.any(np.diff(ordinals[order]) == 0):
        raise ShardError(f"window {labels.window_id} repeats an anchor ordinal")
    weights = _array(labels, "weights_ALK", np.float32, lk)[order]
    features = _array(labels, "features_ALD", FEATURE_DTYPES[g.feature_dtype][0],
                      (a, g.layers, g.feature_dim))[order]
    margins = _array(labels, "margins_AL", np.float32, (a, g.layers))[order]
    if not np.isfinite(features).all() or np.isnan(margins).any():
        raise ShardError(
            f"window {labels.window_id} has non-finite features or NaN margins; fp16 overflow "
            "or a broken forward — check the engine's feature projection"
        )
    cols.arrays["token_ordinal"].append(ordinals[order])
    cols.arrays["token_id"].append(_array(labels, "token_ids_A", np.int32, (a,))[order])
    cols.arrays["expert_ids"].append(_array(labels, "expert_ids_ALK", np.uint16, lk)[order])
    cols.arrays[g.weight_column].append(
        quantize_weights_u8(weights) if g.weight_encoding == "uint8" else weights.astype(np.float16)
    )
    cols.arrays["margins"].append(margins.astype(np.float16))
    cols.arrays["features"].append(features)
    hidden = getattr(labels, "hidden_ALH", None)
    shape = (a, g.layers, g.hidden_dim)
    if hidden is None:
        cols.hidden.append(np.zeros(shape, dtype=np.float32))
    else:
        cols.hidden.append(_array(labels, "hidden_ALH", np.float32, shape)[order])
    cols.hidden_valid.append(np.full(a, hidden is not None))
    values = {
        "source_topic": source.topic, "source_partition": source.partition,
        "source_offset": source.offset, "window_id": labels.window_id, "split": labels.split,
        "owner": labels.owner, "thread": labels.thread, "generation": int(labels.generation),
        "identity_id": labels.identity_id, "domain_tags": list(labels.domain_tags),
    }
    for name, value in values.items():
        cols.scalars[name].extend([value] * a)


def _list_array(values: np.ndarray, list_type: pa.DataType,
                mask: np.ndarray | None = None) -> pa.Array:
    """A (nested) fixed-size-list array of exactly ``list_type`` over flat ``values``."""
    levels = [list_type]
    while pa.types.is_fixed_size_list(levels[-1].value_type):
        levels.append(levels[-1].value_type)
    out: pa.Array = pa.array(values.reshape(-1), type=levels[-1].value_type)
    for level in reversed(levels):
        outer = level is list_type
        out = pa.FixedSizeListArray.from_arrays(
            out, type=level, mask=pa.array(~mask) if outer and mask is not None else None
        )
    return out


def pack_rows(items: Sequence[tuple[Any, SourceRef]], layout: ShardLayout) -> pa.Table:
    """One table of all anchors of ``items``, sorted by ``(source_offset, token_ordinal)``.

    ``items`` pairs each engine ``WindowLabels`` with the record it came from. The result
    has exactly :func:`shard_schema` (``layout``); ShardError on any malformed label.
    """
    schema = shard_schema(layout)
    g = layout
    names = ("token_ordinal", "token_id", "expert_ids", g.weight_column, "margins", "features")
    cols = _Columns(scalars={f.name: [] for f in schema if f.name in _SCALARS},
                    arrays={n: [] for n in names}, hidden=[], hidden_valid=[])
    for labels, source in sorted(items, key=lambda it: (it[1].topic, it[1].partition,
                                                        it[1].offset)):
        _window_pieces(labels, source, g, cols)
    if not cols.hidden:
        return schema.empty_table()
    cat = {n: np.concatenate(v) for n, v in cols.arrays.items()}
    valid = np.concatenate(cols.hidden_valid)
    typ = {f.name: f.type for f in schema}
    data = {
        **{n: pa.array(v, type=typ[n]) for n, v in cols.scalars.items()},
        "token_ordinal": pa.array(cat["token_ordinal"], type=pa.int64()),
        "token_id": pa.array(cat["token_id"], type=pa.int32()),
        **{n: _list_array(cat[n], typ[n]) for n in names[2:]},
        "hidden": _list_array(np.concatenate(cols.hidden), typ["hidden"], mask=valid),
    }
    return pa.table([data[f.name] for f in schema], schema=schema)


_SCALARS = frozenset({
    "source_topic", "source_partition", "source_offset", "window_id", "split", "owner",
    "thread", "generation", "identity_id", "domain_tags",
})
