"""Avro single-object encoding of flywheel records, and the Kafka headers that go with it.

Wire format (Avro specification, "Single-object encoding")::

    C3 01 | 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema | Avro binary body

The fingerprint selects the *writer* schema among every version kept in the registry,
so a consumer decodes any version ever published; an optional reader schema applies
Avro schema resolution on top. Decoding returns raw Avro values: a ``timestamp-millis``
field comes back as the ``int`` that was written, not as a ``datetime``.

Encoding validates the record against the schema first (fastavro's writer alone would
silently write a 2**40 into an ``int`` field or a bool as an int); pass
``validate=False`` only for records a trusted builder made.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastavro import schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError as FastavroResolutionError
from fastavro.validation import ValidationError, validate

from hebrus_flywheel.schemas.exceptions import (
    RecordEncodeError,
    SchemaHeaderError,
    SchemaResolutionError,
    UndecodableRecordError,
)
from hebrus_flywheel.schemas.registry import (
    HEADER_SIZE,
    SINGLE_OBJECT_MAGIC,
    SchemaEntry,
    SchemaKey,
    SchemaRef,
    SchemaRegistry,
    default_registry,
)

log = logging.getLogger(__name__)

CONTENT_TYPE = "application/vnd.apache.avro.single-object"
HEADER_SCHEMA = "schema"
HEADER_SCHEMA_VERSION = "schema-version"
HEADER_CONTENT_TYPE = "content-type"

KafkaHeaders = list[tuple[str, bytes]]
Buffer = bytes | bytearray | memoryview

_WRITE_ERRORS = (ValueError, TypeError, OverflowError, AttributeError, KeyError, IndexError)
_READ_ERRORS = (EOFError, ValueError, TypeError, OverflowError, IndexError, KeyError,
                UnicodeDecodeError)
_FIELD_PATTERNS = (
    re.compile(r"Field (\S+) is specified in the schema but missing"),
    re.compile(r"more fields than the schema specifies: (\S+)"),
    re.compile(r"on field (\S+)"),
)


def _registry(registry: SchemaRegistry | None) -> SchemaRegistry:
    return registry if registry is not None else default_registry()


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _schema_summary(schema: Any) -> str:
    if isinstance(schema, dict):
        return str(schema.get("name") or schema.get("type"))
    if isinstance(schema, list):
        return "union[" + ", ".join(_schema_summary(s) for s in schema) + "]"
    return str(schema)


def _check_top_level(entry: SchemaEntry, record: Any) -> None:
    if not isinstance(record, Mapping):
        raise RecordEncodeError(
            f"a {entry.key} record must be a mapping of field names, got "
            f"{type(record).__name__}",
            schema=str(entry.key),
        )
    fields = entry.parsed.get("fields", ())
    names = {f["name"] for f in fields}
    missing = [f["name"] for f in fields if "default" not in f and f["name"] not in record]
    if missing:
        raise RecordEncodeError(
            f"{entry.key} record is missing field(s) {missing}; set them before publishing",
            schema=str(entry.key),
            field=missing[0],
        )
    extra = sorted(k for k in record if k not in names)
    if extra:
        raise RecordEncodeError(
            f"{entry.key} record has field(s) {extra} the schema does not define; remove "
            "them or add a new schema version",
            schema=str(entry.key),
            field=str(extra[0]),
        )


def _validate(entry: SchemaEntry, record: Mapping[str, Any]) -> None:
    _check_top_level(entry, record)
    try:
        validate(record, entry.parsed, raise_errors=True)
    except ValidationError as exc:
        first = exc.errors[0] if exc.errors else None
        field = str(first.field) if first is not None else None
        detail = (
            f"{field} is {_short_repr(first.datum)} ({type(first.datum).__name__}), expected "
            f"{_schema_summary(first.schema)}"
            if first is not None
            else str(exc)
        )
        more = f" (+{len(exc.errors) - 1} more)" if len(exc.errors) > 1 else ""
        raise RecordEncodeError(
            f"record does not fit schema {entry.key}: {detail}{more}; fix the value",
            schema=str(entry.key),
            field=field,
        ) from exc


def _field_from_message(message: str) -> str | None:
    for pattern in _FIELD_PATTERNS:
        match = pattern.search(message)
        if match:
            return match.group(1)
    return None


# Fields added to a schema after records were written without them; a writer that leaves
# them out gets their default (any other missing field is still an error).
ADDED_WITH_DEFAULT: dict[str, tuple[str, ...]] = {
    "hebrus.flywheel.v1.RuntimeIdentity": ("routed_layers", "layer_count", "kernel_path"),
}


def _with_defaults(entry: SchemaEntry, record: Mapping[str, Any]) -> Mapping[str, Any]:
    """``record`` plus the default of each :data:`ADDED_WITH_DEFAULT` field it lacks."""
    added = ADDED_WITH_DEFAULT.get(entry.key.name, ())
    if not added or not isinstance(record, Mapping):
        return record
    fields = entry.parsed.get("fields", ()) if isinstance(entry.parsed, dict) else ()
    missing = {f["name"]: f["default"] for f in fields
               if f["name"] in added and "default" in f and f["name"] not in record}
    return {**record, **missing} if missing else record


def encode_entry(entry: SchemaEntry, record: Mapping[str, Any], *, validate: bool = True) -> bytes:
    """Single-object bytes of ``record`` written with the already-resolved ``entry``."""
    record = _with_defaults(entry, record)
    if validate:
        _validate(entry, record)
    buf = io.BytesIO()
    buf.write(entry.prefix)
    try:
        schemaless_writer(buf, entry.parsed, record, strict=True, strict_allow_default=True)
    except _WRITE_ERRORS as exc:
        raise RecordEncodeError(
            f"cannot write a {entry.key} record: {exc}; fix the record to match the schema",
            schema=str(entry.key),
            field=_field_from_message(str(exc)),
        ) from exc
    return buf.getvalue()


def encode(
    schema: SchemaRef,
    record: Mapping[str, Any],
    *,
    registry: SchemaRegistry | None = None,
    validate: bool = True,
) -> bytes:
    """Single-object bytes of ``record`` under ``schema`` (a key or a name; latest version).

    Raises :class:`RecordEncodeError` (``field`` set where it can be told) when the record
    does not fit, and :class:`SchemaNotFoundError` for an unknown schema reference.
    """
    return encode_entry(_registry(registry).get(schema), record, validate=validate)


def writer_entry(data: Buffer, *, registry: SchemaRegistry | None = None) -> SchemaEntry:
    """The writer schema named by a single-object message's header, without reading the body."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise UndecodableRecordError(
            f"message value is {type(data).__name__}, not bytes (a tombstone or a wrongly "
            "deserialised value); quarantine it"
        )
    if len(data) < HEADER_SIZE:
        raise UndecodableRecordError(
            f"message of {len(data)} bytes is shorter than the {HEADER_SIZE}-byte single-object "
            "header; it was truncated or is not a flywheel Avro message"
        )
    if data[:2] != SINGLE_OBJECT_MAGIC:
        raise UndecodableRecordError(
            f"message starts with {bytes(data[:2]).hex()} instead of the single-object magic "
            f"{SINGLE_OBJECT_MAGIC.hex()}; it was not written by the flywheel codec"
        )
    return _registry(registry).by_fingerprint(bytes(data[2:HEADER_SIZE]))


