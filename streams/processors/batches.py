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
stage takes (the dedup agent is the one stage that does not spread over workers). Only
the agent's own steps count (:func:`own_cpu`): a handler's ``send`` can yield to the
event loop, and what the other agents do until it resumes is theirs.

faust routes every table read and write to the partition of the *current event*. In a
batch the stream's current event is the last one buffered, so :func:`handling` makes
each record the current event while it is handled (and names it to the crash handler).
"""

from __future__ import annotations

import time
import types
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
)
from contextlib import contextmanager
from typing import Any, TypeVar

from faust.streams import _current_event  # faust's own context variable, no public setter

from hebrus_flywheel.streams.processors.crash import record_handled

BATCH_RECORDS = 256
"""Most records one agent handles before it waits for their outputs."""
BATCH_WITHIN_S = 0.02
"""Longest an agent waits for a batch to fill before it handles what it has."""

T = TypeVar("T")


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
                            on_cpu: Callable[[int], None] | None = None,
                            before: Callable[[list[Any]], Awaitable[list[Any]]] | None = None,
                            after: Callable[[list[Any]], Awaitable[list[Any]]] | None = None,
                            ) -> None:
    """The agent body of a stream whose records each yield deliveries: ``before(messages)``
    and ``after(messages)`` (what the batch as a whole sends first and last, their
    deliveries too) around ``handle(msg)`` for every record of a batch (as the current
    event), ``flush()`` (the batch's cached table writes), then one wait for them all.
    ``on_cpu`` gets the thread CPU microseconds of each batch's handling and flush."""

    async def handle_batch(events: list[Any]) -> list[Any]:
        deliveries: list[Any] = []
        if before is not None:
            deliveries.extend(await before([event.message for event in events]))
        for event in events:
            with handling(event):
                deliveries.extend(await handle(event.message))
        if after is not None:
            deliveries.extend(await after([event.message for event in events]))
        if flush is not None:
            flush()
        return deliveries

    await run_batches(stream, handle_batch, on_cpu)


async def run_batches(stream: Any,
                      handle_batch: Callable[[list[Any]], Coroutine[Any, Any, list[Any]]],
                      on_cpu: Callable[[int], None] | None = None) -> None:
    """The agent body of a stream handled a batch of events at a time: ``handle_batch``
    (its CPU to ``on_cpu``) returns the batch's deliveries, all awaited before faust
    acks the batch's records."""
    async for events in batches(stream):
        deliveries = await own_cpu(handle_batch(events), on_cpu)
        with record_handled(None):
            await all_delivered(deliveries)  # before faust acks the batch's records


@types.coroutine
def own_cpu(coro: Coroutine[Any, Any, T],
            on_cpu: Callable[[int], None] | None) -> Generator[Any, Any, T]:
    """Await ``coro``, giving ``on_cpu`` the thread CPU microseconds of its own steps
    (when it completes; nothing without ``on_cpu``).

    The coroutine is stepped here, in the awaiting task, and the clock runs only while a
    step runs: the time it is suspended (a send waiting for the producer's buffer, say)
    belongs to whatever other tasks the event loop ran meanwhile, not to it. Awaiting it
    is otherwise the same as awaiting ``coro``: what it yields goes to the task, what the
    task sends or throws (cancellation) goes back into it.
    """
    spent_ns = 0
    step: Callable[[Any], Any] = coro.send
    value: Any = None
    while True:
        started = time.thread_time_ns()
        try:
            yielded = step(value)
        except StopIteration as stop:
            spent_ns += time.thread_time_ns() - started
            if on_cpu is not None:
                on_cpu(spent_ns // 1000)
            return stop.value
        spent_ns += time.thread_time_ns() - started
        try:
            value, step = (yield yielded), coro.send
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # thrown into the task: on into the coroutine
            value, step = exc, coro.throw


async def all_delivered(deliveries: Iterable[Awaitable[Any]]) -> None:
    """Wait for every delivery (the first failure raises)."""
    for delivery in deliveries:
        await delivery
