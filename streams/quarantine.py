"""Quarantine records that always fit the quarantine topic.

Every builder of a ``QuarantineRecord`` (the streams validate and assemble stages,
the replay worker's intake) passes its record through :func:`bound`: each copied
field is cut to its bound in :mod:`streams.limits`, and each cut is listed in
``cuts`` with the original's full size and SHA-256. Every sender encodes it with
:func:`encode`, which checks the encoded size against the quarantine topic's
``max.message.bytes`` and, should it still not fit, sends a reference-only record
instead (source coordinates, value size and SHA-256, reason). So a hostile record can
be quarantined however large its value, key, headers or strings are.

Quarantine is metadata-only unless the record's content is sealed: :func:`bound` copies
value bytes, key and headers only from records of a schema whose user content is
encrypted under an owner's data key (so an erasure makes them unreadable, like every
other copy) or that carries none (a runtime identity). An undecodable record, or an
old unsealed version, may hold plaintext token ids or raw ids nobody could erase: it is
kept as a reference (where it is in the capture topic, its size and SHA-256), and the
capture topic's own retention bounds the original.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams import limits

SCHEMA = "QuarantineRecord"
_STRING_BOUNDS = {
    "detail": limits.QUARANTINE_TEXT_MAX_BYTES,
    "owner": limits.ID_MAX_BYTES,
    "thread": limits.ID_MAX_BYTES,
    "producer_id": limits.ID_MAX_BYTES,
    "schema": limits.ID_MAX_BYTES,
}


CONTENT_KEPT_SCHEMAS: frozenset[str] = frozenset({
    "TranscriptTurn.v2", "RouteObservation.v3", "RouteObservationChunk.v1", "Window.v2",
    "RuntimeIdentity.v1", "RuntimeIdentity.v2", "RuntimeIdentity.v3",
})
"""Schemas (short name and version) whose quarantined bytes may be kept: sealed capture
and window versions, and runtime identities (no user content)."""
NOT_SEALED_WHY = "content not sealed under an owner key: metadata only"


def keeps_content(schema: object) -> bool:
    """Whether a quarantined record of writer schema ``schema`` (a ``SchemaKey``, its
    string, or None when the value did not decode) may keep its bytes."""
    if schema is None:
        return False
    short = ".".join(str(schema).rsplit(".", 2)[-2:])
    return short in CONTENT_KEPT_SCHEMAS


class Encoded(NamedTuple):
    """A quarantine record ready to send: Kafka key, value, headers, and the record."""

    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    record: dict[str, Any]


def _cut(field: str, data: bytes, limit: int, cuts: list[dict[str, Any]]) -> bytes:
    if len(data) <= limit:
        return data
    cuts.append({"field": field, "size": len(data),
                 "sha256": hashlib.sha256(data).hexdigest()})
    return data[:limit]


def _cut_str(field: str, text: str, limit: int, cuts: list[dict[str, Any]]) -> str:
    if len(text) * 4 <= limit:
        return text
    raw = text.encode("utf-8", "surrogatepass")
    kept = _cut(field, raw, limit, cuts)
    return text if kept is raw else kept.decode("utf-8", "ignore")


def _bound_headers(headers: list[Mapping[str, Any]], cuts: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    if len(headers) > limits.QUARANTINE_MAX_HEADERS:
        digest = hashlib.sha256(repr([(h["key"], h["value"]) for h in headers]).encode())
        cuts.append({"field": "source_headers", "size": len(headers),
                     "sha256": digest.hexdigest()})
    out = []
    for index, header in enumerate(headers[: limits.QUARANTINE_MAX_HEADERS]):
        value = header.get("value")
        out.append({
            "key": _cut_str(f"source_headers[{index}].key", str(header["key"]),
                            limits.QUARANTINE_HEADER_MAX_BYTES, cuts),
            "value": None if value is None else _cut(
                f"source_headers[{index}].value", bytes(value),
                limits.QUARANTINE_HEADER_MAX_BYTES, cuts),
        })
    return out


def bound(record: Mapping[str, Any], *,
          max_value_bytes: int = limits.QUARANTINE_VALUE_MAX_BYTES) -> dict[str, Any]:
    """``record`` (a QuarantineRecord dict whose ``value`` is the full original) with
    every copied field cut to its bound; ``value_size``/``value_sha256`` keep the full
    value's size and digest, ``cuts`` lists every other field that was cut. A record
    whose content is not sealed (:func:`keeps_content`) becomes its :func:`reference`."""
    if not record.get("reference_only") and not keeps_content(record.get("schema")):
        return reference(record, NOT_SEALED_WHY)
    rec = dict(record)
    cuts: list[dict[str, Any]] = list(rec.get("cuts") or ())
    raw = bytes(rec.get("value") or b"")
    limit = min(max_value_bytes, limits.QUARANTINE_VALUE_MAX_BYTES)
    rec.update(value=raw[:limit], value_truncated=bool(rec.get("value_truncated"))
               or len(raw) > limit)
    for name, bound_bytes in _STRING_BOUNDS.items():
        if isinstance(rec.get(name), str):
            rec[name] = _cut_str(name, rec[name], bound_bytes, cuts)
    if rec.get("source_key") is not None:
        rec["source_key"] = _cut("source_key", bytes(rec["source_key"]),
                                 limits.QUARANTINE_KEY_MAX_BYTES, cuts)
    rec["source_headers"] = _bound_headers(list(rec.get("source_headers") or ()), cuts)
    rec["cuts"] = cuts
    rec.setdefault("reference_only", False)
    return rec


def reference(record: Mapping[str, Any], why: str) -> dict[str, Any]:
    """The reference-only form of ``record``: where the refused record is, its value's
    size and SHA-256, and the reason; nothing copied from it."""
    detail = f"reference only ({why}); original detail: {record['detail']}"
    return {
        **{k: record[k] for k in ("quarantine_id", "reason", "stage", "source_topic",
                                  "source_partition", "source_offset", "value_size",
                                  "value_sha256")},
        "detail": _cut_str("detail", detail, 1024, []),
        "source_key": None, "source_headers": [], "value": b"", "value_truncated": True,
        "schema": None, "owner": None, "thread": None, "generation": None,
        "producer_id": None, "cuts": [], "reference_only": True,
    }


def message_key(record: Mapping[str, Any]) -> bytes:
    """The Kafka key of a quarantine record: ``owner/thread`` when both are known (cut to
    their bounds), else ``topic:partition:offset`` of the source."""
    if record.get("owner") and record.get("thread"):
        return f"{record['owner']}/{record['thread']}".encode()
    where = (record["source_topic"], record["source_partition"], record["source_offset"])
    return ":".join(map(str, where)).encode()


def encode(record: Mapping[str, Any], *,
           max_message_bytes: int = limits.QUARANTINE_MAX_MESSAGE_BYTES) -> Encoded:
    """Bound, encode and size-check a quarantine record against ``max_message_bytes``
    (the quarantine topic's ``max.message.bytes``); a record that does not fit becomes
    its :func:`reference`."""
    entry = codec.default_registry().get(SCHEMA)
    rec = bound(record)
    encoded = _encoded(entry, rec)
    size = _wire_size(encoded)
    if size > max_message_bytes:
        rec = reference(rec, f"{size} bytes cut would exceed max.message.bytes="
                        f"{max_message_bytes}")
        encoded = _encoded(entry, rec)
    return encoded


def _encoded(entry: Any, rec: dict[str, Any]) -> Encoded:
    headers = [*codec.kafka_headers(entry), ("reason", str(rec["reason"]).encode())]
    value = codec.encode_entry(entry, rec, validate=False)
    return Encoded(message_key(rec), value, headers, rec)


def _wire_size(encoded: Encoded) -> int:
    """Bytes the record takes in a Kafka batch, with room for the envelope."""
    headers = sum(len(k) + len(v) for k, v in encoded.headers)
    return (len(encoded.value) + len(encoded.key) + headers
            + limits.QUARANTINE_ENVELOPE_BYTES)
