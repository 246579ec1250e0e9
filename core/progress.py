"""Pure liveness arithmetic of the long-running workers: lag, "drained", watchdog.

Invariant 11: "done" means every input partition is drained to lag 0 — the group's
committed offset at the end offset, with the end offsets re-read until two reads
agree — never "quiet for N seconds". Time without a broker is never idle time: it is
*broker* time, bounded by its own timeout. A worker with lag and no progress (its
committed offsets do not move) for the stall timeout exits instead of hanging.

Nothing here talks to Kafka or reads a clock: :class:`Watchdog` is fed observations
with their time (tests inject the clock), and answers a :class:`Verdict`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write_json, make_dirs

TP = tuple[str, int]

RUNNING = "running"
DRAINED = "drained"
STALLED = "stalled"
BROKER_LOST = "broker_lost"
DRAIN_TIMEOUT = "drain_timeout"
# Exit statuses of a watchdog stop (0 only for DRAINED).
EXIT_CODES = {DRAINED: 0, STALLED: 3, BROKER_LOST: 4, DRAIN_TIMEOUT: 5}


def effective_offset(committed: int, low: int) -> int:
    """Where the group resumes: its committed offset, or the log start when it has none
    (the workers read from the earliest offset) or when retention deleted past it."""
    return max(committed, low) if committed >= 0 else low


def partition_lag(ends: Mapping[TP, tuple[int, int]], committed: Mapping[TP, int]) -> dict[TP, int]:
    """Records below the end offset and at or above the resume point, per partition.

    ``ends`` maps each input partition to its (low, high) watermarks; ``committed``
    holds the group's committed offsets (-1 or missing: none)."""
    out: dict[TP, int] = {}
    for tp, (low, high) in ends.items():
        out[tp] = max(0, high - effective_offset(committed.get(tp, -1), low))
    return out


def resume_points(ends: Mapping[TP, tuple[int, int]],
                  committed: Mapping[TP, int]) -> dict[TP, int]:
    return {tp: effective_offset(committed.get(tp, -1), low) for tp, (low, _) in ends.items()}


def drain_complete(previous_ends: Mapping[TP, tuple[int, int]] | None,
                   ends: Mapping[TP, tuple[int, int]], committed: Mapping[TP, int]) -> bool:
    """True when the end offsets did not move since the previous read and every
    partition's lag is 0 (an input with no partitions is never drained: nothing read)."""
    if not ends or previous_ends is None:
        return False
    highs = {tp: high for tp, (_, high) in ends.items()}
    if highs != {tp: high for tp, (_, high) in previous_ends.items()}:
        return False
    return not any(partition_lag(ends, committed).values())


