"""The shard row format: one row per anchor token, every routed layer in fixed-size lists.

Pure functions from the replay engine's ``WindowLabels`` (plus where each window came
from) to an Arrow table with an explicit schema. No I/O here; :mod:`consumers.shards`
writes the table.

Row layout (why): a training example is one anchor token with its labels at all L
layers, so one row per token keeps the per-token lineage columns once per token instead
of once per (token, layer), and ``expert_ids[l][r]`` reads naturally in DuckDB, Polars
and pyarrow. Rows are sorted by ``(source_offset, token_ordinal)``.

Label encoding and its error (measured in ``tests/unit/test_shards.py``):

* ``expert_ids``: uint16 ``[L][K]``, rank 0 first (exact). Parquet stores them
  dictionary-encoded (at most E distinct values), about ``log2(E)`` bits per id.
* ``weights_u8`` (default): ``q = round(w * 255)`` per weight over the fixed range
  [0, 1] (router weights after softmax / top-k renormalisation lie there), decoded as
  ``w = q / 255``. Absolute error at most ``0.5 / 255 = 0.00196`` per weight; a row's
  decoded weights sum to 1 within ``K * 0.00196``. Rank order is not re-derived from the
  weights, so ties introduced by rounding never change a label.
* ``weights_f16`` (``weight_encoding="float16"``): IEEE half, relative error <= 2**-11.
* ``margins``: float16 ``[L]``, router-score gap between rank K-1 and rank K (+inf when
  K equals the expert count), for near-tie analysis.
* ``features``: float16 ``[L][D]`` (float32 if the engine is configured so), the
  engine's reduced sidecar features (fixed seeded projection, ``replay.features``).
* ``hidden``: float32 ``[L][H]`` full-width pre-attention states, null except for the
  engine's bounded diagnostic sample.

Tensor legend: A anchors, L routed layers, K top-k, D feature width, H hidden width.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from hebrus_flywheel.consumers.exceptions import ShardError

SHARD_FORMAT = "hebrus-flywheel-shard/v1"
WEIGHT_ENCODINGS: tuple[str, ...] = ("uint8", "float16")
FEATURE_DTYPES: dict[str, Any] = {"float16": (np.float16, pa.float16()),
                                  "float32": (np.float32, pa.float32())}
U8_LEVELS = 255
U8_MAX_ABS_ERROR = 0.5 / U8_LEVELS
"""Largest absolute error of one decoded ``weights_u8`` value (``q / 255``)."""
_WEIGHT_TOLERANCE = 1e-5
SORT_COLUMNS: tuple[str, ...] = ("source_offset", "token_ordinal")
SHARD_METADATA_KEY = b"flywheel.shard"


@dataclass(frozen=True, kw_only=True)
class ShardGeometry:
    """Fixed sizes of one dataset's list columns.

    Fields:
        layers: routed layers L per token.
        top_k: experts per token and layer K.
        feature_dim: width D of the reduced features per layer.
        hidden_dim: width H of the optional full-width hidden states.
        weight_encoding: ``uint8`` (``weights_u8``) or ``float16`` (``weights_f16``).
        feature_dtype: ``float16`` (default) or ``float32``, as the engine produced them.
    """

    layers: int
    top_k: int
    feature_dim: int
    hidden_dim: int
    weight_encoding: str = "uint8"
    feature_dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("layers", "top_k", "feature_dim", "hidden_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ShardError(f"ShardGeometry.{name} must be a positive integer, got {value!r}")
        if self.weight_encoding not in WEIGHT_ENCODINGS:
            raise ShardError(
                f"ShardGeometry.weight_encoding must be one of {WEIGHT_ENCODINGS}, "
                f"got {self.weight_encoding!r}"
            )
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ShardError(
                f"ShardGeometry.feature_dtype must be one of {sorted(FEATURE_DTYPES)}, "
                f"got {self.feature_dtype!r}"
            )

    @property
    def weight_column(self) -> str:
        return "weights_u8" if self.weight_encoding == "uint8" else "weights_f16"


@dataclass(frozen=True, kw_only=True)
class SourceRef:
    """Where one window record was read: topic, partition and offset."""

    topic: str
    partition: int
    offset: int


def _nested(inner: pa.DataType, *dims: int) -> pa.DataType:
    out = inner
    for dim in reversed(dims):
        out = pa.list_(pa.field("element", out, nullable=False), dim)
    return out


def _field(name: str, dtype: pa.DataType, doc: str, *, nullable: bool = False) -> pa.Field:
    return pa.field(name, dtype, nullable=nullable, metadata={b"doc": doc.encode()})


def shard_schema(geometry: ShardGeometry) -> pa.Schema:
    """The explicit Arrow schema of every shard of a dataset with ``geometry``."""
    g = geometry
    if g.weight_encoding == "uint8":
        weights = _field("weights_u8", _nested(pa.uint8(), g.layers, g.top_k),
                         "router weight w as round(w*255); decode q/255, abs err <= 0.00196")
    else:
        weights = _field("weights_f16", _nested(pa.float16(), g.layers, g.top_k),
                         "router weight as IEEE half precision")
    return pa.schema([
        _field("source_topic", pa.string(), "Kafka topic the window was read from"),
        _field("source_partition", pa.int32(), "partition of that topic"),
        _field("source_offset", pa.int64(), "offset of the window record"),
        _field("window_id", pa.string(), "Window.window_id"),
        _field("split", pa.string(), "Window.split"),
        _field("owner", pa.string(), "Window.owner"),
        _field("thread", pa.string(), "Window.thread"),
        _field("generation", pa.int64(), "Window.generation"),
        _field("identity_id", pa.string(), "runtime identity the labels were produced with"),
        _field("domain_tags", pa.list_(pa.field("element", pa.string(), nullable=False)),
               "Window.domain_tags"),
        _field("token_ordinal", pa.int64(), "ordinal of the anchor in the thread's tokens"),
        _field("token_id", pa.int32(), "token id at the anchor"),
        _field("expert_ids", _nested(pa.uint16(), g.layers, g.top_k),
               "native top-k expert ids per routed layer, rank 0 first"),
        weights,
        _field("margins", _nested(pa.float16(), g.layers),
               "router score gap between rank k-1 and rank k per layer"),
        _field("features", _nested(FEATURE_DTYPES[g.feature_dtype][1], g.layers, g.feature_dim),
               "reduced sidecar input features per routed layer"),
        _field("hidden", _nested(pa.float32(), g.layers, g.hidden_dim),
               "full-width pre-attention hidden states (diagnostic sample only)", nullable=True),
    ])


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


def dequantize_weights_u8(q: np.ndarray) -> np.ndarray:
    """Float32 weights ``q / 255`` of a ``weights_u8`` array."""
    return np.asarray(q, dtype=np.float32) / np.float32(U8_LEVELS)


def shard_metadata(info: Mapping[str, Any]) -> dict[bytes, bytes]:
    """The file-level key/value metadata: canonical JSON, no timestamps or host names."""
    body = {"format": SHARD_FORMAT, **info}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return {SHARD_METADATA_KEY: text.encode()}


def read_shard_metadata(metadata: Mapping[bytes, bytes] | None) -> dict[str, Any]:
    """The ``flywheel.shard`` metadata of a Parquet file (ShardError when absent)."""
    raw = (metadata or {}).get(SHARD_METADATA_KEY)
    if raw is None:
        raise ShardError("the Parquet file has no flywheel.shard metadata; it is not a shard")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ShardError(
            f"flywheel.shard metadata is not JSON ({exc}); the file is corrupt"
        ) from exc
    if not isinstance(value, dict) or value.get("format") != SHARD_FORMAT:
        raise ShardError(f"unknown shard format {value!r}; expected {SHARD_FORMAT}")
    return value


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


def _window_pieces(labels: Any, source: SourceRef, g: ShardGeometry, cols: _Columns) -> None:
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


def pack_rows(items: Sequence[tuple[Any, SourceRef]], geometry: ShardGeometry) -> pa.Table:
    """One table of all anchors of ``items``, sorted by ``(source_offset, token_ordinal)``.

    ``items`` pairs each engine ``WindowLabels`` with the record it came from. The result
    has exactly :func:`shard_schema` (``geometry``); ShardError on any malformed label.
    """
    schema = shard_schema(geometry)
    g = geometry
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
