"""Errors raised by the ``schemas`` package (schema files, the registry and the codec).

Every class derives from :class:`SchemaError`, itself a
:class:`flywheel.errors.FlywheelError`. The classes that describe a bad *message*
(rather than a bad schema file or a bad call) carry a stable ``reason`` code, the same
strings :mod:`streams.validation` lists in ``REASONS``, so a stream processor can put
the record on the quarantine topic with that code.
"""

from __future__ import annotations

from hebrus_flywheel.core.errors import FlywheelError


class SchemaError(FlywheelError):
    """Base class for errors raised by the schemas package."""


class SchemaParseError(SchemaError):
    """An ``.avsc`` file is misnamed, is not JSON, or is not a valid Avro schema."""


class SchemaConflictError(SchemaError):
    """Two schema files collide: same name and version, or the same fingerprint."""


class SchemaNotFoundError(SchemaError, LookupError):
    """A schema name, key or version is not among the loaded ``.avsc`` files."""


class SchemaResolutionError(SchemaError):
    """The writer schema of a message cannot be resolved to the requested reader schema."""

    reason = "schema_resolution_failed"


class RecordEncodeError(SchemaError, ValueError):
    """A record does not fit its Avro schema; ``field`` names the offending field path."""

    reason = "schema_violation"

    def __init__(self, message: str, *, schema: str, field: str | None = None) -> None:
        super().__init__(message)
        self.schema = schema
        self.field = field


class UndecodableRecordError(SchemaError, ValueError):
    """Bytes are not a single-object Avro message: wrong magic, truncated or garbage."""

    reason = "undecodable"


class UnknownFingerprintError(UndecodableRecordError):
    """A message names a writer schema (by fingerprint) that no kept ``.avsc`` file has."""

    reason = "unknown_fingerprint"

    def __init__(self, message: str, *, fingerprint: bytes) -> None:
        super().__init__(message)
        self.fingerprint = fingerprint


class SchemaHeaderError(SchemaError, ValueError):
    """Kafka headers are missing the schema headers, malformed, or disagree with the body."""

    reason = "header_mismatch"
