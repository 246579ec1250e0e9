"""Table writes coalesced per key within a batch (Kafka Streams' record cache, in faust).

Every record of a thread rewrites its header, and every record of a producer its
counter; each write is a RocksDB put, a changelog record (one faust message with its
future and callbacks, sealed under the owner's key) and a producer send. In a batch of
records, :class:`WriteCache` keeps the last value written to each key and writes it to
the table once, when the batch is flushed: one header write per thread and batch, one
counter write per producer and batch.

Reads see the cached writes first, so every stage reads its own writes and the other
agents' (the capture and window agents share the capture table's cache).

Why nothing is lost or reordered:

* :meth:`WriteCache.flush` runs at the end of every batch, before faust acks the
  batch's records; the changelog records it sends are flushed by the producer before
  any offset is committed, as table writes always were. A crash before the flush loses
  the cached writes together with the uncommitted offsets of the records that made
  them: the records are read again and make them again.
* faust routes a table write to the changelog partition of the *current event*; each
  cached write keeps the event it was made under and is flushed as that event.
* A rebalance waits for every delivered event to be acked (faust's ``wait_empty``),
  so no batch straddles a revocation: the cache is empty when partitions move.
* A write made outside any event (none today) goes to the table at once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from typing import Any

from faust.streams import current_event

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.streams.processors.batches import handling

log = logging.getLogger(__name__)
_DELETED = object()


class WriteCache(MutableMapping[str, Any]):
    """A faust table (or any mapping) whose writes are held until :meth:`flush`.

    Values are stored by reference: a caller that changes a value after writing it
    changes the cached write (the stages copy before they change, as they must for
    the in-memory store too)."""

    def __init__(self, table: MutableMapping[str, Any], *, name: str = "table",
                 counters: Counters | None = None) -> None:
        self.table = table
        self.name = name
        self.counters = counters or Counters()
        self._pending: dict[str, tuple[Any, Any]] = {}  # key -> (value or _DELETED, event)
        self._writes, self._flushed = f"{name}_writes", f"{name}_flushed"  # counter names

    def __getitem__(self, key: str) -> Any:
        cached = self._pending.get(key)
        if cached is None:
            return self.table[key]
        if cached[0] is _DELETED:
            raise KeyError(key)
        return cached[0]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        cached = self._pending.get(key)  # type: ignore[call-overload]
        if cached is None:
            return key in self.table
        return cached[0] is not _DELETED

    def __setitem__(self, key: str, value: Any) -> None:
        self._hold(key, value)

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self._hold(key, _DELETED)

    def _hold(self, key: str, value: Any) -> None:
        event = current_event()
        if event is None:  # no event to route by: write through
            self._pending.pop(key, None)
            self._write(key, value)
            return
        self.counters.inc("write_cache", self._writes)
        self._pending[key] = (value, event)

    def __iter__(self) -> Iterator[str]:
        for key in self.table:
            if key not in self._pending:
                yield key
        for key, (value, _) in list(self._pending.items()):
            if value is not _DELETED:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def pending(self) -> int:
        """Keys written since the last flush."""
        return len(self._pending)

    def flush(self) -> int:
        """Write every cached key to the table (in the order first written, each as the
        event it was last written under); returns how many were written."""
        pending, self._pending = self._pending, {}
        for key, (value, event) in pending.items():
            with handling(event):
                self._write(key, value)
        self.counters.inc("write_cache", self._flushed, len(pending))
        return len(pending)

    def discard(self) -> int:
        """Forget the cached writes (a rebalance: their records were not acked and are
        read again); returns how many there were."""
        dropped = len(self._pending)
        if dropped:
            log.warning("%s table: %d cached writes of unacked records dropped at a "
                        "rebalance (their records are read again)", self.name, dropped)
        self._pending.clear()
        return dropped

    def _write(self, key: str, value: Any) -> None:
        if value is not _DELETED:
            self.table[key] = value
        elif key in self.table:  # set and deleted within one batch: never written
            del self.table[key]
