"""The watchdog thread of a long-running worker: lag, health file, stop decisions.

:class:`Monitor` reads the group's end and committed offsets every ``interval_s`` on its
own thread (so a stuck event loop or a blocked poll cannot silence it), feeds them to a
:class:`~hebrus_flywheel.core.progress.Watchdog`, writes the health file under
``$FLYWHEEL_HOME/health/`` and hands every non-running verdict to ``on_verdict``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.progress import (
    RUNNING,
    Verdict,
    Watchdog,
    WatchdogConfig,
    health_path,
    write_health,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MonitorTarget:
    """What one monitor watches and where it reports."""

    kind: str  # "streams" | "replay"
    name: str  # the group id
    topics: tuple[str, ...]
    home: Path
    interval_s: float = 1.0


class Monitor(threading.Thread):
    """Daemon thread: observe, write health, report verdicts (once)."""

    def __init__(self, target: MonitorTarget, watchdog: WatchdogConfig,
                 client: kafka.KafkaClientConfig, *, on_verdict: Callable[[Verdict], None],
                 agents: Callable[[], Mapping[str, str]] | None = None,
                 consumed: Callable[[], Mapping[tuple[str, int], int]] | None = None,
                 read: Callable[[], Mapping[tuple[str, int], int]] | None = None,
                 dropped: Callable[[], Mapping[str, int]] | None = None,
                 holding: Callable[[], int] | None = None) -> None:
        super().__init__(name=f"{target.kind}-watchdog", daemon=True)
        self.target, self.client = target, client
        self.watchdog = Watchdog(watchdog, started=time.monotonic())
        self.on_verdict, self.agents, self.consumed = on_verdict, agents, consumed
        self.dropped, self.read, self.holding = dropped, read, holding
        self._stop_event = threading.Event()
        self._probe: kafka.LagProbe | None = None

    def stop(self) -> None:
        self._stop_event.set()

    def remove_health(self, timeout_s: float = 30.0) -> bool:
        """Stop, wait for the thread, delete the health file: a clean exit leaves no
        record to go stale. False (file kept) if the thread did not end in time."""
        self.stop()
        if self.is_alive():
            self.join(timeout_s)
        if self.is_alive():
            return False
        health_path(self.target.home, self.target.kind, self.target.name).unlink(missing_ok=True)
        return True

    def run(self) -> None:
        while not self._stop_event.is_set():
            verdict = self.step()
            if verdict.state != RUNNING:
                self.on_verdict(verdict)
                return
            self._stop_event.wait(self.target.interval_s)

    def step(self) -> Verdict:
        """One observation: read the offsets (or note the failure), write the health."""
        try:
            if self._probe is None:
                self._probe = kafka.LagProbe(self.client, self.target.name, self.target.topics,
                                             log_name=f"{self.target.kind}.watchdog")
            ends, committed = self._probe.read()
            consumed = dict(self.consumed()) if self.consumed is not None else None
            read = dict(self.read()) if self.read is not None else None
            held = self.holding() if self.holding is not None else 0
            verdict = self.watchdog.observe(time.monotonic(), ends, committed, consumed, read,
                                            holding=held)
        except kafka.KafkaIOError as exc:
            verdict = self.watchdog.broker_failed(time.monotonic(), str(exc)[:300])
        self.write_health()
        return verdict

    def write_health(self) -> None:
        agents = dict(self.agents()) if self.agents is not None else {}
        record = self.watchdog.health(time.time(), time.monotonic(), kind=self.target.kind,
                                      name=self.target.name, pid=os.getpid(), agents=agents,
                                      dropped=None if self.dropped is None else self.dropped())
        try:
            write_health(self.target.home, record)
        except OSError as exc:
            log.warning("cannot write the health file: %s", exc)
