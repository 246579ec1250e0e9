"""How far the worker's capture agent has read each capture partition, and what follows.

The capture agent records the last offset it processed per capture topic partition
(``processed``). From it and the consumer's end offsets this judges whether a partition
is caught up (:func:`streams.processors.expiry.caught_up`), and sends what depends on
that: idle ticks (threads may only go idle while their partition is caught up) and the
dedup stage's marks for its event-time order (:mod:`streams.processors.decision_order`:
the capture agent calls :meth:`CaptureProgress.hold_marks` before and
:meth:`CaptureProgress.send_marks` after each batch, so every mark is on the threads
topic in order with the batch's summaries).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from faust.types import TP

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.streams.processors import expiry, liveness
from hebrus_flywheel.streams.processors.decision_order import EventClocks, MarkPolicy
from hebrus_flywheel.streams.processors.topology import StreamTopics

MARK_KEY = b"mark"
"""The key of a capture partition's mark on the threads topic (owner keys hold a '/')."""


class CaptureProgress:
    """The capture agent's progress: caught-up checks, idle ticks, dedup marks."""

    def __init__(self, *, app: Any, topics: StreamTopics, clocks: EventClocks,
                 lateness_ms: int, grace_s: float, counters: Counters,
                 threads_topic: Any, ticks_topic: Any,
                 mark_sink: Callable[[int, int | None], Awaitable[list[Any]]] | None = None,
                 ) -> None:
        self.app, self.topics, self.clocks, self.counters = app, topics, clocks, counters
        self.lateness_ms = lateness_ms
        self.threads_topic, self.ticks_topic = threads_topic, ticks_topic
        # where marks go: the threads topic's one partition, or (band-partitioned dedup,
        # streams.processors.band_agents) every band and home partition
        self.mark_sink = mark_sink or self._send_mark
        self.marks = MarkPolicy(grace_s=grace_s)
        self.processed: dict[tuple[str, int], int] = {}  # capture offsets processed here

    def forget(self) -> None:
        """After a rebalance: offsets processed here before it may be behind what another
        worker has processed of a partition since; positions start at the commit again,
        and every mark is sent afresh."""
        self.processed.clear()
        self.marks.forget()

    def caught_up(self, partition: int, assigned: set[Any], *, known: bool = False) -> bool:
        """Whether every record of the capture partition this worker knows of was
        processed here; ``known``: and its ends are known (fetched) and it is assigned."""
        consumer = self.app.consumer
        for topic in (self.topics.transcripts, self.topics.observations):
            tp = TP(topic, partition)
            highwater = consumer.highwater(tp) if tp in assigned else None
            if known and highwater is None:
                return False
            committed = liveness.committed_offset(consumer, tp)
            if not expiry.caught_up(self.processed.get((topic, partition)), committed,
                                    highwater):
                return False
        return True

    # -- marks --------------------------------------------------------------------------

    async def hold_marks(self, messages: list[Any]) -> list[Any]:
        """Before a capture batch's summaries: the marks that must hold again because the
        batch reads records (:meth:`MarkPolicy.resume`); their deliveries."""
        deliveries = []
        for partition, at in self.marks.resume(self._read(messages), self._bound):
            deliveries.extend(await self.mark_sink(partition, at))
        return deliveries

    async def send_marks(self, messages: list[Any]) -> list[Any]:
        """After a capture batch, the mark of each capture partition read or assigned
        here, when it moved (a caught-up partition passes everything); deliveries."""
        assigned = set(self.app.consumer.assignment())
        read = self._read(messages)
        partitions = read | {tp.partition for tp in assigned
                             if tp.topic == self.topics.transcripts}
        deliveries, now_s = [], time.monotonic()
        for partition in sorted(partitions):
            send, at = self.marks.next_mark(
                partition, caught_up=self.caught_up(partition, assigned, known=True),
                bound=self._bound(partition), now_s=now_s, read=partition in read)
            if send:
                deliveries.extend(await self.mark_sink(partition, at))
        return deliveries

    def _read(self, messages: list[Any]) -> set[int]:
        return {int(m.partition) for m in messages if m.topic != self.topics.ticks}

    def _bound(self, partition: int) -> int | None:
        return self.clocks.bound(partition, self.lateness_ms)

    async def _send_mark(self, partition: int, at: int | None) -> list[Any]:
        return [await self.threads_topic.send(
            key=MARK_KEY, value=json.dumps({"mark": partition, "at": at}).encode(), partition=0)]

    # -- timers -------------------------------------------------------------------------

    async def send_ticks(self) -> None:
        """An idle tick to every assigned capture partition that is caught up."""
        assigned = set(self.app.consumer.assignment())
        for tp in assigned:
            if tp.topic != self.topics.transcripts:
                continue
            if self.caught_up(tp.partition, assigned):
                await self._tick(tp.partition)
            else:  # behind a backlog: nothing is idle yet (expiry.caught_up)
                self.counters.inc("expiry", "ticks_deferred_behind_backlog")

    async def release_marks(self) -> None:
        """A tick to each caught-up capture partition whose grace ended (its batch sends
        the mark that lets the dedup stage decide past it)."""
        assigned = set(self.app.consumer.assignment())
        for partition in self.marks.due(time.monotonic()):
            # still caught up: a tick behind a backlog could close threads as idle
            if self.caught_up(partition, assigned, known=True):
                await self._tick(partition)

    async def _tick(self, partition: int) -> None:
        await self.ticks_topic.send(key=b"tick", value=b"", partition=partition)
