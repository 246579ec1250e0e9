"""CPU seconds of processes and of their threads by kind, from ``/proc`` (Linux).

The benchmarks time stream workers on a machine they share with the broker, so they
read what each process actually ran, not wall time. :func:`thread_cpu` splits a worker's
CPU by thread kind, which says where a second worker's extra CPU lands:

* ``event_loop``: the process's main thread (a stream worker's faust event loop: its
  agents, table writes, the standby's changelog apply);
* ``python_threads``: its other threads that kept the process's name, as Python's do
  (faust's consumer thread running aiokafka, which also fetches the standby's
  changelogs; the liveness monitor);
* ``librdkafka``: librdkafka's own threads (``rdk:*``: the capture fetch, TLS);
* ``rocksdb``: RocksDB's background threads (``rocksdb:*``: flushes, compactions);
* ``other``: any other named thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

THREAD_KINDS = ("event_loop", "python_threads", "librdkafka", "rocksdb", "other")
_PREFIXES = (("rdk:", "librdkafka"), ("rocksdb:", "rocksdb"))
T = TypeVar("T")


def _stat_cpu(stat: str) -> tuple[str, float]:
    """(the thread's name, its user + system CPU seconds) of a ``/proc/.../stat`` line."""
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (``/proc/<pid>/stat``)."""
    return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())[1]


def total_cpu(pids: list[int]) -> float:
    """:func:`cpu_seconds` summed over processes."""
    return sum(cpu_seconds(pid) for pid in pids)


def thread_kind(pid: int, tid: int, name: str, process_name: str) -> str:
    """The kind (:data:`THREAD_KINDS`) of thread ``tid`` named ``name`` in process ``pid``
    named ``process_name``."""
    if tid == pid:
        return "event_loop"
    for prefix, kind in _PREFIXES:
        if name.startswith(prefix):
            return kind
    return "python_threads" if name == process_name else "other"


def thread_cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds of the processes' live threads, summed by kind (every kind present).
    A thread that ended since the last read is no longer counted: compare two reads of
    long-lived threads only (a worker's threads live as long as it does)."""
    kinds = dict.fromkeys(THREAD_KINDS, 0.0)
    for pid in pids:
        process_name = _stat_cpu(Path(f"/proc/{pid}/stat").read_text())[0]
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                name, cpu = _stat_cpu((task / "stat").read_text())
            except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
                continue
            kinds[thread_kind(pid, int(task.name), name, process_name)] += cpu
    return kinds


class CpuSampler(threading.Thread, Generic[T]):
    """What ``read()`` returns (CPU seconds, a number or a dict of numbers), sampled every
    ``interval_s`` in the background; :meth:`at` gives the last sample taken at or
    before a time."""

    def __init__(self, read: Callable[[], T], interval_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.read, self.interval_s = read, interval_s
        self.samples = [(time.time(), read())]
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.samples.append((time.time(), self.read()))

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.samples.append((time.time(), self.read()))

    def at(self, when: float) -> T:
        before = [sample for t, sample in self.samples if t <= when]
        return before[-1] if before else self.samples[0][1]
