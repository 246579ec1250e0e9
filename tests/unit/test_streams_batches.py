"""Batched agents (streams.processors.batches): each record of a batch is faust's
current event while it is handled (tables route by it), a crash names the record being
handled (not the last one buffered), and one while the batch waits for its deliveries
names none (a failed delivery must not count towards a record's poison verdict)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import faust
import pytest

from hebrus_flywheel.streams.processors.batches import all_delivered, handling
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
            assert faust.current_event().message.partition == 3
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
