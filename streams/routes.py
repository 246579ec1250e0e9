"""Packed routes: the ``RouteObservation.v2`` layout, how to build it, read it and check it.

A v2 observation carries one token's routes as *rows*, one per routed layer::

    layers      array<int>  routed-layer index of each row (each layer exactly once)
    stages      array<int>  pipeline stage of each row
    top_k       int         experts per row
    expert_ids  bytes       uint16 little-endian, shape [rows, top_k], rank 0 first
    weights     bytes       float32 little-endian, same shape, aligned with expert_ids

Building it from the runtime's numpy arrays is a ``tobytes()``; reading it back is an
``np.frombuffer``, and the checks here run over the whole token at once. A v1 record
(one ``LayerRoute`` per layer with int/float arrays) is recognised by shape
(:func:`is_packed`) and stays valid: readers accept both versions by fingerprint.

The checks raise :class:`PublishValidationError` with the same reason codes as the v1
checks in :mod:`streams.validation` (``wrong_k``, ``expert_id_out_of_range``, ...).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hebrus_flywheel.streams.exceptions import PublishValidationError

if TYPE_CHECKING:
    from hebrus_flywheel.streams.rules import IdentityRules

ID_DTYPE = np.dtype("<u2")
WEIGHT_DTYPE = np.dtype("<f4")
ID_LIMIT = 1 << 16
"""Expert ids a v2 record can carry: ``[0, 65536)`` (uint16)."""
PACKED_FIELDS = ("layers", "stages", "top_k", "expert_ids", "weights")
_INT32_MAX = 2**31 - 1
_INT_TYPE = frozenset({int})
_FLOAT32_MAX = float(np.finfo(np.float32).max)

REASON_CODES = frozenset({
    "missing_field", "wrong_type", "value_out_of_range", "layer_count_mismatch",
    "layer_out_of_range", "duplicate_layer", "wrong_k", "weights_ids_length_mismatch",
    "expert_id_out_of_range", "duplicate_expert_id", "non_finite_weight", "negative_weight",
    "rank_order_violation",
})
"""Every code the packed checks raise (all of them are ``streams.validation.REASONS``)."""


class RouteArrays(NamedTuple):
    """One observation's routes as arrays, rows in the order they were written."""

    layers: np.ndarray  # int64 [rows]
    stages: np.ndarray  # int64 [rows]
    expert_ids: np.ndarray  # uint16 [rows, k] (int64 for a v1 record)
    weights: np.ndarray  # float32 [rows, k]

    def in_layer_order(self) -> RouteArrays:
        """The same routes with rows sorted by layer index."""
        order = np.argsort(self.layers, kind="stable")
        return RouteArrays(self.layers[order], self.stages[order], self.expert_ids[order],
                           self.weights[order])


def is_packed(record: Mapping[str, Any]) -> bool:
    """True for a v2-shaped observation (packed route fields), False for a v1 one."""
    return "expert_ids" in record or "weights" in record or "top_k" in record


def pack_routes(ids_LK: np.ndarray, weights_LK: np.ndarray, *,
                stages: Sequence[int] | None = None,
                layers: Sequence[int] | None = None) -> dict[str, Any]:
    """The v2 route fields of one token from ``[rows, k]`` arrays (rows = layers 0..L-1
    unless ``layers`` says otherwise; every stage 0 unless ``stages`` is given)."""
    ids = np.asarray(ids_LK)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise PublishValidationError(
            "wrong_type", f"expert ids must be a [rows, top_k] integer array, got "
            f"{ids.dtype} of shape {ids.shape}", field="expert_ids")
    if np.shape(weights_LK) != ids.shape:
        raise PublishValidationError(
            "weights_ids_length_mismatch", f"weights of shape {np.shape(weights_LK)} do not "
            f"align with expert ids of shape {ids.shape}", field="weights")
    if ids.dtype != ID_DTYPE and ids.size and (ids.min() < 0 or ids.max() >= ID_LIMIT):
        raise PublishValidationError(
            "expert_id_out_of_range", f"expert ids span [{ids.min()}, {ids.max()}]; "
            f"RouteObservation.v2 stores them as uint16, so they must lie in [0, {ID_LIMIT})",
            field="expert_ids")
    rows, k = ids.shape
    return {
        "layers": list(range(rows)) if layers is None else [int(v) for v in layers],
        "stages": [0] * rows if stages is None else [int(v) for v in stages],
        "top_k": int(k),
        "expert_ids": np.ascontiguousarray(ids, dtype=ID_DTYPE).tobytes(),
        "weights": np.ascontiguousarray(weights_LK, dtype=WEIGHT_DTYPE).tobytes(),
    }