def _reader_plain(reader_schema: SchemaRef | None, registry: SchemaRegistry) -> Any:
    if reader_schema is None:
        return None
    return registry.get(reader_schema).plain


def decode(
    data: Buffer,
    reader_schema: SchemaRef | None = None,
    *,
    registry: SchemaRegistry | None = None,
) -> tuple[SchemaKey, dict[str, Any]]:
    """Decode a single-object message into ``(writer schema key, record)``.

    With ``reader_schema`` (a key or name known to the registry) the record is resolved
    into that schema's shape (Avro schema evolution rules). Raises
    :class:`UnknownFingerprintError`, :class:`UndecodableRecordError` (wrong magic,
    truncated, trailing bytes, garbage) or :class:`SchemaResolutionError`.
    """
    reg = _registry(registry)
    entry = writer_entry(data, registry=reg)
    return entry.key, decode_entry(entry, data, reader_schema, registry=reg)


def decode_entry(
    entry: SchemaEntry,
    data: Buffer,
    reader_schema: SchemaRef | None = None,
    *,
    registry: SchemaRegistry | None = None,
) -> dict[str, Any]:
    """The record of a single-object message whose writer schema the caller already
    resolved (``entry``, from :func:`writer_entry`); same errors as :func:`decode`."""
    reader = _reader_plain(reader_schema, _registry(registry))
    if reader is entry.plain:
        reader = None
    buf = io.BytesIO(data)
    buf.seek(HEADER_SIZE)
    try:
        record: Any = schemaless_reader(buf, entry.plain, reader)
    except FastavroResolutionError as exc:
        raise SchemaResolutionError(
            f"a {entry.key} message cannot be read as {reader_schema}: {exc}; read it with a "
            "compatible reader schema or none"
        ) from exc
    except _READ_ERRORS as exc:
        raise UndecodableRecordError(
            f"the body of a {entry.key} message is corrupt or truncated "
            f"({type(exc).__name__}: {exc}); quarantine it"
        ) from exc
    if buf.tell() != len(data):
        raise UndecodableRecordError(
            f"a {entry.key} message has {len(data) - buf.tell()} trailing bytes after the "
            "record; it is corrupt or was written with another schema under this fingerprint"
        )
    return record


