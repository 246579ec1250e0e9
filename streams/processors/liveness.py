"""``--drain`` and the watchdog of the streams worker (invariant 11).

The worker's inputs are the capture topics and its own internal hops (threads,
decisions); the self-generated tick topic is not an input (it never drains: the worker
writes to it every tick). The group is drained when every input partition's committed
offset reached its end offset on two consecutive reads with the same end offsets —
faust commits an offset only after the producer flushed its outputs, so each hop's
outputs are acknowledged and counted as the next hop's end offsets.

Progress, for the stall timeout, is a committed offset that moved or a read offset that
moved (:func:`read_offsets`: faust commits on an interval, and under heavy load a busy
worker may read for longer than the stall timeout between two commits of a partition).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.liveness import Monitor, MonitorTarget
from hebrus_flywheel.core.progress import DRAINED, Verdict, WatchdogConfig
from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.streams.processors.topology import StreamTopics

log = logging.getLogger(__name__)
STOP_GRACE_S = 60.0


def input_topics(topics: StreamTopics, *, dedup_bands: bool = False) -> tuple[str, ...]:
    """Every topic a worker reads (``dedup_bands``: its dedup's are the band and home
    topics, not the threads topic)."""
    dedup = (topics.bands, topics.homes) if dedup_bands else (topics.threads,)
    return (topics.transcripts, topics.observations, topics.identities, *dedup,
            topics.decisions)


def agent_states(app: Any) -> Mapping[str, str]:
    """``name -> mode service state`` of every faust agent (running, crashed, ...)."""
    return {str(name).rsplit(".", 1)[-1]: str(getattr(agent, "state", "unknown"))
            for name, agent in list(app.agents.items())}


def committed_offset(consumer: Any, tp: Any) -> int | None:
    """The offset faust last committed for ``tp`` (None: none yet, or no consumer state).
    faust (0.15) keeps it in the private ``Consumer._committed_offset``; this and
    :func:`read_offsets` are the only readers of the consumer's private offset maps."""
    committed = getattr(consumer, "_committed_offset", None)
    return None if committed is None else committed.get(tp)


def read_offsets(app: Any, topics: tuple[str, ...]) -> dict[tuple[str, int], int]:
    """The last offset the worker's consumer read per input partition (faust keeps it
    for its commits). Called from the watchdog thread: a copy, and nothing on failure
    (no consumer yet, or one being rebuilt in a rebalance)."""
    try:
        offsets = list(app.consumer._read_offset.items())
    except (AttributeError, RuntimeError):
        return {}
    wanted = set(topics)
    return {(tp.topic, tp.partition): int(offset) for tp, offset in offsets
            if offset is not None and tp.topic in wanted}


def consumer_state(app: Any) -> str:
    """faust's view of its partitions and flow (what a stalled worker waits for)."""
    try:
        consumer = app.consumer
        names = {"assigned": consumer.assignment(), "active": consumer._active_partitions,
                 "paused": consumer._paused_partitions,
                 "buffered": consumer._buffered_partitions}
        parts = [f"{k}={sorted(f'{tp.topic}[{tp.partition}]' for tp in v)}"
                 for k, v in names.items()]
        reads = {f"{tp.topic}[{tp.partition}]": off
                 for tp, off in list(consumer._read_offset.items()) if off is not None}
        flow = (f"read_offsets={dict(sorted(reads.items()))} "
                f"flow_active={consumer.flow_active} "
                f"flow_control_active={app.flow_control.is_active()}")
    except Exception as exc:  # a diagnostic must not hide the verdict
        return f"consumer state unavailable: {type(exc).__name__}: {exc}"
    return " ".join([*parts, flow])


def dump_stacks(loop: Any) -> None:
    """Every thread's stack and every pending asyncio task's, to stderr: a stalled worker
    says where it waits before it exits. Called from the watchdog thread, so the task set
    may change under it; a dump that fails says so instead."""
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        print(f"Thread {names.get(ident, ident)} (most recent call last):", file=sys.stderr)
        print("".join(traceback.format_stack(frame, limit=12)), file=sys.stderr)
    try:
        tasks = list(asyncio.all_tasks(loop)) if loop is not None else []
    except RuntimeError as exc:
        print(f"asyncio tasks unavailable: {exc}", file=sys.stderr, flush=True)
        return
    print(f"{len(tasks)} pending asyncio tasks:", file=sys.stderr)
    for task in tasks:
        chain = " <- ".join(reversed(await_chain(task.get_coro())))
        print(f"  {task.get_name()}: {chain}", file=sys.stderr)
    sys.stderr.flush()


def await_chain(coro: Any) -> list[str]:
    """``file:line function`` of each coroutine ``coro`` awaits, outermost first."""
    out: list[str] = []
    while coro is not None and len(out) < 40:
        frame = (getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                 or getattr(coro, "ag_frame", None))
        if frame is not None:
            out.append(f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} "
                       f"{frame.f_code.co_name}")
        coro = (getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
                or getattr(coro, "ag_await", None))
    return out


def act(verdict: Verdict, *, app: Any = None) -> None:
    """Drained: ask faust for a clean stop (status 0), and end the process anyway if that
    stop hangs (everything was committed). Anything else: crash-only, non-zero status,
    after the stacks of every thread and task (:func:`dump_stacks`)."""
    print(verdict.message, flush=True)
    if verdict.state == DRAINED:
        log.info("%s; stopping", verdict.message)
        os.kill(os.getpid(), signal.SIGTERM)
        timer = threading.Timer(STOP_GRACE_S, _hard_exit, args=(0,))
        timer.daemon = True
        timer.start()
        return
    log.error("streams worker stops: %s", verdict.message)
    if app is not None:
        print(consumer_state(app), file=sys.stderr, flush=True)
    dump_stacks(getattr(app, "loop", None))
    _hard_exit(verdict.exit_code or 1)


def _hard_exit(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_monitor(app: Any, topics: StreamTopics, group_id: str, bootstrap: str,
                  watchdog: WatchdogConfig, holding: Callable[[], int] | None = None,
                  dedup_bands: bool = False) -> Monitor:
    """``holding``: how many summaries wait in the dedup table for their turn (the worker
    is not drained while any does, though their offsets are committed)."""
    target = MonitorTarget(kind="streams", name=group_id,
                           topics=input_topics(topics, dedup_bands=dedup_bands),
                           home=flywheel_home())
    monitor = Monitor(target, watchdog, kafka.client_config(bootstrap),
                      on_verdict=lambda verdict: act(verdict, app=app),
                      agents=lambda: agent_states(app),
                      read=lambda: read_offsets(app, target.topics), holding=holding)
    monitor.start()
    return monitor