def pack_layer_routes(layer_routes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The v2 route fields of a v1 ``layers`` list (already checked), rows as given."""
    return pack_routes(
        np.array([r["expert_ids"] for r in layer_routes], dtype=np.int64),
        np.array([r["weights"] for r in layer_routes], dtype=np.float64),
        stages=[r["stage"] for r in layer_routes],
        layers=[r["layer"] for r in layer_routes],
    )


def to_v2(record: Mapping[str, Any]) -> dict[str, Any]:
    """A v1-shaped observation rewritten with packed routes (other fields unchanged)."""
    out = {k: v for k, v in record.items() if k != "layers"}
    out.update(pack_layer_routes(record["layers"]))
    return out


def to_v1(record: Mapping[str, Any]) -> dict[str, Any]:
    """A v2 observation rewritten with one ``LayerRoute`` per row (for v1 readers/tests)."""
    arrays = route_arrays(record)
    out = {k: v for k, v in record.items() if k not in PACKED_FIELDS}
    out["layers"] = [
        {"stage": int(s), "layer": int(layer), "expert_ids": ids.tolist(),
         "weights": w.tolist()}
        for layer, s, ids, w in zip(arrays.layers, arrays.stages, arrays.expert_ids,
                                    arrays.weights, strict=True)
    ]
    return out


def route_arrays(record: Mapping[str, Any]) -> RouteArrays:
    """The routes of a v1 or v2 observation as arrays (rows as written; not validated)."""
    if not is_packed(record):
        layer_routes = record["layers"]
        return RouteArrays(
            np.array([r["layer"] for r in layer_routes], dtype=np.int64),
            np.array([r["stage"] for r in layer_routes], dtype=np.int64),
            np.array([r["expert_ids"] for r in layer_routes], dtype=np.int64),
            np.array([r["weights"] for r in layer_routes], dtype=np.float32),
        )
    rows, k = len(record["layers"]), int(record["top_k"])
    return RouteArrays(
        np.asarray(record["layers"], dtype=np.int64),
        np.asarray(record["stages"], dtype=np.int64),
        np.frombuffer(record["expert_ids"], dtype=ID_DTYPE).reshape(rows, k),
        np.frombuffer(record["weights"], dtype=WEIGHT_DTYPE).reshape(rows, k),
    )


# -- checks ----------------------------------------------------------------------------


def _fail(reason: str, message: str, field: str) -> PublishValidationError:
    return PublishValidationError(reason, message, field=field)


def _present(record: Mapping[str, Any], name: str) -> Any:
    value = record.get(name)
    if value is None:
        raise _fail("missing_field", f"{name} is missing; a packed (v2) observation needs "
                    f"all of {PACKED_FIELDS}", name)
    return value


def _int_list(record: Mapping[str, Any], name: str) -> Sequence[int]:
    values = _present(record, name)
    if type(values) is list and set(map(type, values)) == _INT_TYPE:  # the common case
        return values
    if type(values) not in (list, tuple) or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values
    ):
        raise _fail("wrong_type", f"{name} must be a list of ints", name)
    return values


def _bytes(record: Mapping[str, Any], name: str, dtype: str) -> bytes:
    value = _present(record, name)
    if type(value) is not bytes:
        raise _fail("wrong_type", f"{name} must be bytes ({dtype} little-endian), got "
                    f"{type(value).__name__}; use numpy's .tobytes()", name)
    return value


@functools.cache
def _layer_range(count: int) -> list[int]:
    return list(range(count))


def _check_rows(record: Mapping[str, Any], geometry: IdentityRules) -> int:
    """``layers`` and ``stages``: one row per routed layer; returns the row count."""
    layers, stages = _int_list(record, "layers"), _int_list(record, "stages")
    rows = geometry.routed_layer_count
    if len(layers) != rows:
        raise _fail("layer_count_mismatch", f"{len(layers)} route rows; the identity has "
                    f"{rows} routed layers and each needs exactly one row", "layers")
    if len(stages) != rows:
        raise _fail("layer_count_mismatch", f"{len(stages)} stages for {rows} route rows; "
                    "give one stage per row", "stages")
    distinct = set(stages)  # a handful of pipeline stages at most
    if min(distinct) < 0 or max(distinct) > _INT32_MAX:
        raise _fail("value_out_of_range", f"stages {list(stages)} leave [0, {_INT32_MAX}]",
                    "stages")
    if layers != _layer_range(rows) and sorted(layers) != _layer_range(rows):
        low, high = min(layers), max(layers)
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise _fail("layer_out_of_range", f"layers holds {bad}, outside [0, {rows})",
                        "layers")
        raise _fail("duplicate_layer", f"layers {list(layers)} routes a layer twice", "layers")
    return rows


check_rows = _check_rows
"""``layers`` and ``stages`` of a packed record: one row per routed layer; the row count."""


def _check_shape(record: Mapping[str, Any], rows: int, geometry: IdentityRules
                 ) -> tuple[bytes, bytes]:
    top_k = _present(record, "top_k")
    if type(top_k) is not int and (
        not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool)
    ):
        raise _fail("wrong_type", f"top_k must be an int, got {type(top_k).__name__}", "top_k")
    if top_k != geometry.top_k:
        raise _fail("wrong_k", f"top_k={top_k}; the identity's top_k is {geometry.top_k}",
                    "top_k")
    ids, weights = _bytes(record, "expert_ids", "uint16"), _bytes(record, "weights", "float32")
    slots = rows * geometry.top_k
    if len(ids) != 2 * slots:
        raise _fail("wrong_k", f"expert_ids holds {len(ids)} bytes; {rows} rows x top_k "
                    f"{geometry.top_k} uint16 ids need {2 * slots}", "expert_ids")
    if len(weights) != 4 * slots:
        raise _fail("weights_ids_length_mismatch", f"weights holds {len(weights)} bytes; "
                    f"{rows} rows x top_k {geometry.top_k} float32 weights need {4 * slots}",
                    "weights")
    return ids, weights


def _row(mask_RK: np.ndarray) -> int:
    return int(np.flatnonzero(mask_RK.any(axis=1))[0])


@functools.cache
def _row_ends(rows: int, k: int) -> np.ndarray:
    """True where flat position ``j`` and ``j + 1`` lie in different rows (read-only)."""
    ends = np.zeros(max(rows * k - 1, 0), dtype=bool)
    ends[k - 1 :: k] = True
    ends.flags.writeable = False
    return ends


# Direct ufunc reductions: the ndarray methods add a Python-level wrapper per call, and
# these checks run once per decoded token.
_MAX, _MIN, _ALL = np.maximum.reduce, np.minimum.reduce, np.logical_and.reduce


def _check_ids(ids_RK: np.ndarray, geometry: IdentityRules) -> None:
    if geometry.expert_count < ID_LIMIT and _MAX(ids_RK, None) >= geometry.expert_count:
        row = _row(ids_RK >= geometry.expert_count)
        raise _fail("expert_id_out_of_range", f"expert_ids row {row} = {ids_RK[row].tolist()} "
                    f"has an id outside [0, {geometry.expert_count})", "expert_ids")
    ranked = np.sort(ids_RK, axis=1).ravel()
    if not _ALL(np.not_equal(ranked[1:], ranked[:-1]) | _row_ends(*ids_RK.shape)):
        ranked_RK = ranked.reshape(ids_RK.shape)
        row = _row(ranked_RK[:, 1:] == ranked_RK[:, :-1])
        raise _fail("duplicate_expert_id", f"expert_ids row {row} = {ids_RK[row].tolist()} "
                    "repeats an id", "expert_ids")


def _check_weights(flat: np.ndarray, rows: int, geometry: IdentityRules) -> None:
    # min/max propagate NaN, so this one test proves every weight finite and >= 0
    if not (_MIN(flat) >= 0.0 and _MAX(flat) <= _FLOAT32_MAX):
        weights_RK = flat.reshape(rows, -1)
        finite = np.isfinite(weights_RK)
        if not finite.all():
            row = _row(~finite)
            raise _fail("non_finite_weight", f"weights row {row} = {weights_RK[row].tolist()} "
                        "is not finite", "weights")
        row = _row(weights_RK < 0)
        raise _fail("negative_weight", f"weights row {row} = {weights_RK[row].tolist()} has a "
                    "negative", "weights")
    k = len(flat) // rows
    if geometry.monotone_weights and not _ALL(
        np.less_equal(flat[1:], flat[:-1]) | _row_ends(rows, k)
    ):
        weights_RK = flat.reshape(rows, k)
        row = _row(weights_RK[:, 1:] > weights_RK[:, :-1])
        raise _fail("rank_order_violation", f"weights row {row} = {weights_RK[row].tolist()} "
                    "increases along rank; rank 0 must be the highest router score", "weights")


def check_packed_routes(record: Mapping[str, Any], geometry: IdentityRules) -> None:
    """Check the packed route fields of a v2 observation against its identity's geometry.

    Covers the Avro types of those fields too, so a record that passes encodes without
    fastavro's validation. Raises :class:`PublishValidationError` at the first failure.
    """
    rows = _check_rows(record, geometry)
    ids, weights = _check_shape(record, rows, geometry)
    _check_ids(np.ndarray((rows, geometry.top_k), ID_DTYPE, ids), geometry)
    _check_weights(np.frombuffer(weights, dtype=WEIGHT_DTYPE), rows, geometry)


def check_route_block(ids_TLK: np.ndarray, weights_TLK: np.ndarray,
                      geometry: IdentityRules) -> None:
    """The checks of :func:`check_packed_routes` over a run of tokens at once: ``[tokens,
    layers, top_k]`` arrays of consecutive tokens' routes, rows in layer order. Raises
    :class:`PublishValidationError` with the same reason codes, naming the first bad token."""
    ids, weights = np.asarray(ids_TLK), np.asarray(weights_TLK)
    if ids.ndim != 3 or ids.dtype.kind not in "iu":
        raise _fail("wrong_type", f"expert ids must be a [tokens, layers, top_k] integer array, "
                    f"got {ids.dtype} of shape {ids.shape}", "expert_ids")
    if weights.shape != ids.shape:
        raise _fail("weights_ids_length_mismatch", f"weights of shape {weights.shape} do not "
                    f"align with expert ids of shape {ids.shape}", "weights")
    _, rows, k = ids.shape
    if rows != geometry.routed_layer_count:
        raise _fail("layer_count_mismatch", f"{rows} route rows; the identity has "
                    f"{geometry.routed_layer_count} routed layers", "layers")
    if k != geometry.top_k:
        raise _fail("wrong_k", f"top_k={k}; the identity's top_k is {geometry.top_k}", "top_k")
    if not ids.size:
        return
    limit = min(geometry.expert_count, ID_LIMIT)
    _block_fail((ids < 0) | (ids >= limit), "expert_id_out_of_range",
                f"has an id outside [0, {limit})", "expert_ids")
    if _may_repeat_an_id(ids):
        ranked = np.sort(ids, axis=2)
        _block_fail(ranked[..., 1:] == ranked[..., :-1], "duplicate_expert_id",
                    "repeats an id", "expert_ids")
    w = weights.astype(WEIGHT_DTYPE, copy=False)
    _block_fail(~np.isfinite(w), "non_finite_weight", "is not finite", "weights")
    _block_fail(w < 0, "negative_weight", "has a negative", "weights")
    if geometry.monotone_weights and _rises_along_rank(w):
        _block_fail(w[..., 1:] > w[..., :-1], "rank_order_violation",
                    "increases along rank; rank 0 must be the highest router score", "weights")


_PAIRWISE_TOP_K_MAX = 32


def _may_repeat_an_id(ids_TLK: np.ndarray) -> bool:
    """False when no row repeats an expert id. Compares rank columns pairwise, each column
    contiguous over all rows: for a top-k of a few to a few dozen this is several times
    faster than sorting every short row (``np.sort`` along the last axis), the hot spot
    of a clean chunk's check in the stream worker. Rows wider than
    ``_PAIRWISE_TOP_K_MAX`` (more pairs than a sort compares) answer True: the caller's
    sort decides."""
    if ids_TLK.shape[-1] > _PAIRWISE_TOP_K_MAX:
        return True
    by_rank_KR = ids_TLK.reshape(-1, ids_TLK.shape[-1]).T.copy()  # (K, T*L)
    return any(bool((by_rank_KR[i] == by_rank_KR[i + 1:]).any())
               for i in range(len(by_rank_KR) - 1))


def _rises_along_rank(weights_TLK: np.ndarray) -> bool:
    """Whether any row's weights increase along rank: one pass over the flat array, the
    pairs that straddle two rows masked by :func:`_row_ends` (as :func:`_check_weights`)."""
    k = weights_TLK.shape[-1]
    flat = np.ascontiguousarray(weights_TLK).ravel()
    return not _ALL(np.less_equal(flat[1:], flat[:-1]) | _row_ends(flat.size // k, k))


def _block_fail(bad_TLK: np.ndarray, reason: str, what: str, field: str) -> None:
    if not bad_TLK.any():
        return
    token, row = (int(v) for v in np.argwhere(bad_TLK)[0][:2])
    raise _fail(reason, f"{field} of token {token}, row {row} {what}", field)