def kafka_headers(schema: SchemaRef | SchemaEntry, *, registry: SchemaRegistry | None = None
                  ) -> KafkaHeaders:
    """``schema``, ``schema-version`` and ``content-type`` headers for a message."""
    entry = schema if isinstance(schema, SchemaEntry) else _registry(registry).get(schema)
    return [
        (HEADER_SCHEMA, entry.key.name.encode()),
        (HEADER_SCHEMA_VERSION, str(entry.key.version).encode()),
        (HEADER_CONTENT_TYPE, CONTENT_TYPE.encode()),
    ]


@dataclass(frozen=True, kw_only=True)
class SchemaHeaders:
    """The schema headers read back from a Kafka message.

    Attributes:
        name: Avro full name of the writer schema.
        version: the schema file version.
        content_type: the ``content-type`` header value.
    """

    name: str
    version: int
    content_type: str

    @property
    def key(self) -> SchemaKey:
        return SchemaKey(self.name, self.version)


HeaderInput = Mapping[str, bytes | str | None] | Iterable[tuple[str, bytes | str | None]] | None


def _header_map(headers: HeaderInput) -> dict[str, bytes | str | None]:
    if headers is None:
        return {}
    if isinstance(headers, Mapping):
        return dict(headers)
    found: dict[str, bytes | str | None] = {}
    for name, value in headers:
        if name in found:
            raise SchemaHeaderError(f"header {name!r} appears more than once; quarantine it")
        found[name] = value
    return found


def _text(headers: Mapping[str, bytes | str | None], name: str) -> str:
    value = headers.get(name)
    if value is None:
        raise SchemaHeaderError(
            f"message has no {name!r} header; every flywheel message carries "
            f"{HEADER_SCHEMA!r}, {HEADER_SCHEMA_VERSION!r} and {HEADER_CONTENT_TYPE!r}"
        )
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaHeaderError(f"header {name!r} is not UTF-8: {value!r}") from exc


def read_kafka_headers(headers: HeaderInput) -> SchemaHeaders:
    """Parse the schema headers (confluent-kafka list of pairs, or a mapping)."""
    found = _header_map(headers)
    version_text = _text(found, HEADER_SCHEMA_VERSION)
    if not version_text.isdigit() or int(version_text) < 1:
        raise SchemaHeaderError(
            f"header {HEADER_SCHEMA_VERSION!r} must be a positive integer, got {version_text!r}"
        )
    content_type = _text(found, HEADER_CONTENT_TYPE)
    if content_type != CONTENT_TYPE:
        raise SchemaHeaderError(
            f"content-type {content_type!r} is not {CONTENT_TYPE!r}; this topic only carries "
            "Avro single-object messages"
        )
    return SchemaHeaders(
        name=_text(found, HEADER_SCHEMA), version=int(version_text), content_type=content_type
    )


def decode_message(
    value: Buffer,
    headers: HeaderInput,
    reader_schema: SchemaRef | None = None,
    *,
    registry: SchemaRegistry | None = None,
) -> tuple[SchemaKey, dict[str, Any]]:
    """Decode a Kafka message value and check that its headers name the same writer schema."""
    declared = read_kafka_headers(headers)
    key, record = decode(value, reader_schema, registry=registry)
    if declared.key != key:
        raise SchemaHeaderError(
            f"headers say {declared.key} but the body's fingerprint is {key}; the producer "
            "set the wrong headers — quarantine the message"
        )
    return key, record
