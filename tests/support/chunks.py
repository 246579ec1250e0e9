"""Capture messages as chunks: the per-token observations of a message stream regrouped
into sealed ``RouteObservationChunk.v1`` records, as the runtime publisher batches them.

:func:`chunked` takes the ``(kind, key, record)`` messages of
:func:`tests.support.streams_synthetic.thread_messages` (pseudonymous ids, plaintext
packed routes) and returns ``(kind, key, value bytes)``: every other record encoded as
:func:`~tests.support.streams_synthetic.encode_message` does, and each run of
consecutive observations of one request (same thread, generation, request, turn,
contiguous ordinals, at most ``max_tokens``) sealed and encoded as one chunk whose
counter is its last token's. A run ends at any other message, so the order (and the
producer's counters) of the per-token stream is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.chunks import seal_chunk
from hebrus_flywheel.streams.publisher.batching import Run, signature
from tests.support.sealing import session_keys
from tests.support.streams_synthetic import Message, encode_message

CHUNK_SCHEMA = "RouteObservationChunk.v1"
Encoded = tuple[str, bytes, bytes]


def encode_chunk(run: Run, counter: int) -> bytes:
    """The single-object bytes of a run sealed under the session key of its owner."""
    header = run.chunk_header(counter)
    key = session_keys().data_key(header["owner"], create=True)
    return codec.encode(CHUNK_SCHEMA, seal_chunk(key, header, run.payload()))


def chunk_record(header: Mapping[str, Any], payload: bytes) -> bytes:
    """A chunk from an explicit header and payload (tests that forge malformed chunks)."""
    key = session_keys().data_key(header["owner"], create=True)
    return codec.encode(CHUNK_SCHEMA, seal_chunk(key, header, payload))


def chunked(messages: Iterable[Message], *, max_tokens: int) -> list[Encoded]:
    out: list[Encoded] = []
    run: Run | None = None
    run_key, last_counter = b"", 0

    def close() -> None:
        nonlocal run
        if run is not None:
            out.append(("observations", run_key, encode_chunk(run, last_counter)))
            run = None

    for kind, key, record in messages:
        if kind != "observations" or record.get("speculative") is not None:
            close()
            out.append((kind, key, encode_message(kind, record)[0]))
            continue
        ids = (record["owner"], record["thread"], record["sequence_id"])
        sig = signature(record, ids)
        if run is not None and (key != run_key or not run.continues(record, sig)):
            close()
        if run is None:
            run, run_key = Run(ids, record, 0.0, sig), key
        run.append(record)
        last_counter = record["counter"]
        if len(run) >= max_tokens:
            close()
    close()
    return out
