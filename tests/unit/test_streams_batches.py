"""Batched agents (streams.processors.batches): each record of a batch is faust's
current event while it is handled (tables route by it), a crash names the record being
handled (not the last one buffered), and one while the batch waits for its deliveries
names none (a failed delivery must not count towards a record's poison verdict). Each
batch reports the CPU of its handling and flush, not of its wait: checked with a thread
CPU clock that the handler, the flush and the deliveries advance by known amounts."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import faust
import pytest

from hebrus_flywheel.streams.processors import batches
from hebrus_flywheel.streams.processors.batches import all_delivered, handle_in_batches, handling
from hebrus_flywheel.streams.processors.crash import CRASH_EXIT_STATUS


class Event:
    """What the batch helpers read of a faust event (which, like this, is weakref-able)."""

    def __init__(self, partition: int, offset: int) -> None:
        self.message = SimpleNamespace(topic="cap", partition=partition, offset=offset)


def event(partition: int, offset: int) -> Event:
    return Event(partition, offset)


def test_each_record_is_the_current_event_while_handled() -> None:
    first, second = event(0, 7), event(3, 9)
    assert faust.current_event() is None
    with handling(first):
        assert faust.current_event() is first
        with handling(second):
            current = faust.current_event()
            assert current is not None and current.message.partition == 3
        assert faust.current_event() is first
    assert faust.current_event() is None


def test_all_delivered_raises_the_first_failure() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ok, failed = loop.create_future(), loop.create_future()
        ok.set_result(None)
        failed.set_exception(RuntimeError("NotEnoughReplicas"))
        await all_delivered([ok, failed])

    with pytest.raises(RuntimeError, match="NotEnoughReplicas"):
        asyncio.run(main())


SCRIPT = textwrap.dedent("""
    import asyncio, logging
    from types import SimpleNamespace
    from hebrus_flywheel.streams.processors.batches import handling
    from hebrus_flywheel.streams.processors.crash import (crash_only_agent, on_crash,
                                                           record_handled)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    on_crash(lambda record, error: print("HOOK", record, flush=True))

    class event:
        def __init__(self, offset):
            self.message = SimpleNamespace(topic="cap", partition=1, offset=offset)

    async def body(stream):
        batch = [event(10), event(11), event(12)]
        stream.current_event = batch[-1]  # what faust's stream holds while batching
        for e in batch:
            with handling(e):
                if "{where}" == "record" and e.message.offset == 11:
                    raise RuntimeError("bad record")
        with record_handled(None):
            raise RuntimeError("delivery failed")

    asyncio.run(crash_only_agent("capture", body)(SimpleNamespace()))
    print("NOT REACHED")
""")


@pytest.mark.parametrize(("where", "named"), [("record", "on cap[1]@11"), ("deliveries", None)])
def test_batched_crash_names_the_record_handled(where: str, named: str | None) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(where=where)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == CRASH_EXIT_STATUS, done.stderr
    assert "NOT REACHED" not in done.stdout
    line = next(x for x in done.stderr.splitlines() if "streams worker crashed" in x)
    if named is None:
        assert "agent capture failed: RuntimeError: delivery failed" in line
        assert "HOOK" not in done.stdout  # no record: nothing counted as poison
    else:
        assert f"agent capture failed {named}: RuntimeError: bad record" in line
        assert "HOOK ('cap', 1, 11)" in done.stdout


class FakeClock:
    def __init__(self) -> None:
        self.ns = 0

    def spend(self, us: int) -> None:
        self.ns += us * 1000


class BatchedStream:
    """What ``handle_in_batches`` uses of a faust stream: ``take_events`` batches."""

    def __init__(self, batch_sizes: list[int]) -> None:
        self.batch_sizes = batch_sizes

    async def take_events(self, max_records: int, within: float) -> AsyncIterator[list[Any]]:
        offset = 0
        for size in self.batch_sizes:
            yield [event(0, offset + i) for i in range(size)]
            offset += size


def _run(batch_sizes: list[int], clock: FakeClock) -> tuple[list[int], list[int], list[str]]:
    reported: list[int] = []
    handled: list[int] = []
    order: list[str] = []

    async def delivery() -> None:
        clock.spend(100_000)  # what other tasks do while the batch waits: not the agent's
        order.append("delivered")

    async def handle(msg: Any) -> list[Any]:
        current = faust.current_event()
        assert current is not None and current.message is msg  # the record is the current event
        clock.spend(700)
        handled.append(msg.offset)
        order.append("handled")
        return [delivery()]

    def flush() -> None:
        clock.spend(300)
        order.append("flushed")

    asyncio.run(handle_in_batches(BatchedStream(batch_sizes), handle, flush=flush,
                                  on_cpu=reported.append))
    return reported, handled, order


def test_each_batch_reports_the_cpu_of_its_handling_and_flush_not_of_its_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(batches.time, "thread_time_ns", lambda: clock.ns)
    reported, handled, order = _run([3, 1, 2], clock)
    assert reported == [3 * 700 + 300, 700 + 300, 2 * 700 + 300]
    assert handled == list(range(6))
    # a batch's records are handled, then its table writes flushed, then its deliveries
    # awaited, before the next batch is taken
    assert order[:8] == ["handled"] * 3 + ["flushed"] + ["delivered"] * 3 + ["handled"]


def test_without_a_cpu_counter_nothing_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(batches.time, "thread_time_ns", lambda: clock.ns)

    async def handle(msg: Any) -> list[Any]:
        clock.spend(5)
        return []

    asyncio.run(handle_in_batches(BatchedStream([2]), handle))
    assert clock.ns == 2 * 5000


def test_own_cpu_counts_only_the_coroutine_s_own_steps_not_other_tasks_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler whose send yields to the event loop (the producer's buffer is full) is
    charged for its own work only: what another agent does until it resumes is not its."""
    clock = FakeClock()
    monkeypatch.setattr(batches.time, "thread_time_ns", lambda: clock.ns)
    reported: list[int] = []

    async def main() -> str:
        buffer_free = asyncio.get_running_loop().create_future()

        async def other_agent() -> None:
            clock.spend(50_000)
            buffer_free.set_result(None)

        async def handler() -> str:
            clock.spend(300)
            other = asyncio.ensure_future(other_agent())
            await buffer_free  # suspended: the other agent runs
            clock.spend(200)
            await other
            return "sent"

        return await batches.own_cpu(handler(), reported.append)

    assert asyncio.run(main()) == "sent"
    assert reported == [500]


def test_own_cpu_passes_a_cancellation_into_the_coroutine_and_reports_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(batches.time, "thread_time_ns", lambda: clock.ns)
    reported: list[int] = []
    cleaned: list[str] = []

    async def handler() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append("finally ran")

    async def main() -> None:
        task = asyncio.ensure_future(batches.own_cpu(handler(), reported.append))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert cleaned == ["finally ran"] and reported == []


def test_own_cpu_raises_what_the_coroutine_raises() -> None:
    async def handler() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad record")

    async def main() -> None:
        await batches.own_cpu(handler(), None)

    with pytest.raises(ValueError, match="bad record"):
        asyncio.run(main())