@dataclass(frozen=True, kw_only=True)
class WatchdogConfig:
    """When a worker stops on its own.

    Fields:
        drain: stop (status 0) once the inputs are drained; False runs on.
        stall_timeout_s: lag > 0 and no committed progress for this long: stop (status 3).
        broker_timeout_s: no successful offset read for this long: stop (status 4).
        drain_timeout_s: with ``drain``, lag still > 0 this long after the start: stop
            (status 5); None: no limit (the stall and broker timeouts still apply).
    """

    drain: bool = False
    stall_timeout_s: float = 120.0
    broker_timeout_s: float = 300.0
    drain_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("stall_timeout_s", "broker_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"WatchdogConfig.{name} must be > 0")
        if self.drain_timeout_s is not None and not self.drain_timeout_s > 0:
            raise ConfigError("WatchdogConfig.drain_timeout_s must be > 0 or None")


@dataclass(frozen=True)
class Verdict:
    state: str
    message: str = ""

    @property
    def exit_code(self) -> int | None:
        return EXIT_CODES.get(self.state)


@dataclass
class Watchdog:
    """Decides from offset observations and broker failures, at injected times."""

    config: WatchdogConfig
    started: float
    last_ok: float = field(init=False)
    last_progress: float = field(init=False)
    first: dict[TP, int] | None = field(default=None, init=False)
    resume: dict[TP, int] = field(default_factory=dict, init=False)
    lag: dict[TP, int] = field(default_factory=dict, init=False)
    ends: dict[TP, tuple[int, int]] | None = field(default=None, init=False)
    consumed: dict[TP, int] = field(default_factory=dict, init=False)
    read: dict[TP, int] = field(default_factory=dict, init=False)
    broker_error: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self.last_ok = self.last_progress = self.started

    @property
    def processed(self) -> int:
        """Records committed past the first observation (this run's work)."""
        if self.first is None:
            return 0
        return sum(max(0, o - self.first.get(tp, o)) for tp, o in self.resume.items())

    @property
    def total_lag(self) -> int:
        return sum(self.lag.values())

    def observe(self, now: float, ends: Mapping[TP, tuple[int, int]],
                committed: Mapping[TP, int],
                consumed: Mapping[TP, int] | None = None,
                read: Mapping[TP, int] | None = None, *, holding: int = 0) -> Verdict:
        """One successful read of the end and committed offsets at time ``now``.

        ``holding``: records the worker keeps in its state to finish later although
        their offsets are committed (the streams worker's summaries waiting for their
        turn in decision order); while it holds any, it is not drained.

        ``read`` (the last offset the worker read, per partition) is for workers that
        commit on an interval (the streams worker): a read offset that moved is progress
        too, so a worker busy between commits under load is not declared stalled; unlike
        ``consumed``, having read everything does not excuse commits that never come.

        ``consumed`` (next offset the worker will read, per partition) is for workers
        that hold consumed records uncommitted on purpose (the replay worker's open
        block waits for an epoch boundary): reading is progress too, and everything
        consumed with only commits outstanding is not a stall."""
        resume = resume_points(ends, committed)
        if self.first is None:
            self.first = dict(resume)
        if self.resume and any(o > self.resume.get(tp, -1) for tp, o in resume.items()):
            self.last_progress = now
        if consumed is not None:
            if any(o > self.consumed.get(tp, -1) for tp, o in consumed.items()):
                self.last_progress = now
            self.consumed = dict(consumed)
        if read is not None:
            if any(o > self.read.get(tp, -1) for tp, o in read.items()):
                self.last_progress = now
            self.read = dict(read)
        # Two reads in a row at lag 0 with the same end offsets (an output written by
        # a hop between the two reads moves the next hop's end offset).
        done = drain_complete(self.ends, ends, committed) and self.ends is not None \
            and not any(partition_lag(self.ends, self.resume).values()) and not holding
        self.resume, self.ends = resume, dict(ends)
        self.lag = partition_lag(ends, committed)
        self.last_ok, self.broker_error = now, ""
        if not self.total_lag or (consumed is not None
                                  and not any(partition_lag(ends, consumed).values())):
            self.last_progress = now  # caught up (or only commits wait): not a stall
        if self.config.drain and done:
            return Verdict(DRAINED, f"drained: processed {self.processed} records, "
                                    "final lag 0")
        return self._timeouts(now)

    def broker_failed(self, now: float, error: str) -> Verdict:
        """A failed offset read at ``now``; the broker's absence is never idle time."""
        self.broker_error = error
        if now - self.last_ok > self.config.broker_timeout_s:
            return Verdict(BROKER_LOST, f"broker unreachable for {now - self.last_ok:.0f}s "
                                        f"(> --broker-timeout-s "
                                        f"{self.config.broker_timeout_s:g}): {error}")
        return Verdict(RUNNING)

    def _timeouts(self, now: float) -> Verdict:
        c = self.config
        if self.total_lag and now - self.last_progress > c.stall_timeout_s:
            return Verdict(STALLED, f"stalled: lag {self.total_lag} and no committed "
                                    f"progress for {now - self.last_progress:.0f}s "
                                    f"(> --stall-timeout-s {c.stall_timeout_s:g}); "
                                    f"lag by partition {self.lag_text()}")
        if c.drain and c.drain_timeout_s is not None and self.total_lag \
                and now - self.started > c.drain_timeout_s:
            return Verdict(DRAIN_TIMEOUT, f"not drained after {now - self.started:.0f}s "
                                          f"(--drain-timeout-s {c.drain_timeout_s:g}): "
                                          f"lag {self.total_lag}: {self.lag_text()}")
        return Verdict(RUNNING)

    def lag_text(self) -> str:
        return ", ".join(f"{t}[{p}]={n}" for (t, p), n in sorted(self.lag.items()) if n) or "0"

    def health(self, now_wall: float, now: float, *, kind: str, name: str, pid: int,
               agents: Mapping[str, str] | None = None,
               dropped: Mapping[str, int] | None = None) -> dict[str, Any]:
        """The health record of a worker (written by :func:`write_health`); ``dropped``:
        windows dropped by the content policy, by reason (replay workers)."""
        return {
            **({} if dropped is None else {"policy_dropped": dict(sorted(dropped.items()))}),
            "kind": kind, "name": name, "pid": pid, "written_at": now_wall,
            "last_progress_at": now_wall - (now - self.last_progress),
            "last_broker_ok_at": now_wall - (now - self.last_ok),
            "broker_error": self.broker_error, "processed": self.processed,
            "lag": self.total_lag,
            "lag_by_partition": {f"{t}[{p}]": n for (t, p), n in sorted(self.lag.items())},
            "agents": dict(agents or {}),
        }


def health_path(home: Path, kind: str, name: str) -> Path:
    return home / "health" / f"{kind}-{name}.json"


def write_health(home: Path, record: Mapping[str, Any]) -> Path:
    path = health_path(home, str(record["kind"]), str(record["name"]))
    make_dirs(path.parent)
    atomic_write_json(path, dict(record))
    return path


def read_health(home: Path, kind: str) -> list[dict[str, Any]]:
    """Every health record of ``kind`` workers under ``home`` (unreadable ones skipped)."""
    out = []
    for path in sorted((home / "health").glob(f"{kind}-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def format_health(record: Mapping[str, Any], now_wall: float, *, alive: bool) -> str:
    """One line: name, pid (and whether it runs), lag, processed, progress age, agents."""
    agents = record.get("agents") or {}
    bad = {a: s for a, s in agents.items() if s != "running"}
    return (f"{record['name']} pid={record['pid']} {'up' if alive else 'DOWN'} "
            f"lag={record['lag']} processed={record['processed']} "
            f"progress={now_wall - record['last_progress_at']:.0f}s-ago "
            f"broker={'ok' if not record.get('broker_error') else 'ERROR'} "
            f"agents={len(agents) - len(bad)}/{len(agents)} running"
            + (f" ({', '.join(f'{a}={s}' for a, s in sorted(bad.items()))})" if bad else "")
            + _dropped(record.get("policy_dropped")))


def _dropped(counts: Mapping[str, int] | None) -> str:
    """`` policy_dropped=N (reason=n, ...)`` for a replay worker's health line."""
    if counts is None:
        return ""
    detail = ", ".join(f"{r}={n}" for r, n in sorted(counts.items()))
    return f" policy_dropped={sum(counts.values())}" + (f" ({detail})" if detail else "")
