"""The shard row schema, its per-shard layout, and the Parquet key-value metadata.

One row per anchor token, every routed layer in fixed-size lists: a training example is
one token with its labels at all L routed layers, so per-token lineage is stored once
per token, and ``expert_ids[l][r]`` reads naturally in DuckDB, Polars and pyarrow. Rows
are sorted by ``(source_offset, token_ordinal)``. ``docs/snapshot-format.md`` documents
every column, key and error bound for readers outside this package.

Tensor legend: L routed layers (slots), K top-k, D feature width, H hidden width.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.core.jsonio import canonical_json
from hebrus_flywheel.core.snapshot.errors import ShardFormatError

CONTRACT_VERSION = 3
"""Bumped on any change to columns, metadata keys or manifest fields (3: encryption at
rest, ``plaintext_sha256``, ``content_id``)."""
SHARD_FORMAT = f"hebrus-flywheel-shard/v{CONTRACT_VERSION}"
WEIGHT_ENCODINGS: tuple[str, ...] = ("uint8", "float16")
FEATURE_DTYPES: dict[str, Any] = {"float16": (np.float16, pa.float16()),
                                  "float32": (np.float32, pa.float32())}
U8_LEVELS = 255
U8_MAX_ABS_ERROR = 0.5 / U8_LEVELS
"""Largest absolute error of one decoded ``weights_u8`` value (``q / 255``)."""
F16_MAX_REL_ERROR = 2.0 ** -11
SORT_COLUMNS: tuple[str, ...] = ("source_offset", "token_ordinal")
PRODUCT_CLEAN = "clean_path"
PRODUCT_CANDIDATE = "candidate_path"
PRODUCTS: tuple[str, ...] = (PRODUCT_CLEAN, PRODUCT_CANDIDATE)
"""The two replay products (design note, "Two different replay products"). Shards and
manifests without a ``product`` are clean-path (every snapshot before candidate replay)."""
CANDIDATE_SORT_COLUMNS: tuple[str, ...] = (
    "source_offset", "anchor_ordinal", "drafter_id", "path_id", "candidate_position")

KEY_SHARD = b"flywheel.shard"
"""Canonical JSON of the whole shard record (lineage + layout); the reader's source of truth."""
KEY_CONTRACT_VERSION = b"flywheel.contract_version"
KEY_IDENTITY_ID = b"flywheel.identity_id"
KEY_ROUTED_LAYERS = b"flywheel.routed_layers"
KEY_EXPERT_COUNT = b"flywheel.expert_count"
KEY_TOP_K = b"flywheel.top_k"
KEY_ROUTE_GEOMETRY = b"flywheel.route_geometry"
KEY_FEATURE_PROJECTION = b"flywheel.feature_projection"
KEY_WEIGHT_QUANTIZATION = b"flywheel.weight_quantization"
METADATA_KEYS: tuple[bytes, ...] = (
    KEY_SHARD, KEY_CONTRACT_VERSION, KEY_IDENTITY_ID, KEY_ROUTED_LAYERS, KEY_EXPERT_COUNT,
    KEY_TOP_K, KEY_ROUTE_GEOMETRY, KEY_FEATURE_PROJECTION, KEY_WEIGHT_QUANTIZATION)


