"""Pure checks of capture records against flywheel invariants (no Kafka, no I/O).

The runtime publisher runs them before a record is enqueued; the stream processor
runs the same functions on decoded records and uses ``PublishValidationError.reason``
as the quarantine reason code. Every code is in :data:`REASONS` and never changes
meaning; the codec codes (``schema_violation``, ``unknown_fingerprint``,
``undecodable``, ``header_mismatch``, ``schema_resolution_failed``) are the ``reason``
attributes of :mod:`schemas.exceptions`.

For the v1 schemas and ``RouteObservation.v2`` these checks cover every field's Avro
type and range as well, so a record that passes encodes without fastavro's slower
validation. Observations come in two shapes: v1 (``layers`` = one ``LayerRoute`` per
layer) and v2 (routes packed into uint16/float32 bytes, checked vectorised by
:mod:`streams.routes`); both give the same reason codes. Checks stop at the
first failure, and the stateful ordinal check runs last: a record rejected for any
other reason never advances a tracker.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from enum import StrEnum
from itertools import chain, pairwise
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.core.identity import compute_identity_id
from hebrus_flywheel.streams import limits, routes
from hebrus_flywheel.streams.exceptions import PublishValidationError
from hebrus_flywheel.streams.rules import INT32_MAX, IdentityRules


class Reason(StrEnum):
    """Stable reason codes for rejected / quarantined records."""

    MISSING_FIELD = "missing_field"
    WRONG_TYPE = "wrong_type"
    VALUE_OUT_OF_RANGE = "value_out_of_range"
    INVALID_KEY = "invalid_key"
    UNKNOWN_IDENTITY = "unknown_identity"
    IDENTITY_DIGEST_MISMATCH = "identity_digest_mismatch"
    LAYER_COUNT_MISMATCH = "layer_count_mismatch"
    LAYER_OUT_OF_RANGE = "layer_out_of_range"
    DUPLICATE_LAYER = "duplicate_layer"
    WRONG_K = "wrong_k"
    WEIGHTS_IDS_LENGTH_MISMATCH = "weights_ids_length_mismatch"
    EXPERT_ID_OUT_OF_RANGE = "expert_id_out_of_range"
    DUPLICATE_EXPERT_ID = "duplicate_expert_id"
    NON_FINITE_WEIGHT = "non_finite_weight"
    NEGATIVE_WEIGHT = "negative_weight"
    RANK_ORDER_VIOLATION = "rank_order_violation"
    TOKEN_ID_OUT_OF_RANGE = "token_id_out_of_range"
    SEGMENT_OUT_OF_BOUNDS = "segment_out_of_bounds"
    SEGMENT_OVERLAP = "segment_overlap"
    ORDINAL_NOT_INCREASING = "ordinal_not_increasing"
    DUPLICATE_ORDINAL = "duplicate_ordinal"
    COUNTER_REGRESSION = "counter_regression"
    SCHEMA_VIOLATION = "schema_violation"
    UNKNOWN_FINGERPRINT = "unknown_fingerprint"
    UNDECODABLE = "undecodable"
    HEADER_MISMATCH = "header_mismatch"
    SCHEMA_RESOLUTION_FAILED = "schema_resolution_failed"
    FIELD_TOO_LONG = "field_too_long"


REASONS: tuple[str, ...] = tuple(r.value for r in Reason)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
"""Weight rules under which weights never increase along rank; checked when declared."""
ROLES = ("system", "user", "assistant", "tool")
SEGMENT_KINDS = ("header", "content", "tool_call", "footer")
SAMPLING_MODES = ("forced", "greedy", "sample")


def _fail(reason: Reason, message: str, field: str | None = None) -> PublishValidationError:
    return PublishValidationError(reason.value, message, field=field)


def _get(record: Mapping[str, Any], path: str) -> Any:
    value = record.get(path.rsplit(".", 1)[-1])
    if value is None:
        raise _fail(Reason.MISSING_FIELD, f"{path} is missing; set it before publishing", path)
    return value


def _typed(record: Mapping[str, Any], path: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = _get(record, path)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _fail(Reason.WRONG_TYPE, f"{path} must be {what}, got {type(value).__name__}", path)
    return value


def _int(record: Mapping[str, Any], path: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    value = record.get(path.rsplit(".", 1)[-1])
    if type(value) is int and lo <= value <= hi:  # the common case, without ABC checks
        return value
    value = _typed(record, path, numbers.Integral, "an int")
    if not lo <= value <= hi:
        raise _fail(Reason.VALUE_OUT_OF_RANGE, f"{path}={value} is outside [{lo}, {hi}]", path)
    return int(value)


def _str(record: Mapping[str, Any], path: str) -> str:
    value = record.get(path.rsplit(".", 1)[-1])
    if type(value) is not str or not value:
        value = _typed(record, path, str, "a str")
        if not value:
            raise _fail(Reason.MISSING_FIELD, f"{path} is empty; set it before publishing", path)
    _check_length(value, path)
    return value


def _check_length(value: str, path: str) -> None:
    limit = limits.field_max_bytes(path)
    if len(value) > limit // 4 and (size := limits.utf8_len(value)) > limit:
        raise _fail(Reason.FIELD_TOO_LONG, f"{path} is {size} bytes; the limit is {limit} "
                    "UTF-8 bytes (streams.limits.FIELD_MAX_BYTES)", path)


_NESTED_STRINGS = ("speculative", "domain_tags")


def check_string_lengths(record: Mapping[str, Any]) -> None:
    """Refuse (``field_too_long``) any string of a capture record longer than its bound
    in :data:`streams.limits.FIELD_MAX_BYTES`: top-level strings, the speculative
    lineage's strings and each domain tag. Runs before every other check, so an
    oversized id is reported as such and never copied further."""
    for name, value in record.items():
        if type(value) is str:
            _check_length(value, name)
        elif name in _NESTED_STRINGS:
            _check_nested(name, value)


def _check_nested(name: str, value: Any) -> None:
    if isinstance(value, Mapping):
        for sub, item in value.items():
            if isinstance(item, str):
                _check_length(item, f"{name}.{sub}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if isinstance(item, str):
                _check_length(item, f"{name}[{index}]")


def _list(record: Mapping[str, Any], path: str) -> Sequence[Any]:
    value: Sequence[Any] = _typed(record, path, (list, tuple), "a list")
    return value


def _bool(record: Mapping[str, Any], path: str) -> None:
    _typed(record, path, bool, "a bool")


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if type(value) is not dict and not isinstance(value, Mapping):
        raise _fail(Reason.WRONG_TYPE, f"{path} must be a record, got {type(value).__name__}", path)
    return value


def _symbol(record: Mapping[str, Any], path: str, symbols: Sequence[str]) -> None:
    value = _get(record, path)
    if value not in symbols:
        raise _fail(Reason.VALUE_OUT_OF_RANGE, f"{path}={value!r} is not one of {symbols}", path)


def _all(values: Sequence[Any], fast: type, kind: type) -> bool:
    if all(type(v) is fast for v in values):
        return True
    return all(isinstance(v, kind) and not isinstance(v, bool) for v in values)


_IDENTITY_STRINGS = (
    "identity_id", "model_family", "model_artifact_digest", "tokenizer_digest",
    "chat_template_digest", "dtype", "quantization", "tie_break_rule", "weight_rule",
    "runtime_name", "runtime_version",
)
_IDENTITY_SIZES = ("routed_layer_count", "expert_count", "top_k", "hidden_size",
                   "routed_intermediate_size")


def validate_identity(identity: Mapping[str, Any], *, vocab_size: int | None = None
                      ) -> IdentityRules:
    """Check a ``RuntimeIdentity`` record (fields, sizes, digest) and return its rules."""
    check_string_lengths(_mapping(identity, "identity"))
    for name in _IDENTITY_STRINGS:
        _str(identity, name)
    for name in _IDENTITY_SIZES:
        _int(identity, name, 1, INT32_MAX)
    if identity["top_k"] > identity["expert_count"]:
        raise _fail(Reason.VALUE_OUT_OF_RANGE, f"top_k={identity['top_k']} exceeds "
                    f"expert_count={identity['expert_count']}", "top_k")
    expected = compute_identity_id(identity)
    if identity["identity_id"] != expected:
        raise _fail(Reason.IDENTITY_DIGEST_MISMATCH,
                    f"identity_id {identity['identity_id']} is not the digest {expected} of the "
                    "other fields; build it with schemas.identity.with_identity_id", "identity_id")
    try:
        geometry = RouteGeometry.from_identity(identity)
    except ConfigError as exc:
        raise _fail(Reason.VALUE_OUT_OF_RANGE, f"identity geometry is invalid: {exc}") from exc
    return IdentityRules(identity_id=identity["identity_id"], geometry=geometry,
                         vocab_size=vocab_size)


def resolve_geometry(record: Mapping[str, Any], known: Mapping[str, IdentityRules]
                     ) -> IdentityRules:
    """The geometry of the identity a record names; ``unknown_identity`` if not in ``known``."""
    check_string_lengths(_mapping(record, "record"))
    identity_id = _str(record, "identity_id")
    if identity_id not in known:
        raise _fail(Reason.UNKNOWN_IDENTITY, f"identity {identity_id} has not been published; "
                    "publish the RuntimeIdentity record first", "identity_id")
    return known[identity_id]


def _check_common(record: Mapping[str, Any], geometry: IdentityRules) -> None:
    """Identity, thread key and producer fields shared by turns and observations."""
    identity_id = _str(record, "identity_id")
    if identity_id != geometry.identity_id:
        raise _fail(Reason.UNKNOWN_IDENTITY, f"identity_id {identity_id} is not the runtime "
                    f"identity {geometry.identity_id}; publish that identity first or fix the "
                    "record", "identity_id")
    if "/" in _str(record, "owner"):
        raise _fail(Reason.INVALID_KEY, f"owner {record['owner']!r} contains '/', which makes "
                    "the owner/thread message key ambiguous", "owner")
    for name in ("thread", "sequence_id", "producer_id"):
        _str(record, name)
    for name in ("generation", "counter", "wall_time_ms"):
        _int(record, name)
    _int(record, "turn_index", 0, INT32_MAX)


def _check_token_id(token: int, path: str, geometry: IdentityRules) -> None:
    if not 0 <= token < geometry.token_id_limit:
        raise _fail(Reason.TOKEN_ID_OUT_OF_RANGE,
                    f"{path} holds {'a negative id' if token < 0 else 'an id'} outside "
                    f"[0, {geometry.token_id_limit})", path)  # the id itself is not repeated


def validate_route(route: Any, index: int, geometry: IdentityRules) -> int:
    """Check one ``LayerRoute`` (``layers[index]``); returns its layer index."""
    path = f"layers[{index}]"
    route = _mapping(route, path)
    _int(route, f"{path}.stage", 0, INT32_MAX)
    layer = _int(route, f"{path}.layer", INT64_MIN)
    if not 0 <= layer < geometry.routed_layer_count:
        raise _fail(Reason.LAYER_OUT_OF_RANGE, f"{path}.layer={layer} is outside "
                    f"[0, {geometry.routed_layer_count})", f"{path}.layer")
    ids = _list(route, f"{path}.expert_ids")
    weights = _list(route, f"{path}.weights")
    if len(ids) != len(weights):
        raise _fail(Reason.WEIGHTS_IDS_LENGTH_MISMATCH,
                    f"{path} has {len(ids)} expert_ids but {len(weights)} weights", path)
    path_ids, path_w = f"{path}.expert_ids", f"{path}.weights"
    if len(ids) != geometry.top_k:
        raise _fail(Reason.WRONG_K, f"{path} has {len(ids)} experts; the identity's top_k is "
                    f"{geometry.top_k}", path_ids)
    if not _all(ids, int, numbers.Integral):
        raise _fail(Reason.WRONG_TYPE, f"{path_ids} must hold ints (use .tolist())", path_ids)
    if min(ids) < 0 or max(ids) >= geometry.expert_count:
        raise _fail(Reason.EXPERT_ID_OUT_OF_RANGE, f"{path_ids}={list(ids)} has an id outside "
                    f"[0, {geometry.expert_count})", path_ids)
    if len(set(ids)) != len(ids):
        raise _fail(Reason.DUPLICATE_EXPERT_ID, f"{path_ids}={list(ids)} repeats an id", path_ids)
    if not _all(weights, float, numbers.Real):
        raise _fail(Reason.WRONG_TYPE, f"{path_w} must hold floats (use .tolist())", path_w)
    if not all(map(math.isfinite, weights)) or max(weights) > FLOAT32_MAX:
        raise _fail(Reason.NON_FINITE_WEIGHT, f"{path_w}={list(weights)} is not finite", path_w)
    if min(weights) < 0:
        raise _fail(Reason.NEGATIVE_WEIGHT, f"{path_w}={list(weights)} has a negative", path_w)
    if geometry.monotone_weights and any(a < b for a, b in pairwise(weights)):
        raise _fail(Reason.RANK_ORDER_VIOLATION, f"{path_w}={list(weights)} increases along "
                    "rank; rank 0 must be the highest router score", path_w)
    return layer


def _layers_fast(layers: Sequence[Any], g: IdentityRules) -> bool:
    """True when every route is certainly valid, using builtins over all layers at once."""
    try:
        ids = [r["expert_ids"] for r in layers]
        weights = [r["weights"] for r in layers]
        indices = [r["layer"] for r in layers] + [r["stage"] for r in layers]
    except (TypeError, KeyError, IndexError):
        return False
    if set(map(type, indices)) != {int} or max(indices) > INT32_MAX:
        return False
    if not set(map(type, ids)) | set(map(type, weights)) <= {list, tuple}:
        return False
    if sorted(indices[: len(layers)]) != list(range(g.routed_layer_count)):
        return False
    if min(indices) < 0 or set(map(len, ids)) != {g.top_k} or set(map(len, weights)) != {g.top_k}:
        return False
    if set(map(len, map(set, ids))) != {g.top_k}:
        return False
    flat_ids = list(chain.from_iterable(ids))
    flat_w = list(chain.from_iterable(weights))
    if set(map(type, flat_ids)) != {int} or min(flat_ids) < 0 or max(flat_ids) >= g.expert_count:
        return False
    if not set(map(type, flat_w)) <= {float, int} or not all(map(math.isfinite, flat_w)):
        return False
    if min(flat_w) < 0 or max(flat_w) > FLOAT32_MAX:
        return False
    return not g.monotone_weights or all(w == sorted(w, reverse=True) for w in weights)


def _check_layers(record: Mapping[str, Any], geometry: IdentityRules) -> None:
    if routes.is_packed(record):
        routes.check_packed_routes(record, geometry)
        return
    layers = _list(record, "layers")
    if len(layers) != geometry.routed_layer_count:
        raise _fail(Reason.LAYER_COUNT_MISMATCH, f"{len(layers)} layer routes; the identity has "
                    f"{geometry.routed_layer_count} routed layers and each needs exactly one",
                    "layers")
    if _layers_fast(layers, geometry):
        return
    seen: set[int] = set()
    for index, route in enumerate(layers):
        layer = validate_route(route, index, geometry)
        if layer in seen:
            raise _fail(Reason.DUPLICATE_LAYER, f"layer {layer} is routed twice",
                        f"layers[{index}].layer")
        seen.add(layer)


def _check_speculative(record: Mapping[str, Any]) -> None:
    spec = record.get("speculative")
    if spec is None:
        return
    spec = _mapping(spec, "speculative")
    _str(spec, "speculative.proposal_id")
    _str(spec, "speculative.accepted_prefix_digest")
    _int(spec, "speculative.proposal_generation")
    _int(spec, "speculative.verifier_generation")
    _int(spec, "speculative.candidate_position", 0, INT32_MAX)
    _bool(spec, "speculative.accepted")


def observation_ordinal_key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """Tracker key of an observation: ``(owner, thread, generation, sequence_id[, proposal])``.

    Speculative observations are keyed by proposal too: a later proposal routes the
    ordinals of a rejected suffix again.
    """
    key = (record["owner"], record["thread"], record["generation"], record["sequence_id"])
    spec = record.get("speculative")
    return key if spec is None else (*key, spec["proposal_id"])


def validate_observation(obs: Mapping[str, Any], geometry: IdentityRules, *,
                         tracker: OrdinalTracker | None = None) -> None:
    """Check a ``RouteObservation`` (v1 or packed v2 shape); with ``tracker``, also that
    ``token_ordinal`` increases."""
    obs = _mapping(obs, "observation")
    check_string_lengths(obs)
    _check_common(obs, geometry)
    _int(obs, "token_ordinal")
    _check_token_id(_int(obs, "token_id", INT64_MIN), "token_id", geometry)
    _check_speculative(obs)
    _check_layers(obs, geometry)
    if tracker is not None:
        tracker.check_and_advance(observation_ordinal_key(obs), obs["token_ordinal"])


def validate_observation_fields(obs: Mapping[str, Any], geometry: IdentityRules) -> None:
    """:func:`validate_observation` of a packed record without the route values: ids,
    lineage, ordinal, token id and the rows (``layers``, ``stages``). For a run of tokens
    whose routes :func:`streams.routes.check_route_block` checks at once."""
    obs = _mapping(obs, "observation")
    check_string_lengths(obs)
    _check_common(obs, geometry)
    _int(obs, "token_ordinal")
    _check_token_id(_int(obs, "token_id", INT64_MIN), "token_id", geometry)
    _check_speculative(obs)
    routes.check_rows(obs, geometry)


def check_token_block(tokens: Any, geometry: IdentityRules) -> None:
    """Every token id of an integer array lies in ``[0, token_id_limit)``."""
    if len(tokens) and not (int(tokens.min()) >= 0 and int(tokens.max()) < geometry.token_id_limit):
        raise _fail(Reason.TOKEN_ID_OUT_OF_RANGE, f"token_ids hold an id outside "
                    f"[0, {geometry.token_id_limit})", "token_ids")


def _check_segments(turn: Mapping[str, Any], length: int) -> None:
    end_prev = 0
    for index, segment in enumerate(_list(turn, "segments")):
        path = f"segments[{index}]"
        segment = _mapping(segment, path)
        _symbol(segment, f"{path}.kind", SEGMENT_KINDS)
        _bool(segment, f"{path}.generated")
        start = _int(segment, f"{path}.start", INT64_MIN)
        end = _int(segment, f"{path}.end", INT64_MIN)
        if not 0 <= start <= end <= length:
            raise _fail(Reason.SEGMENT_OUT_OF_BOUNDS, f"{path}=[{start}, {end}) is not within "
                        f"[0, {length}] with start ≤ end", path)
        if start < end_prev:
            raise _fail(Reason.SEGMENT_OVERLAP, f"{path} starts at {start}, before the previous "
                        f"segment ends at {end_prev}; segments must be ordered and disjoint", path)
        end_prev = end


def _check_sampling(turn: Mapping[str, Any]) -> None:
    sampling = _mapping(_get(turn, "sampling"), "sampling")
    _symbol(sampling, "sampling.mode", SAMPLING_MODES)
    for path, hi in (("sampling.temperature", FLOAT32_MAX), ("sampling.top_p", 1.0)):
        value = _typed(sampling, path, numbers.Real, "a float")
        if not 0.0 <= value <= hi:
            raise _fail(Reason.VALUE_OUT_OF_RANGE, f"{path}={value} is outside [0, {hi}]", path)
    _int(sampling, "sampling.top_k", 0, INT32_MAX)
    _int(sampling, "sampling.max_new_tokens", 0, INT32_MAX)
    _int(sampling, "sampling.seed", INT64_MIN)


def validate_turn(turn: Mapping[str, Any], geometry: IdentityRules, *,
                  tracker: OrdinalTracker | None = None) -> None:
    """Check a ``TranscriptTurn``; with ``tracker``, also that ``turn_index`` increases
    per ``(owner, thread, generation)``."""
    turn = _mapping(turn, "turn")
    check_string_lengths(turn)
    _check_common(turn, geometry)
    _symbol(turn, "role", ROLES)
    _int(turn, "token_offset")
    tokens = _list(turn, "token_ids")
    if tokens:
        if not _all(tokens, int, numbers.Integral):
            raise _fail(Reason.WRONG_TYPE, "token_ids must hold ints", "token_ids")
        lowest, highest = min(tokens), max(tokens)
        _check_token_id(lowest if lowest < 0 else highest, "token_ids", geometry)
    _check_segments(turn, len(tokens))
    _check_sampling(turn)
    if not all(isinstance(t, str) for t in _list(turn, "domain_tags")):
        raise _fail(Reason.WRONG_TYPE, "domain_tags must hold strings", "domain_tags")
    _bool(turn, "closes_thread")
    if tracker is not None:
        tracker.check_and_advance((turn["owner"], turn["thread"], turn["generation"]),
                                  turn["turn_index"])


class OrdinalTracker:
    """Last ordinal seen per key; each new one must be strictly greater. Thread-safe.

    Bounded: beyond ``max_keys`` the least recently used key is forgotten (its next
    ordinal is then accepted whatever it is).
    """

    def __init__(self, *, field: str = "token_ordinal", max_keys: int = 100_000,
                 regress_reason: Reason = Reason.ORDINAL_NOT_INCREASING,
                 duplicate_reason: Reason = Reason.DUPLICATE_ORDINAL) -> None:
        if max_keys < 1:
            raise ConfigError(f"OrdinalTracker max_keys must be ≥ 1, got {max_keys}")
        self.field = field
        self.max_keys = max_keys
        self._reasons = (regress_reason, duplicate_reason)
        self._last: OrderedDict[Hashable, int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._last)

    def last(self, key: Hashable) -> int | None:
        return self._last.get(key)

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._last.pop(key, None)

    def check(self, key: Hashable, ordinal: int) -> None:
        """Raise if ``ordinal`` does not exceed the last one recorded for ``key``."""
        last = self._last.get(key)
        if last is not None and ordinal <= last:
            raise _fail(self._reasons[ordinal == last],
                        f"{self.field}={ordinal} for {key} does not exceed the previous {last}; "
                        f"{self.field} must strictly increase", self.field)

    def check_and_advance(self, key: Hashable, ordinal: int) -> None:
        """Check, then record ``ordinal`` as the last one for ``key``."""
        with self._lock:
            self.check(key, ordinal)
            self._last[key] = ordinal
            self._last.move_to_end(key)
            if len(self._last) > self.max_keys:
                self._last.popitem(last=False)


def counter_tracker(max_keys: int = 100_000) -> OrdinalTracker:
    """A tracker of per-producer ``counter`` values; key it by ``producer_id``."""
    return OrdinalTracker(field="counter", max_keys=max_keys,
                          regress_reason=Reason.COUNTER_REGRESSION,
                          duplicate_reason=Reason.COUNTER_REGRESSION)
