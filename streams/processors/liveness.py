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

import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.liveness import Monitor, MonitorTarget
from hebrus_flywheel.core.progress import DRAINED, Verdict, WatchdogConfig
from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.streams.processors.topology import StreamTopics

log = logging.getLogger(__name__)
STOP_GRACE_S = 60.0


def input_topics(topics: StreamTopics) -> tuple[str, ...]:
    return (topics.transcripts, topics.observations, topics.identities, topics.threads,
            topics.decisions)


def agent_states(app: Any) -> Mapping[str, str]:
    """``name -> mode service state`` of every faust agent (running, crashed, ...)."""
    return {str(name).rsplit(".", 1)[-1]: str(getattr(agent, "state", "unknown"))
            for name, agent in list(app.agents.items())}


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


def act(verdict: Verdict) -> None:
    """Drained: ask faust for a clean stop (status 0), and end the process anyway if that
    stop hangs (everything was committed). Anything else: crash-only, non-zero status."""
    print(verdict.message, flush=True)
    if verdict.state == DRAINED:
        log.info("%s; stopping", verdict.message)
        os.kill(os.getpid(), signal.SIGTERM)
        timer = threading.Timer(STOP_GRACE_S, _hard_exit, args=(0,))
        timer.daemon = True
        timer.start()
        return
    log.error("streams worker stops: %s", verdict.message)
    _hard_exit(verdict.exit_code or 1)


def _hard_exit(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_monitor(app: Any, topics: StreamTopics, group_id: str, bootstrap: str,
                  watchdog: WatchdogConfig) -> Monitor:
    target = MonitorTarget(kind="streams", name=group_id, topics=input_topics(topics),
                           home=flywheel_home())
    monitor = Monitor(target, watchdog, kafka.client_config(bootstrap), on_verdict=act,
                      agents=lambda: agent_states(app),
                      read=lambda: read_offsets(app, target.topics))
    monitor.start()
    return monitor