def _positive(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShardFormatError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """Per-dataset facts about shard columns that are not routing geometry.

    Fields:
        route: the teacher's routing geometry (L slots and their model layers, E, K).
        feature_dim: width D of the reduced features per routed layer.
        hidden_dim: width H of the optional full-width hidden states.
        weight_encoding: ``uint8`` (``weights_u8``) or ``float16`` (``weights_f16``).
        feature_dtype: ``float16`` (default) or ``float32``, as the engine produced them.
        projection_id: digest of the seeded feature projection (None if not recorded).
        projection_seed: seed of that projection (None if not recorded).
    """

    route: RouteGeometry
    feature_dim: int
    hidden_dim: int
    weight_encoding: str = "uint8"
    feature_dtype: str = "float16"
    projection_id: str | None = None
    projection_seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.route, RouteGeometry):
            raise ShardFormatError(f"ShardLayout.route must be a RouteGeometry, "
                                   f"got {type(self.route).__name__}")
        _positive("ShardLayout", "feature_dim", self.feature_dim)
        _positive("ShardLayout", "hidden_dim", self.hidden_dim)
        if self.weight_encoding not in WEIGHT_ENCODINGS:
            raise ShardFormatError(f"ShardLayout.weight_encoding must be one of "
                                   f"{WEIGHT_ENCODINGS}, got {self.weight_encoding!r}")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ShardFormatError(f"ShardLayout.feature_dtype must be one of "
                                   f"{sorted(FEATURE_DTYPES)}, got {self.feature_dtype!r}")

    @property
    def layers(self) -> int:
        """L: routed slots per row."""
        return self.route.routed_layer_count

    @property
    def top_k(self) -> int:
        return self.route.top_k

    @property
    def weight_column(self) -> str:
        return "weights_u8" if self.weight_encoding == "uint8" else "weights_f16"

    def weight_quantization(self) -> dict[str, Any]:
        """How stored weights decode, with the worst-case error of one decoded value."""
        if self.weight_encoding == "uint8":
            return {"encoding": "uint8", "column": "weights_u8", "decode": "q / 255",
                    "max_abs_error": U8_MAX_ABS_ERROR}
        return {"encoding": "float16", "column": "weights_f16", "decode": "IEEE half",
                "max_rel_error": F16_MAX_REL_ERROR}

    def to_dict(self) -> dict[str, Any]:
        """JSON form; ``layers`` and ``top_k`` are derived from ``route`` for flat readers."""
        return {"layers": self.layers, "top_k": self.top_k, "feature_dim": self.feature_dim,
                "hidden_dim": self.hidden_dim, "weight_encoding": self.weight_encoding,
                "feature_dtype": self.feature_dtype, "route": self.route.to_dict(),
                "projection": {"id": self.projection_id, "seed": self.projection_seed}}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> ShardLayout:
        """The inverse of :meth:`to_dict`; ShardFormatError if fields are missing or disagree."""
        try:
            projection = value.get("projection") or {}
            layout = cls(route=RouteGeometry.from_dict(value["route"]),
                         feature_dim=value["feature_dim"], hidden_dim=value["hidden_dim"],
                         weight_encoding=value["weight_encoding"],
                         feature_dtype=value["feature_dtype"],
                         projection_id=projection.get("id"),
                         projection_seed=projection.get("seed"))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ShardFormatError(f"incomplete shard layout {dict(value)!r}: {exc!r}") from exc
        if (value.get("layers"), value.get("top_k")) != (layout.layers, layout.top_k):
            raise ShardFormatError(f"shard layout says layers={value.get('layers')} "
                                   f"top_k={value.get('top_k')} but its route geometry says "
                                   f"{layout.layers} and {layout.top_k}")
        return layout


def _nested(inner: pa.DataType, *dims: int) -> pa.DataType:
    out = inner
    for dim in reversed(dims):
        out = pa.list_(pa.field("element", out, nullable=False), dim)
    return out


def _field(name: str, dtype: pa.DataType, doc: str, *, nullable: bool = False) -> pa.Field:
    return pa.field(name, dtype, nullable=nullable, metadata={b"doc": doc.encode()})


def _source_fields() -> list[pa.Field]:
    """Where a row came from: the lineage columns both products share."""
    return [
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
    ]


def _lineage_fields() -> list[pa.Field]:
    return [
        *_source_fields(),
        _field("token_ordinal", pa.int64(), "ordinal of the anchor in the thread's tokens"),
        _field("token_id", pa.int32(), "token id at the anchor"),
    ]


