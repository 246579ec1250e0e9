"""Size limits of everything the capture and quarantine records carry: the one place.

Every string field of the capture schemas (``TranscriptTurn``, ``RouteObservation``,
``RuntimeIdentity``) has a maximum length in UTF-8 bytes, written in its ``.avsc`` doc
and enforced from :data:`FIELD_MAX_BYTES` here: the runtime publisher refuses a longer
value and the validate stage quarantines it as ``field_too_long``
(:func:`streams.validation.check_string_lengths`). Quarantine records copy source
fields cut to the bounds below (:mod:`streams.quarantine`), so a quarantine record
always fits :data:`QUARANTINE_MAX_MESSAGE_BYTES`, the quarantine topic's
``max.message.bytes`` and the producers' maximum request size.
"""

from __future__ import annotations

ID_MAX_BYTES = 256
"""Ids and names: owner, thread, sequence id, producer id, identity id, digests, tags."""

FIELD_MAX_BYTES: dict[str, int] = {
    name: ID_MAX_BYTES
    for name in (
        # TranscriptTurn / RouteObservation
        "owner", "thread", "sequence_id", "identity_id", "producer_id", "domain_tags",
        # RouteObservation.speculative
        "proposal_id", "accepted_prefix_digest",
        # RuntimeIdentity
        "model_family", "model_artifact_digest", "tokenizer_digest", "chat_template_digest",
        "dtype", "quantization", "tie_break_rule", "weight_rule", "runtime_name",
        "runtime_version", "kernel_path",
    )
}
"""Maximum UTF-8 length of each string field of the capture schemas, by field name
(``domain_tags``: each tag). The ``.avsc`` docs state the same numbers."""

DEFAULT_STRING_MAX_BYTES = ID_MAX_BYTES
"""Bound of a string field not named in :data:`FIELD_MAX_BYTES` (enum symbols and any
field a later schema version adds before it gets its own entry)."""

CAPTURE_MAX_HEADERS = 32
"""Headers a capture message may carry (the codec writes a handful)."""

CAPTURE_HEADER_MAX_BYTES = 4096
"""Total bytes of a capture message's header keys and values."""

QUARANTINE_MAX_MESSAGE_BYTES = 1_048_576
"""``max.message.bytes`` of the quarantine topic and the maximum request size of every
producer that writes quarantine records."""

QUARANTINE_VALUE_MAX_BYTES = 900_000
"""At most this many bytes of the refused message's value are copied into a quarantine
record (with its full size and SHA-256)."""

QUARANTINE_KEY_MAX_BYTES = 1024
"""Bytes of the source Kafka key kept in a quarantine record."""

QUARANTINE_TEXT_MAX_BYTES = 4096
"""Bytes kept of the ``detail`` text of a quarantine record."""

QUARANTINE_HEADER_MAX_BYTES = 1024
"""Bytes kept of each source header key and value."""

QUARANTINE_MAX_HEADERS = 32
"""Source headers kept in a quarantine record (the rest are counted in a cut)."""

QUARANTINE_ENVELOPE_BYTES = 8192
"""Room kept free for the Kafka record envelope (key, headers, batch overhead) when a
quarantine value is checked against :data:`QUARANTINE_MAX_MESSAGE_BYTES`."""


def field_max_bytes(name: str) -> int:
    """The maximum UTF-8 length of string field ``name`` (a leaf name or ``a.b`` path)."""
    return FIELD_MAX_BYTES.get(name.rsplit(".", 1)[-1].split("[", 1)[0],
                               DEFAULT_STRING_MAX_BYTES)


def utf8_len(value: str) -> int:
    """UTF-8 length of ``value`` (ASCII strings are not encoded)."""
    return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
