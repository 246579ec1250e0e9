"""Event-time order for the dedup stage: the same decisions however many workers run.

Near-duplicate decisions are first come, first kept (:mod:`streams.processors.dedup`),
so their order decides which member of a duplicate pair survives. Summaries reach the
single dedup partition in the order generations complete across capture partitions,
which follows timing: two runs over the same records, with one worker or two, kept
different members of some pairs (``bench/streams.py --exact-copies``).

Here generations are decided in the order of their event time instead:

* a summary carries ``end_ms``, the latest wall time of any record applied to its
  generation, and generations are decided in ``(end_ms, iid)`` order;
* the capture stage keeps, per capture partition and topic, the latest wall time read
  (:class:`EventClocks`). After each batch the worker sends the dedup stage a *mark* for
  each partition it read: the slowest topic's clock less ``order_lateness_ms``, below
  which no summary of that partition will end (a generation completes on its last
  record; until that record is read its topic's clock is at most the record's wall time
  plus the lateness, and the generation ends no earlier than that wall time); or no
  bound (``None``) once the partition is caught up, since nothing it read is still to
  complete (:class:`MarkPolicy`: at once at the end of the backlog it started with,
  after ``order_grace_s`` of being caught up with live records; records arriving again
  make every such mark hold again before the batch's summaries go out);
* :class:`DecisionOrder` keeps every partition's latest mark and the summaries not yet
  decided, and decides, in order, each summary that ends below every partition's mark
  (the *watermark*). A partition without a mark holds everything back.

Not ordered (decided on arrival, counted ``dedup/late_summaries`` when that is out of
order): a generation closed as idle (that is decided by processing time anyway), a
record later than the lateness allows, live records that reach a worker after another
worker's partitions had already passed everything (their fetch came later than the
grace), or a record read again after a crash. Those are the cases where which
duplicate survives still follows timing.

Summaries waiting for their turn live in the dedup table (``p<SEP><iid>``, sealed under
the owner's key like a decision), marks under ``m<SEP><partition>``, so a restarted
worker resumes where it stopped; a redelivered summary that waits already changes
nothing.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any, Protocol

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.common import SEP
from hebrus_flywheel.streams.processors.dedup import DECISION_PREFIX

PENDING_PREFIX = f"p{SEP}"
"""Summaries waiting for the watermark (owner data: sealed in the changelog)."""
MARK_PREFIX = f"m{SEP}"
"""Each capture partition's latest mark (``{"at": ms | None}``)."""
LAST_KEY = f"n{SEP}last"
"""``[end_ms, iid]`` of the latest summary decided in order."""
ORDERED_KINDS = ("transcripts", "observations")
"""The capture topics whose records complete generations."""

OrderKey = tuple[int, str]


class Decider(Protocol):
    """What :class:`DecisionOrder` drives: a :class:`~streams.processors.dedup.DedupStage`."""

    store: MutableMapping[str, Any]
    counters: Counters

    def process(self, summary: Mapping[str, Any]) -> dict[str, Any]: ...

    def reset(self) -> None: ...


def order_key(summary: Mapping[str, Any]) -> OrderKey:
    """Where a summary stands in decision order: its end (its start for summaries of older
    workers, which carry none), then its id."""
    for field in ("end_ms", "start_ms"):
        value = summary.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value, str(summary["iid"])
    return 0, str(summary["iid"])


class EventClocks:
    """The latest wall time read on each ordered capture topic of each partition."""

    def __init__(self) -> None:
        self._clocks: dict[int, dict[str, int]] = {}

    def observe(self, partition: int, kind: str, record: Mapping[str, Any]) -> None:
        wall = record.get("wall_time_ms")
        if kind not in ORDERED_KINDS or not isinstance(wall, int) or isinstance(wall, bool):
            return
        clocks = self._clocks.setdefault(partition, {})
        if wall > clocks.get(kind, wall - 1):
            clocks[kind] = wall

    def bound(self, partition: int, lateness_ms: int) -> int | None:
        """The end below which no generation of ``partition`` completes from records not
        read yet; None until every ordered topic of it has been read."""
        clocks = self._clocks.get(partition, {})
        if len(clocks) < len(ORDERED_KINDS):
            return None
        return min(clocks.values()) - lateness_ms


HOLD_MS = -1
"""A mark below every generation's end: holds everything back (a partition with no
bound yet whose records resumed)."""


BOUND_INTERVAL_S = 0.2
"""The least processing time between two bounds of one partition: a partition read in
every batch would otherwise send one (and the dedup stage apply one) per batch."""


