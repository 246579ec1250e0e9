"""Agents take their records in batches: one wait for the broker per batch, not per record.

An agent that awaited each output's acknowledgement before its next record spent one
producer linger and one round trip per thread in each of the capture, dedup and window
agents, in series (about 12 ms each here: 600 threads, 7 s per agent). In a batch every
output is sent as its record is handled, and the batch waits once for all of them.

The guarantee is unchanged: faust acks a batch's records only after the agent body
returns for the batch (``Stream.take_events``), offsets are committed only for acked
records and after the producer is flushed, and the body awaits every delivery before
it returns, so the committed offset never passes a record whose outputs the broker did
not acknowledge. A failed delivery raises, the crash-only agent ends the process, and
the batch is read again after the restart (its outputs may repeat; downstream readers
drop repeats by id, as after any crash).

Each agent reports the CPU its event-loop thread spent handling a batch (``on_cpu``, in
microseconds: the handlers and the batch's table flush, not the wait for deliveries): the
worker counts it per agent (``cpu/<agent>_us``), which shows how much of a worker a
stage takes (the dedup agent is the one stage that does not spread over workers).

faust routes every table read and write to the partition of the *current event*. In a
batch the stream's current event is the last one buffered, so :func:`handling` makes
each record the current event while it is handled (and names it to the crash handler).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from faust.streams import _current_event  # faust's own context variable, no public setter

from hebrus_flywheel.streams.processors.crash import record_handled

BATCH_RECORDS = 256
"""Most records one agent handles before it waits for their outputs."""
BATCH_WITHIN_S = 0.02
"""Longest an agent waits for a batch to fill before it handles what it has."""


def batches(stream: Any, max_records: int = BATCH_RECORDS,
            within_s: float = BATCH_WITHIN_S) -> AsyncIterator[list[Any]]:
    """The stream's events, up to ``max_records`` at a time (acked after each batch)."""
    return stream.take_events(max_records, within=within_s)  # type: ignore[no-any-return,unused-ignore]


@contextmanager
def handling(event: Any) -> Iterator[None]:
    """While handled, ``event`` is faust's current event (table partition routing) and
    the record the crash handler names."""
    msg = event.message
    token = _current_event.set(weakref.ref(event))
    try:
        with record_handled((str(msg.topic), int(msg.partition), int(msg.offset))):
            yield
    finally:
        _current_event.reset(token)


async def handle_in_batches(stream: Any,
                            handle: Callable[[Any], Awaitable[list[Any]]],
                            flush: Callable[[], Any] | None = None,
                            on_cpu: Callable[[int], None] | None = None) -> None:
    """The agent body of a stream whose records each yield deliveries: ``handle(msg)``
    for every record of a batch (as the current event), ``flush()`` (the batch's cached
    table writes), then one wait for them all. ``on_cpu`` gets the thread CPU
    microseconds of each batch's handling and flush."""
    async for events in batches(stream):
        deliveries: list[Any] = []
        with counting_cpu(on_cpu):
            for event in events:
                with handling(event):
                    deliveries.extend(await handle(event.message))
            if flush is not None:
                flush()
        with record_handled(None):
            await all_delivered(deliveries)  # before faust acks the batch's records


@contextmanager
def counting_cpu(on_cpu: Callable[[int], None] | None) -> Iterator[None]:
    """Give ``on_cpu`` the thread CPU microseconds the block took (when it completes;
    nothing without ``on_cpu``)."""
    started = time.thread_time_ns()
    yield
    if on_cpu is not None:
        on_cpu(cpu_us_since(started))


def cpu_us_since(started_ns: int) -> int:
    """This thread's CPU microseconds since ``started_ns`` (a ``time.thread_time_ns()``).
    While an agent's handler runs without yielding to the event loop, that is the agent's
    own CPU; a handler that waits (producer backpressure) also counts what other tasks
    did meanwhile."""
    return (time.thread_time_ns() - started_ns) // 1000


async def all_delivered(deliveries: Iterable[Awaitable[Any]]) -> None:
    """Wait for every delivery (the first failure raises)."""
    for delivery in deliveries:
        await delivery