def shard_schema(layout: ShardLayout) -> pa.Schema:
    """The explicit Arrow schema of every shard of a dataset with ``layout``."""
    g = layout
    if g.weight_encoding == "uint8":
        weights = _field("weights_u8", _nested(pa.uint8(), g.layers, g.top_k),
                         "router weight w as round(w*255); decode q/255, abs err <= 0.00196")
    else:
        weights = _field("weights_f16", _nested(pa.float16(), g.layers, g.top_k),
                         "router weight as IEEE half precision")
    return pa.schema([
        *_lineage_fields(),
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


def candidate_shard_schema(layout: ShardLayout) -> pa.Schema:
    """The Arrow schema of a candidate-path shard: one row per (proposal, path, candidate
    position), the clean rows' source lineage, and the route at that position. Weights are
    always IEEE half (``layout.weight_encoding`` must be ``float16``)."""
    g = layout
    if g.weight_encoding != "float16":
        raise ShardFormatError("candidate-path shards store weights_f16; build the layout "
                               "with weight_encoding='float16'")
    return pa.schema([
        *_source_fields(),
        _field("proposal_id", pa.string(),
               "sha256 hex of 'window_id|anchor_ordinal|drafter_id'"),
        _field("anchor_ordinal", pa.int64(), "thread ordinal of the last committed token"),
        _field("drafter_id", pa.string(), "drafter, e.g. prompt_lookup/n3 or teacher_self"),
        _field("path_id", pa.int32(), "candidate path rank 0..W-1 (drafter's order)"),
        _field("candidate_position", pa.int32(), "1..B: position after the anchor"),
        _field("candidate_token_id", pa.int32(), "drafted token id at that position"),
        _field("drafter_logprob", pa.float32(), "drafter's natural-log probability of it"),
        _field("expert_ids", _nested(pa.uint16(), g.layers, g.top_k),
               "native top-k expert ids per routed layer at this candidate position, rank 0 "
               "first"),
        _field("weights_f16", _nested(pa.float16(), g.layers, g.top_k),
               "router weight as IEEE half precision"),
        _field("features", _nested(FEATURE_DTYPES[g.feature_dtype][1], g.layers, g.feature_dim),
               "reduced sidecar input features per routed layer (same projection as clean)"),
        _field("accepted_prefix_length", pa.int32(), "this path's accepted prefix, 0..B"),
        _field("accepted_prefix_digest", pa.string(),
               "sha256 hex of the accepted token ids as int32 little-endian"),
        _field("accepted", pa.bool_(), "candidate_position <= accepted_prefix_length"),
    ])


def sort_columns_for(schema: pa.Schema) -> tuple[str, ...]:
    """The columns a shard of ``schema``'s product is sorted by."""
    return CANDIDATE_SORT_COLUMNS if "proposal_id" in schema.names else SORT_COLUMNS


def shard_product(info: Mapping[str, Any]) -> str:
    """The product a ``flywheel.shard`` record (or a manifest) names; clean when absent."""
    product = info.get("product", PRODUCT_CLEAN)
    if product not in PRODUCTS:
        raise ShardFormatError(f"unknown replay product {product!r}; expected one of {PRODUCTS}")
    return str(product)


def dequantize_weights_u8(q: np.ndarray) -> np.ndarray:
    """Float32 weights ``q / 255`` of a ``weights_u8`` array."""
    return np.asarray(q, dtype=np.float32) / np.float32(U8_LEVELS)


def _text(value: Any) -> bytes:
    return canonical_json(value)


def shard_metadata(layout: ShardLayout, info: Mapping[str, Any]) -> dict[bytes, bytes]:
    """The file-level key/value metadata: canonical JSON, no timestamps or host names.

    ``info`` is the shard's lineage (epoch, split, topic, partition, offsets, windows,
    rows, identity_id, config_digest). The flat ``flywheel.*`` keys repeat what
    ``flywheel.shard`` holds so SQL readers need no JSON path into it.
    """
    body = {"format": SHARD_FORMAT, "contract_version": CONTRACT_VERSION, **info,
            **layout.to_dict()}
    route = layout.route
    return {
        KEY_SHARD: _text(body),
        KEY_CONTRACT_VERSION: str(CONTRACT_VERSION).encode(),
        KEY_IDENTITY_ID: str(info.get("identity_id")).encode(),
        KEY_ROUTED_LAYERS: _text(list(route.routed_layers)),
        KEY_EXPERT_COUNT: str(route.expert_count).encode(),
        KEY_TOP_K: str(route.top_k).encode(),
        KEY_ROUTE_GEOMETRY: _text(route.to_dict()),
        KEY_FEATURE_PROJECTION: _text(layout.to_dict()["projection"]),
        KEY_WEIGHT_QUANTIZATION: _text(layout.weight_quantization()),
    }


def read_shard_metadata(metadata: Mapping[bytes, bytes] | None) -> dict[str, Any]:
    """The ``flywheel.shard`` record of a Parquet footer, checked against the flat keys."""
    meta = metadata or {}
    raw = meta.get(KEY_SHARD)
    if raw is None:
        raise ShardFormatError("the Parquet file has no flywheel.shard metadata; it is not a "
                               "shard")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ShardFormatError(f"flywheel.shard metadata is not JSON ({exc}); the file is "
                               "corrupt") from exc
    if not isinstance(value, dict) or value.get("format") != SHARD_FORMAT:
        found = value.get("format") if isinstance(value, dict) else value
        raise ShardFormatError(f"unknown shard format {found!r}; this code reads "
                               f"{SHARD_FORMAT}. Rebuild the snapshot with this version")
    layout = ShardLayout.from_dict(value)
    shard_product(value)
    expected = shard_metadata(layout, value)
    wrong = [k.decode() for k in METADATA_KEYS if k != KEY_SHARD and meta.get(k) != expected[k]]
    if wrong:
        raise ShardFormatError(f"shard footer keys {wrong} disagree with flywheel.shard; the "
                               "file was edited")
    return value


def shard_layout(metadata: Mapping[bytes, bytes] | None) -> ShardLayout:
    """The layout a shard footer records."""
    return ShardLayout.from_dict(read_shard_metadata(metadata))