class MarkPolicy:
    """Which mark each capture partition sends after a batch (the worker's side).

    Behind a backlog a partition's mark is its clocks' bound. Once it is caught up, the
    first time (the end of the backlog it started with) it passes everything at once
    (``None``); later, with live records arriving, only after it stayed caught up for
    ``grace_s`` of processing time: the end offsets a caught-up check sees are those of
    the partition's last fetch, so a record produced before another partition's records
    may not be known yet when those complete a generation; meanwhile its bound holds.
    :meth:`due` names the partitions whose grace ended, to be looked at again (the worker
    sends them a tick, whose batch sends their mark in order with their summaries).

    When records arrive again for a partition whose mark passed everything, traffic has
    resumed, and the others will soon have records too: :meth:`resume` (before the batch's
    summaries are sent) makes every such mark hold again at its bound, so a partition
    whose first records come a little later is not overtaken; each passes everything
    again once caught up for ``grace_s``. A partition's first batch on this worker sends
    its bound first too: the mark the dedup stage holds may be a previous owner's.

    A bound that moves is sent at most every ``interval_s`` per partition (a bound is a
    promise that stays true as the clocks advance, so a later one only decides sooner)."""

    def __init__(self, *, grace_s: float, interval_s: float = BOUND_INTERVAL_S) -> None:
        if not grace_s >= 0:
            raise ConfigError(f"MarkPolicy grace_s must be >= 0, got {grace_s!r}")
        if not interval_s >= 0:
            raise ConfigError(f"MarkPolicy interval_s must be >= 0, got {interval_s!r}")
        self.grace_s = grace_s
        self.interval_s = interval_s
        self._sent: dict[int, int | None] = {}
        self._sent_at: dict[int, float] = {}  # when a partition's bound last went out
        self._caught_up_since: dict[int, float] = {}
        self._live: set[int] = set()

    def next_mark(self, partition: int, *, caught_up: bool, bound: int | None,
                  now_s: float, read: bool = False) -> tuple[bool, int | None]:
        """``(send, at)``: whether the partition's mark moved, and its mark (None: passes
        everything); ``read``: the batch just read records of it (they were live, so a
        grace starts again)."""
        if not caught_up or read:
            self._caught_up_since.pop(partition, None)
        passes = False
        if caught_up:
            since = self._caught_up_since.setdefault(partition, now_s)
            passes = partition not in self._live or now_s - since >= self.grace_s
        if passes:
            self._live.add(partition)
            at = None
        elif bound is None:  # no bound yet: the mark stays what it was
            return False, self._sent.get(partition, HOLD_MS)
        else:
            at = bound
        previous = self._sent.get(partition, HOLD_MS)
        if partition in self._sent and previous == at:
            return False, at
        if at is not None and previous is not None and previous != HOLD_MS \
                and now_s - self._sent_at.get(partition, -math.inf) < self.interval_s:
            # a newer bound only lets decisions go sooner; the one sent still holds true
            return False, previous
        self._sent[partition] = at
        self._sent_at[partition] = now_s
        return True, at

    def resume(self, read: set[int],
               bound: Callable[[int], int | None]) -> list[tuple[int, int]]:
        """``(partition, mark)`` to send before a batch that reads the partitions ``read``:
        for each of them that has sent no mark since the worker started or was assigned
        it (the dedup stage may hold an older worker's mark that passes everything), and,
        when one of them had passed everything, for every partition that had."""
        fresh = {p for p in read if p not in self._sent}
        if any(self._sent.get(p, HOLD_MS) is None for p in read):
            fresh |= {p for p, sent in self._sent.items() if sent is None}
        out = []
        for partition in sorted(fresh):
            at = bound(partition)
            at = HOLD_MS if at is None else at
            self._sent[partition] = at
            self._caught_up_since.pop(partition, None)
            out.append((partition, at))
        return out

    def due(self, now_s: float) -> list[int]:
        """Caught-up partitions whose grace has ended but whose mark still holds back."""
        return sorted(p for p, since in self._caught_up_since.items()
                      if now_s - since >= self.grace_s and self._sent.get(p, HOLD_MS) is not None)

    def forget(self) -> None:
        """After a rebalance: every partition's mark is sent afresh."""
        self._sent.clear()
        self._sent_at.clear()
        self._caught_up_since.clear()
        self._live.clear()


def watermark_of(marks: Mapping[int, float | None], partitions: int) -> float:
    """The lowest of ``partitions`` marks: -inf while a partition has none, a mark of
    None (caught up) passes everything, no partitions give no bound."""
    if not partitions:
        return math.inf
    if len(marks) < partitions:
        return -math.inf
    return min((at for at in marks.values() if at is not None), default=math.inf)


