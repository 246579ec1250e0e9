"""``core.liveness.Monitor``: the health file it writes and removes (no broker needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.liveness import Monitor, MonitorTarget
from hebrus_flywheel.core.progress import WatchdogConfig, health_path, read_health


def _monitor(home: Path) -> Monitor:
    target = MonitorTarget(kind="replay", name="g", topics=("t",), home=home)
    return Monitor(target, WatchdogConfig(), kafka.client_config("127.0.0.1:1"),
                   on_verdict=lambda verdict: None)


def test_remove_health_deletes_the_record_of_a_clean_exit(tmp_path: Path) -> None:
    monitor = _monitor(tmp_path)
    monitor.write_health()
    [record] = read_health(tmp_path, "replay")
    assert record["name"] == "g" and health_path(tmp_path, "replay", "g").is_file()
    assert monitor.remove_health() is True
    assert read_health(tmp_path, "replay") == []
    assert monitor.remove_health() is True  # idempotent: nothing left to delete


def test_remove_health_keeps_the_record_while_the_thread_runs(tmp_path: Path) -> None:
    monitor = _monitor(tmp_path)
    monitor.write_health()
    monitor.is_alive = lambda: True  # type: ignore[method-assign]
    monitor.join = lambda timeout=None: None  # type: ignore[method-assign]
    assert monitor.remove_health(timeout_s=0.01) is False
    assert len(read_health(tmp_path, "replay")) == 1


def test_a_stalled_streams_worker_says_what_it_waits_for(capsys: Any) -> None:
    """The stall verdict prints faust's partition and flow view and where every asyncio
    task waits, innermost call first."""
    import asyncio
    from types import SimpleNamespace
    from typing import NamedTuple

    from hebrus_flywheel.streams.processors.liveness import (
        await_chain,
        consumer_state,
        dump_stacks,
    )

    class TP(NamedTuple):
        topic: str
        partition: int

    tp = TP("t.flywheel.capture.observations.v1", 3)
    consumer = SimpleNamespace(assignment=lambda: {tp}, _active_partitions={tp}, _read_offset={},
                               _paused_partitions=set(), _buffered_partitions=set(),
                               flow_active=False)
    app = SimpleNamespace(consumer=consumer,
                          flow_control=SimpleNamespace(is_active=lambda: True))
    state = consumer_state(app)
    assert "active=['t.flywheel.capture.observations.v1[3]']" in state
    assert "paused=[]" in state and "flow_active=False flow_control_active=True" in state
    assert consumer_state(SimpleNamespace()).startswith("consumer state unavailable")

    async def inner(event: asyncio.Event) -> None:
        await event.wait()

    async def outer(event: asyncio.Event) -> None:
        await inner(event)

    async def main() -> None:
        event = asyncio.Event()
        task = asyncio.create_task(outer(event), name="waiter")
        await asyncio.sleep(0)
        chain = await_chain(task.get_coro())
        assert [c.rsplit(" ", 1)[-1] for c in chain[:3]] == ["outer", "inner", "wait"]
        dump_stacks(asyncio.get_running_loop())
        event.set()
        await task

    asyncio.run(main())
    err = capsys.readouterr().err
    assert "waiter: " in err and "inner <- " in err and "Thread MainThread" in err
