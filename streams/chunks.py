"""Chunked route observations: ``RouteObservationChunk.v1``, its seal, its checks, its unrolling.

Serving engines report a request's decode in chunks, not per token. A chunk carries a
run of consecutive decoded tokens of one thread (one generation, one request, one turn):
token ``i`` has ordinal ``first_ordinal + i`` (contiguous by construction), every token
has every routed layer's row (the same ``layers`` / ``stages`` for all of them), and the
whole payload is sealed once under the owner's data key::

    payload = token ids   int32 LE   [n]
            + expert ids  uint16 LE  [n, rows, top_k]
            + weights     float32 LE [n, rows, top_k]

The seal's context binds it to the chunk (thread, generation, request, turn, first
ordinal, token count, top_k, layers, stages), so a payload moved into another chunk does
not open.

Unrolled (:func:`unroll`), a chunk is exactly the plaintext ``RouteObservation.v2``
records of its tokens (pseudonymous ids, the chunk's producer fields), so the stream
workers check and assemble them with the per-token code and cut the same windows.
Speculative tokens are never chunked: their lineage is per token, they stay
``RouteObservation.v3``.

Pure: numpy and the envelope; no Kafka.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from hebrus_flywheel.core.privacy import DataKey, SealedFieldError, open_sealed, seal

CHUNK_V1 = "hebrus.flywheel.v1.RouteObservationChunk.v1"
CHUNK_NAME = "hebrus.flywheel.v1.RouteObservationChunk"
MAX_CHUNK_TOKENS = 4096
"""Most tokens one chunk may carry (48 layers x top-10: ~2.9 MB of payload at most)."""
SEAL_FIELD = "chunk"
_INT64_MAX = 2**63 - 1
_TOKEN = np.dtype("<i4")
_ID = np.dtype("<u2")
_WEIGHT = np.dtype("<f4")

CHUNK_REASONS: dict[str, str] = {
    "chunk_malformed": "a RouteObservationChunk whose token count, ordinal run or payload "
    "size does not fit its own header (rows x top_k x tokens); refused whole",
}
"""Reason codes of chunk checks (added to the stream processors' quarantine codes)."""


class ChunkError(Exception):
    """A chunk does not fit its own header: ``reason`` is a :data:`CHUNK_REASONS` code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class ChunkTokens(NamedTuple):
    """A chunk's plaintext: ``tokens`` int32 ``[n]``, ``ids`` uint16 ``[n, rows, k]``,
    ``weights`` float32 ``[n, rows, k]``."""

    tokens: np.ndarray
    ids: np.ndarray
    weights: np.ndarray


def _context(*parts: object) -> bytes:
    return "\x1f".join("" if p is None else str(p) for p in parts).encode()


def chunk_context(record: Mapping[str, Any]) -> bytes:
    """What a chunk's seal is bound to: it opens only in the chunk it was made for."""
    return _context("chunk", record["thread"], record["generation"], record["sequence_id"],
                    record["turn_index"], record["first_ordinal"], record["token_count"],
                    record["top_k"], ",".join(map(str, record["layers"])),
                    ",".join(map(str, record["stages"])))


def payload_size(tokens: int, rows: int, top_k: int) -> int:
    """Plaintext payload bytes of a chunk of this shape."""
    return tokens * (4 + rows * top_k * (2 + 4))


def pack_payload(tokens: np.ndarray, ids_TRK: np.ndarray, weights_TRK: np.ndarray) -> bytes:
    """The plaintext payload from arrays (any integer / float dtypes; converted once)."""
    return b"".join((np.ascontiguousarray(tokens, dtype=_TOKEN).tobytes(),
                     np.ascontiguousarray(ids_TRK, dtype=_ID).tobytes(),
                     np.ascontiguousarray(weights_TRK, dtype=_WEIGHT).tobytes()))


def seal_chunk(key: DataKey, header: Mapping[str, Any], payload: bytes) -> dict[str, Any]:
    """A ``RouteObservationChunk.v1`` dict: ``header`` (every field but the sealed payload
    and ``key_generation``; pseudonymous ids) plus ``payload`` sealed under ``key``."""
    out = dict(header)
    out["sealed_payload"] = seal(key, payload, field_name=SEAL_FIELD, context=chunk_context(out))
    out["key_generation"] = key.generation
    return out


def check_chunk(record: Mapping[str, Any]) -> None:
    """The header's own consistency (before any key is looked up); :class:`ChunkError`."""
    count, first = record["token_count"], record["first_ordinal"]
    if not 1 <= count <= MAX_CHUNK_TOKENS:
        raise ChunkError("chunk_malformed", f"token_count={count} is outside "
                         f"[1, {MAX_CHUNK_TOKENS}]")
    if first < 0 or first > _INT64_MAX - count:
        raise ChunkError("chunk_malformed", f"ordinals [{first}, {first}+{count}) leave "
                         f"[0, 2**63)")
    if len(record["stages"]) != len(record["layers"]):
        raise ChunkError("chunk_malformed", f"{len(record['stages'])} stages for "
                         f"{len(record['layers'])} layers; one stage per row")
    if record["top_k"] < 1:
        raise ChunkError("chunk_malformed", f"top_k={record['top_k']} < 1")


def open_chunk(key: DataKey, record: Mapping[str, Any]) -> ChunkTokens:
    """The chunk's plaintext arrays; :class:`SealedFieldError` when the seal does not open,
    :class:`ChunkError` when the payload does not have the header's shape."""
    check_chunk(record)
    payload = open_sealed(key, record["sealed_payload"], field_name=SEAL_FIELD,
                          context=chunk_context(record))
    n, rows, k = record["token_count"], len(record["layers"]), record["top_k"]
    if len(payload) != payload_size(n, rows, k):
        raise ChunkError("chunk_malformed", f"the payload holds {len(payload)} bytes; "
                         f"{n} tokens x {rows} rows x top_k {k} need {payload_size(n, rows, k)}")
    ids_end = 4 * n + 2 * n * rows * k
    return ChunkTokens(np.frombuffer(payload, _TOKEN, n),
                       np.frombuffer(payload, _ID, n * rows * k, 4 * n).reshape(n, rows, k),
                       np.frombuffer(payload, _WEIGHT, offset=ids_end).reshape(n, rows, k))


_SHARED = ("owner", "thread", "generation", "sequence_id", "turn_index", "identity_id",
           "top_k", "producer_id", "counter", "wall_time_ms")


def unroll(record: Mapping[str, Any], opened: ChunkTokens) -> list[dict[str, Any]]:
    """The plaintext ``RouteObservation.v2`` records of the chunk's tokens, in order."""
    base = {name: record[name] for name in _SHARED}
    base["speculative"] = None
    first = record["first_ordinal"]
    ids, weights = opened.ids, opened.weights
    return [{**base, "token_ordinal": first + i, "token_id": int(token),
             "layers": list(record["layers"]), "stages": list(record["stages"]),
             "expert_ids": ids[i].tobytes(), "weights": weights[i].tobytes()}
            for i, token in enumerate(opened.tokens.tolist())]


__all__ = [
    "CHUNK_NAME", "CHUNK_REASONS", "CHUNK_V1", "MAX_CHUNK_TOKENS", "ChunkError", "ChunkTokens",
    "SealedFieldError", "check_chunk", "chunk_context", "open_chunk", "pack_payload",
    "payload_size", "seal_chunk", "unroll",
]