class DecisionOrder:
    """Feeds a :class:`DedupStage` its summaries in event-time order (see the module doc).

    ``partitions``: how many capture partitions send marks (the capture topics'
    partition count)."""

    def __init__(self, stage: Decider, *, partitions: int) -> None:
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ConfigError(f"DecisionOrder partitions must be a positive integer, "
                              f"got {partitions!r}")
        self.stage = stage
        self.store = stage.store
        self.partitions = partitions
        self._pending: list[OrderKey] | None = None  # a heap, rebuilt from the store
        self._marks: dict[int, int | None] | None = None  # the store's marks, read once
        self.held = 0
        """How many summaries wait, as of the last change (read by the watchdog thread)."""

    def reset(self) -> None:
        """Forget what is held in memory (after a rebalance); rebuilt from the store."""
        self._pending = None
        self._marks = None
        self.stage.reset()

    def arrive(self, summary: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The decisions a summary's arrival allows: its own now, or none until the
        watermark passes it (a repeat gets its recorded decision, or waits again)."""
        iid = str(summary["iid"])
        if DECISION_PREFIX + iid in self.store:
            return [self.stage.process(summary)]
        if PENDING_PREFIX + iid in self.store:
            self.stage.counters.inc("dedup", "repeated_summaries")
            return []
        key = order_key(summary)
        if key[0] < self.watermark():
            return [self._decide(summary, key)]
        heap = self._heap()  # built from the store before this summary joins it
        self.store[PENDING_PREFIX + iid] = {"summary": dict(summary), "end": key[0]}
        heapq.heappush(heap, key)
        self.held = len(heap)
        self.stage.counters.inc("dedup", "summaries_waited")
        return []

    def mark(self, partition: int, at_ms: int | None) -> list[dict[str, Any]]:
        """Record a capture partition's mark; the decisions it allows, in order."""
        if isinstance(partition, bool) or not isinstance(partition, int) \
                or not 0 <= partition < self.partitions:
            raise ConfigError(f"a mark for capture partition {partition!r}, but the capture "
                              f"topics have {self.partitions}: run every worker against the "
                              "same topics")
        marks = self._mark_view()
        if partition not in marks or marks[partition] != at_ms:
            marks[partition] = at_ms
            self.store[MARK_PREFIX + str(partition)] = {"at": at_ms}
        return self.release()

    def watermark(self) -> float:
        """The end below which every summary may be decided: the lowest mark (-inf while
        a partition has none, +inf once every partition is caught up)."""
        return watermark_of(self._mark_view(), self.partitions)

    def release(self) -> list[dict[str, Any]]:
        """Decide, in order, every waiting summary that ends below the watermark."""
        heap, watermark = self._heap(), self.watermark()
        out = []
        while heap and heap[0][0] < watermark:
            key = heapq.heappop(heap)
            pkey = PENDING_PREFIX + key[1]
            value = self.store.get(pkey)
            if value is None:  # decided meanwhile (its summary came again, late)
                continue
            del self.store[pkey]
            out.append(self._decide(value["summary"], key))
        self.held = len(heap)
        return out

    def pending(self) -> int:
        """How many summaries wait (read from the store after a reset)."""
        self.held = len(self._heap())
        return self.held

    def _decide(self, summary: Mapping[str, Any], key: OrderKey) -> dict[str, Any]:
        last = self.store.get(LAST_KEY)
        if last is not None and key < (int(last[0]), str(last[1])):
            self.stage.counters.inc("dedup", "late_summaries")
        else:
            self.store[LAST_KEY] = [key[0], key[1]]
        return self.stage.process(summary)

    def _mark_view(self) -> dict[int, int | None]:
        if self._marks is None:
            self._marks = {}
            for partition in range(self.partitions):
                value = self.store.get(MARK_PREFIX + str(partition))
                if value is not None:
                    self._marks[partition] = value.get("at")
        return self._marks

    def _heap(self) -> list[OrderKey]:
        if self._pending is None:
            self._pending = [(int(v["end"]), k[len(PENDING_PREFIX):])
                             for k, v in self.store.items() if k.startswith(PENDING_PREFIX)]
            heapq.heapify(self._pending)
        return self._pending


class _OrderOnly:
    """The part of a :class:`DedupStage` that :func:`decision_sequence` needs: it records
    the order of decisions, deciding nothing."""

    def __init__(self) -> None:
        self.store: MutableMapping[str, Any] = {}
        self.counters = Counters()
        self.order: list[str] = []

    def reset(self) -> None:
        pass

    def process(self, summary: Mapping[str, Any]) -> dict[str, Any]:
        iid = str(summary["iid"])
        if DECISION_PREFIX + iid not in self.store:
            self.store[DECISION_PREFIX + iid] = True
            self.order.append(iid)
        return {"iid": iid}


def decision_sequence(records: Iterable[Mapping[str, Any]], partitions: int) -> list[str]:
    """The generation ids in the order a dedup agent that read ``records`` (the threads
    topic's summaries and marks, in offset order) decided them: what a rebuild replays
    (``flywheel rebuild --from-capture``). Summaries still waiting at the end come last,
    in decision order."""
    recorder = _OrderOnly()
    order = DecisionOrder(recorder, partitions=partitions)
    for record in records:
        if "mark" in record:
            order.mark(int(record["mark"]), record["at"])
        else:
            order.arrive(record)
    for partition in range(partitions):
        order.mark(partition, None)
    return recorder.order
