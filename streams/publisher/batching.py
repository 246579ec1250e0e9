"""Open chunks per thread: consecutive observations of one thread gathered into one record.

The publisher appends every accepted (validated, consented, packed, pseudonymized)
observation to its thread's open :class:`Run`. A run holds only what the chunk needs:
the shared header fields once, and per token the token id and the two byte strings
the runtime packed (no per-token dict survives). A run is closed, to be sealed and
encoded as one ``RouteObservationChunk.v1`` (:mod:`streams.chunks`), when

* it holds ``max_tokens`` tokens;
* the next observation of the thread does not continue it (another generation, request,
  turn, identity, geometry or producer, or an ordinal that is not the next one);
* ``max_ms`` passed since its first token (:meth:`ChunkRuns.pop_due`);
* the thread ends or publishes a turn, or the publisher flushes or closes.

Not thread-safe: the publisher holds its lock around every call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

_SIGNATURE = ("generation", "sequence_id", "turn_index", "identity_id", "top_k", "producer_id")
_INT32_MAX = 2**31 - 1


class Run:
    """One thread's open chunk."""

    __slots__ = ("first", "first_wall", "header", "ids", "last_wall", "opened", "signature",
                 "tokens", "weights")

    def __init__(self, ids: tuple[str, str, str], record: Mapping[str, Any], now: float,
                 signature: tuple[Any, ...]) -> None:
        owner, thread, sequence = ids
        self.header: dict[str, Any] = {
            "owner": owner, "thread": thread, "generation": record["generation"],
            "sequence_id": sequence, "turn_index": record["turn_index"],
            "first_ordinal": record["token_ordinal"], "identity_id": record["identity_id"],
            "layers": list(record["layers"]), "stages": list(record["stages"]),
            "top_k": record["top_k"], "producer_id": record["producer_id"]}
        self.signature = signature
        self.first = record["token_ordinal"]
        self.first_wall = self.last_wall = record["wall_time_ms"]
        self.opened = now
        self.tokens: list[int] = []
        self.ids: list[bytes] = []
        self.weights: list[bytes] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def continues(self, record: Mapping[str, Any], signature: tuple[Any, ...]) -> bool:
        return (signature == self.signature
                and record["token_ordinal"] == self.first + len(self.tokens))

    def append(self, record: Mapping[str, Any]) -> None:
        self.tokens.append(record["token_id"])
        self.ids.append(record["expert_ids"])
        self.weights.append(record["weights"])
        self.last_wall = record["wall_time_ms"]

    def extend(self, tokens: np.ndarray, ids_TLK: np.ndarray, weights_TLK: np.ndarray,
               wall_ms: int) -> None:
        """Append consecutive tokens at once (arrays already in the wire dtypes)."""
        self.tokens.extend(tokens.tolist())
        self.ids.append(ids_TLK.tobytes())
        self.weights.append(weights_TLK.tobytes())
        self.last_wall = wall_ms

    def chunk_header(self, counter: int) -> dict[str, Any]:
        """Every ``RouteObservationChunk.v1`` field but the sealed payload and key generation."""
        span = min(max(self.last_wall - self.first_wall, 0), _INT32_MAX)
        return {**self.header, "token_count": len(self.tokens), "counter": counter,
                "wall_time_ms": self.first_wall, "span_ms": span}

    def payload(self) -> bytes:
        """The plaintext payload: token ids int32, then expert ids, then weights."""
        return b"".join((np.asarray(self.tokens, dtype="<i4").tobytes(), *self.ids,
                         *self.weights))


def signature(record: Mapping[str, Any], ids: tuple[str, str, str]) -> tuple[Any, ...]:
    """What every token of one chunk shares."""
    return (ids, *(record[name] for name in _SIGNATURE), tuple(record["layers"]),
            tuple(record["stages"]))


class ChunkRuns:
    """The open runs of every thread, keyed ``(owner pseudonym, thread pseudonym)``."""

    def __init__(self, *, max_tokens: int, max_ms: float) -> None:
        self.max_tokens = max_tokens
        self.max_s = max_ms / 1000.0
        self._runs: dict[tuple[str, str], Run] = {}
        self.buffered = 0

    def add(self, ids: tuple[str, str, str], record: Mapping[str, Any],
            now: float) -> list[Run]:
        """Append ``record`` (packed, ids ``ids`` = its pseudonyms) to its thread's run;
        returns the runs this closed (the thread's previous run and/or the full one)."""
        key = (ids[0], ids[1])
        sig = signature(record, ids)
        closed: list[Run] = []
        run = self._runs.get(key)
        if run is not None and not run.continues(record, sig):
            closed.append(self._pop(key))
            run = None
        if run is None:
            run = self._runs[key] = Run(ids, record, now, sig)
        run.append(record)
        self.buffered += 1
        if len(run) >= self.max_tokens:
            closed.append(self._pop(key))
        return closed

    def add_block(self, ids: tuple[str, str, str], record: Mapping[str, Any],
                  tokens: np.ndarray, ids_TLK: np.ndarray, weights_TLK: np.ndarray,
                  now: float) -> list[Run]:
        """Append a run of consecutive tokens (``record``: the first token's fields without
        routes; arrays ``[n]``, ``[n, rows, k]`` in the wire dtypes) in as few chunks as
        ``max_tokens`` allows; returns the runs this closed."""
        key, closed, done = (ids[0], ids[1]), [], 0
        while done < len(tokens):
            first = {**record, "token_ordinal": record["token_ordinal"] + done}
            sig = signature(first, ids)
            run = self._runs.get(key)
            if run is not None and not run.continues(first, sig):
                closed.append(self._pop(key))
                run = None
            if run is None:
                run = self._runs[key] = Run(ids, first, now, sig)
            take = min(len(tokens) - done, self.max_tokens - len(run))
            part = slice(done, done + take)
            run.extend(tokens[part], ids_TLK[part], weights_TLK[part], record["wall_time_ms"])
            self.buffered += take
            done += take
            if len(run) >= self.max_tokens:
                closed.append(self._pop(key))
        return closed

    def pop_thread(self, owner: str, thread: str) -> Run | None:
        """The thread's open run (pseudonyms), if any, closed."""
        return self._pop((owner, thread)) if (owner, thread) in self._runs else None

    def pop_due(self, now: float) -> list[Run]:
        """Runs whose first token is ``max_ms`` old or older, closed (oldest first)."""
        due = [key for key, run in self._runs.items() if now - run.opened >= self.max_s]
        return [self._pop(key) for key in due]

    def pop_all(self) -> list[Run]:
        return [self._pop(key) for key in list(self._runs)]

    def oldest(self) -> float | None:
        """When the oldest open run started (monotonic seconds), None when none is open."""
        return min((run.opened for run in self._runs.values()), default=None)

    def _pop(self, key: tuple[str, str]) -> Run:
        run = self._runs.pop(key)
        self.buffered -= len(run)
        return run
