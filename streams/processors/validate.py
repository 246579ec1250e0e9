"""Validate stage: decode a capture record and refuse it, with a reason code, when it is bad.

Pure functions over plain records. Stateless checks (decoding, required fields,
geometry, ranges, weights, size) live here together with the per-producer
monotonic-counter check, whose state is one small dict per
``(producer_id, topic, partition)``: Kafka only orders records within a partition, so a
counter can only be said to regress within one. Checks that need a thread's history
(ordinal regression and duplicates, records after close) live in
:mod:`streams.processors.assemble` and use the reason codes defined here.

Redelivery: state carries the offset it has seen up to, and the offsets it refused, so
a record delivered again after a crash gets exactly the verdict it got the first time.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.exceptions import SchemaError
from hebrus_flywheel.schemas.registry import SchemaEntry, SchemaKey, default_registry
from hebrus_flywheel.streams import limits, quarantine, routes
from hebrus_flywheel.streams import validation as sv
from hebrus_flywheel.streams.chunks import CHUNK_NAME, CHUNK_REASONS
from hebrus_flywheel.streams.exceptions import PublishValidationError
from hebrus_flywheel.streams.rules import IdentityRules
from hebrus_flywheel.streams.sealing import SEALING_REASONS

PROCESSOR_REASONS: dict[str, str] = {
    "oversized": "the message is larger than the configured maximum record size",
    "headers_too_large": "the message carries more headers, or more header bytes, than a "
    "capture message may",
    "unexpected_schema": "the record type does not belong on this topic",
    "identity_mismatch": "a record's identity differs from the identity of its thread generation",
    "generated_non_assistant": "a segment of a non-assistant turn is marked generated",
    "thread_closed": "the record arrived after its thread generation was completed, or after "
    "its end marker",
    "token_mismatch": "a captured route's token id differs from the transcript at that ordinal, "
    "or a route exists for a token that was not generated",
    "incomplete_thread": "the thread went idle with a missing turn, so no window can be cut",
    "processing_error": "the processor raised on this record (a bug); the record is kept here "
    "and the worker goes on",
    "window_exceeds_context": "replay: the window has more tokens than the teacher's context",
    "owner_erased": "replay: the window is sealed under an owner data key that an erasure "
    "destroyed; kept as metadata only (reference), its bytes are unreadable for good",
    "no_consent": "the record's owner had no live capture grant in the consent ledger at the "
    "record's wall time; kept by reference only (no value bytes, no owner or thread)",
    "poison": "the record crashed the streams worker N times in a row (--poison-after-crashes); "
    "quarantined by reference on the next start so its partition goes on",
    **SEALING_REASONS,
    **CHUNK_REASONS,
}
"""Reason codes only the stream processors produce (stateful or thread-level checks)."""

REASONS: dict[str, str] = {
    **{code: f"streams.validation.Reason.{code.upper()}" for code in sv.REASONS},
    **PROCESSOR_REASONS,
}
"""Every quarantine reason code: the publisher's codes (``streams.validation.REASONS``,
shared so a record refused at publish time and at processing time gets the same code)
plus :data:`PROCESSOR_REASONS`. Codes are stable strings."""

NOT_PRODUCED_AFTER_DECODE: frozenset[str] = frozenset(
    {"wrong_type", "schema_violation", "schema_resolution_failed"}
)
"""Publisher codes a decoded record cannot earn: Avro decoding already enforces field
types, encoding is not done here, and records are read with their writer schema."""

CAPTURE_KINDS: dict[str, str] = {
    "transcripts": "hebrus.flywheel.v1.TranscriptTurn",
    "observations": "hebrus.flywheel.v1.RouteObservation",
    "identities": "hebrus.flywheel.v1.RuntimeIdentity",
}
"""Which record type each capture topic carries."""

ALSO_ACCEPTED: dict[str, frozenset[str]] = {"observations": frozenset({CHUNK_NAME})}
"""Further record types a capture topic carries: chunks of observations
(:mod:`streams.chunks`) on the observations topic."""


@dataclass(frozen=True, kw_only=True)
class ValidateConfig:
    """Limits of the validate stage.

    Fields:
        max_record_bytes: messages larger than this are quarantined as ``oversized``
            without being decoded (default 1 MiB, Kafka's default message size).
        max_quarantine_value_bytes: at most this many original bytes are copied into a
            quarantine record; the rest is represented by size and SHA-256.
        require_schema_headers: refuse messages without the codec's schema headers
            (otherwise headers are checked only when present).
        max_remembered_failures: how many refused offsets each counter state keeps so
            that a redelivered record gets the same verdict again.
    """

    max_record_bytes: int = 1_048_576
    max_quarantine_value_bytes: int = 900_000
    require_schema_headers: bool = False
    max_remembered_failures: int = 256

    def __post_init__(self) -> None:
        for name in ("max_record_bytes", "max_quarantine_value_bytes", "max_remembered_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"ValidateConfig.{name} must be a positive integer, got {value!r}"
                )


class Rejection(NamedTuple):
    """Why a record was refused: a code from :data:`REASONS` and a human detail."""

    reason: str
    detail: str


class SourceRef(NamedTuple):
    """Where a record was read: topic, partition, offset."""

    topic: str
    partition: int
    offset: int


WINDOW_ID_LIMIT = 1 << 15
"""``Window.v1`` carries captured expert ids as int16: ids from here up cannot be windowed."""


class PackedRoutes(NamedTuple):
    """One observation's routes, packed in layer order: ``[layers, k]`` int16 ids (the
    ``Window.v1`` encoding; for ids below 2**15 the same bytes as v2's uint16) and float32
    weights, both little-endian."""

    expert_ids: bytes
    weights: bytes
    layers: tuple[int, ...]
    stages: tuple[int, ...]


def reject(reason: str, detail: str) -> Rejection:
    if reason not in REASONS:
        raise KeyError(f"unknown quarantine reason {reason!r}; add it to REASONS")
    return Rejection(reason, detail)


def _has_schema_headers(headers: Iterable[tuple[str, Any]] | None) -> bool:
    return any(k == codec.HEADER_SCHEMA for k, _ in headers or ())


def _check_headers(headers: Sequence[tuple[str, Any]] | None) -> Rejection | None:
    pairs = list(headers or ())
    size = sum(len(k.encode() if isinstance(k, str) else k or b"") + len(v or b"")
               for k, v in pairs)
    if len(pairs) > limits.CAPTURE_MAX_HEADERS or size > limits.CAPTURE_HEADER_MAX_BYTES:
        return reject("headers_too_large",
                      f"{len(pairs)} headers of {size} bytes; a capture message carries at most "
                      f"{limits.CAPTURE_MAX_HEADERS} headers of {limits.CAPTURE_HEADER_MAX_BYTES} "
                      "bytes in all (streams.limits)")
    return None


def decode_capture(
    value: bytes | None,
    headers: Sequence[tuple[str, Any]] | None,
    *,
    kind: str,
    config: ValidateConfig,
) -> tuple[str, dict[str, Any]] | Rejection:
    """Decode one capture message of topic ``kind``: ``(schema key, record)`` or a Rejection."""
    if value is None or len(value) == 0:
        return reject("undecodable", "the message has no value; the producer sent an empty record")
    if len(value) > config.max_record_bytes:
        return reject(
            "oversized",
            f"{len(value)} bytes > max_record_bytes={config.max_record_bytes}; split the record "
            "or raise the limit",
        )
    too_large = _check_headers(headers)
    if too_large is not None:
        return too_large
    try:
        key, record = _decode(value, headers, config)
    except SchemaError as exc:
        reason = getattr(exc, "reason", "undecodable")
        return reject(reason if reason in REASONS else "undecodable", str(exc))
    if key.name != CAPTURE_KINDS[kind] and key.name not in ALSO_ACCEPTED.get(kind, ()):
        return reject(
            "unexpected_schema",
            f"a {key} record on the {kind} topic; publish {CAPTURE_KINDS[kind]} records only",
        )
    absent = [name for name in _required_fields(key) if name not in record]
    if absent:
        return reject(
            "missing_field",
            f"a {key} record lacks field(s) {absent} that its schema version requires; "
            "publish them",
        )
    return str(key), record


def _decode(
    value: bytes, headers: Sequence[tuple[str, Any]] | None, config: ValidateConfig
) -> tuple[SchemaKey, dict[str, Any]]:
    """``codec.decode_message`` when the message has schema headers (or they are required),
    else ``codec.decode``. Headers that are exactly what the codec writes for the body's
    schema (the usual case) are recognised by one comparison instead of being parsed."""
    if not headers and not config.require_schema_headers:
        return codec.decode(value)
    pairs = list(headers or ())
    if not (_has_schema_headers(pairs) or config.require_schema_headers):
        return codec.decode(value)
    try:
        entry = codec.writer_entry(value)
    except SchemaError:
        entry = None  # decode_message reports it, header problems first
    if entry is not None and pairs == _codec_headers(entry):
        return entry.key, codec.decode_entry(entry, value)
    return codec.decode_message(value, pairs)


@functools.cache
def _codec_headers(entry: SchemaEntry) -> list[tuple[str, bytes]]:
    return codec.kafka_headers(entry)


@functools.cache
def _required_fields(key: SchemaKey) -> tuple[str, ...]:
    entry = default_registry().get(key)
    return tuple(f["name"] for f in entry.definition["fields"] if "default" not in f)


def _run(check: Callable[..., Any], *args: Any) -> Any:
    """Call a ``streams.validation`` check; its PublishValidationError becomes a Rejection."""
    try:
        return check(*args)
    except PublishValidationError as exc:
        return Rejection(exc.reason, str(exc))


def check_lengths(record: Mapping[str, Any]) -> Rejection | None:
    """``field_too_long`` when a string of the record exceeds its bound
    (``streams.limits.FIELD_MAX_BYTES``); checked before anything looks the record up."""
    problem: Rejection | None = _run(sv.check_string_lengths, record)
    return problem


def check_message_key(record: Mapping[str, Any], key: bytes | None) -> Rejection | None:
    """Capture records are keyed ``owner/thread``; anything else would break partitioning."""
    want = f"{record['owner']}/{record['thread']}".encode()
    if key != want:
        return reject(
            "invalid_key",
            f"message key {key!r} is not {want!r}; publish capture records keyed owner/thread",
        )
    return None


def check_identity_record(
    record: Mapping[str, Any], key: bytes | None
) -> IdentityRules | Rejection:
    """A RuntimeIdentity must be valid (``streams.validation``) and keyed by its id."""
    geometry = _run(sv.validate_identity, record)
    if isinstance(geometry, Rejection):
        return geometry
    if key is not None and key != record["identity_id"].encode():
        return reject("invalid_key", f"identity keyed {key!r}; key it by its identity_id")
    return geometry


def check_identity_ref(
    record: Mapping[str, Any], identities: Mapping[str, IdentityRules | None]
) -> IdentityRules | Rejection:
    """The geometry of the identity a record names, or why it cannot be used."""
    identity_id = record.get("identity_id")
    geometry = identities.get(identity_id) if isinstance(identity_id, str) else None
    if geometry is not None:
        return geometry
    if isinstance(identity_id, str) and identity_id in identities:
        return reject(
            "unknown_identity",
            f"identity {identity_id} was published but refused (see its quarantine record); "
            "republish a valid RuntimeIdentity",
        )
    return _run(sv.resolve_geometry, record, {})


def check_turn(record: Mapping[str, Any], geometry: IdentityRules) -> Rejection | None:
    """``streams.validation.validate_turn`` plus: only assistant tokens are generated."""
    problem = _run(sv.validate_turn, record, geometry)
    if problem is not None:
        return problem
    if record["role"] != "assistant" and any(s["generated"] for s in record["segments"]):
        return reject(
            "generated_non_assistant",
            f"a segment of a {record['role']} turn is marked generated; only assistant output "
            "is decoded",
        )
    return None


def check_observation(
    record: Mapping[str, Any], geometry: IdentityRules
) -> PackedRoutes | Rejection:
    """``streams.validation.validate_observation``, then the routes packed in layer order.

    A v2 record written in layer order (what runtimes write) keeps its bytes: nothing is
    unpacked. A v1 record, or v2 rows in another order, is packed here once.
    """
    problem = _run(sv.validate_observation, record, geometry)
    if problem is not None:
        return problem
    if geometry.expert_count > WINDOW_ID_LIMIT:
        problem = _wide_ids(record)
        if problem is not None:
            return problem
    if routes.is_packed(record):
        layers = record["layers"]
        if layers == _layer_range(len(layers)):
            return PackedRoutes(
                expert_ids=record["expert_ids"],
                weights=record["weights"],
                layers=tuple(layers),
                stages=tuple(record["stages"]),
            )
    arrays = routes.route_arrays(record).in_layer_order()
    return PackedRoutes(
        expert_ids=arrays.expert_ids.astype("<i2").tobytes(),
        weights=arrays.weights.astype("<f4").tobytes(),
        layers=tuple(range(len(arrays.layers))),
        stages=tuple(int(s) for s in arrays.stages),
    )


def chunk_block_clean(chunk: Mapping[str, Any], opened: Any, geometry: IdentityRules) -> bool:
    """Whether every token of an opened ``RouteObservationChunk`` (header fields and
    :class:`streams.chunks.ChunkTokens`) passes :func:`check_observation` with its packed
    bytes kept, checked at once: the rows and scalar fields on the first and last token,
    token ids and route values as arrays. False means "check token by token" (the
    verdict and its detail come from there), never a verdict of its own."""
    n, layers = int(chunk["token_count"]), chunk["layers"]
    if geometry.expert_count > WINDOW_ID_LIMIT or layers != _layer_range(len(layers)):
        return False
    base = {name: chunk[name] for name in ("owner", "thread", "generation", "sequence_id",
                                           "turn_index", "identity_id", "top_k",
                                           "producer_id", "counter", "wall_time_ms")}
    try:
        for i in (0, n - 1):
            sv.validate_observation_fields(
                {**base, "speculative": None, "token_ordinal": chunk["first_ordinal"] + i,
                 "token_id": int(opened.tokens[i]), "layers": layers,
                 "stages": chunk["stages"], "expert_ids": opened.ids[i].tobytes(),
                 "weights": opened.weights[i].tobytes()}, geometry)
        sv.check_token_block(opened.tokens, geometry)
        routes.check_route_block(opened.ids, opened.weights, geometry)
    except PublishValidationError:
        return False
    return True


@functools.cache
def _layer_range(count: int) -> list[int]:
    return list(range(count))


def _wide_ids(record: Mapping[str, Any]) -> Rejection | None:
    highest = int(np.max(routes.route_arrays(record).expert_ids))
    if highest < WINDOW_ID_LIMIT:
        return None
    return reject(
        "expert_id_out_of_range",
        f"expert id {highest} does not fit the int16 ids of Window.v1; windows can carry "
        f"ids below {WINDOW_ID_LIMIT} only — add a Window version with wider ids",
    )


def check_counter(
    state: Mapping[str, Any] | None,
    *,
    counter: int,
    offset: int,
    config: ValidateConfig,
) -> tuple[Rejection | None, dict[str, Any] | None]:
    """Monotonic-counter check for one ``(producer, topic, partition)``.

    Returns ``(verdict, new_state)``; ``new_state`` is None when nothing changed (a
    redelivered record, which gets its original verdict back).
    """
    if state is not None and offset <= state["offset"]:
        failed = offset in state["failed"]
        return (_counter_rejection(counter, state["counter"]) if failed else None), None
    if state is None or counter > state["counter"]:
        # the refused-offsets list is never changed in place, so it is shared, not copied
        failed_list = [] if state is None else state["failed"]
        return None, {"counter": counter, "offset": offset, "failed": failed_list}
    failed_list = [*state["failed"], offset][-config.max_remembered_failures :]
    new_state = {"counter": state["counter"], "offset": offset, "failed": failed_list}
    return _counter_rejection(counter, state["counter"]), new_state


def _counter_rejection(counter: int, last: int) -> Rejection:
    return reject(
        "counter_regression",
        f"counter {counter} is not above {last}, the last counter seen from this producer in "
        "this partition; the producer restarted without persisting its counter or re-sent a record",
    )


def quarantine_record(
    *,
    source: SourceRef,
    rejection: Rejection,
    value: bytes | None,
    key: bytes | None = None,
    headers: Sequence[tuple[str, Any]] | None = None,
    record: Mapping[str, Any] | None = None,
    schema: str | None = None,
    stage: str = "validate",
    config: ValidateConfig,
) -> dict[str, Any]:
    """A QuarantineRecord dict, every copied field cut to its bound
    (:func:`streams.quarantine.bound`); its id depends only on stage, reason, source and
    thread."""
    raw = bytes(value or b"")
    rec = record or {}
    return quarantine.bound({
        "quarantine_id": _quarantine_id(stage, rejection, source, rec),
        "reason": rejection.reason,
        "detail": rejection.detail,
        "stage": stage,
        "source_topic": source.topic,
        "source_partition": source.partition,
        "source_offset": source.offset,
        "source_key": key,
        "source_headers": [
            {"key": str(k), "value": v.encode() if isinstance(v, str) else v}
            for k, v in headers or ()
        ],
        "value": raw,
        "value_size": len(raw),
        "value_sha256": hashlib.sha256(raw).hexdigest(),
        "value_truncated": False,
        "schema": schema,
        "owner": _str_or_none(rec.get("owner")),
        "thread": _str_or_none(rec.get("thread")),
        "generation": rec.get("generation") if isinstance(rec.get("generation"), int) else None,
        "producer_id": _str_or_none(rec.get("producer_id")),
    }, max_value_bytes=config.max_quarantine_value_bytes)


def _quarantine_id(
    stage: str, rejection: Rejection, source: SourceRef, rec: Mapping[str, Any]
) -> str:
    thread_part = f"{rec.get('owner')}/{rec.get('thread')}/{rec.get('generation')}"
    parts = (stage, rejection.reason, source.topic, str(source.partition), str(source.offset))
    return hashlib.sha256("|".join((*parts, thread_part)).encode()).hexdigest()


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
