"""The benchmarks' CPU readings by thread kind (tests/support/process_cpu.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from tests.support.process_cpu import (
    THREAD_KINDS,
    CpuSampler,
    cpu_seconds,
    thread_cpu,
    thread_kind,
)


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_threads_are_told_apart_by_id_and_name() -> None:
    assert thread_kind(10, 10, "python", "python") == "event_loop"
    assert thread_kind(10, 11, "python", "python") == "python_threads"
    assert thread_kind(10, 12, "rdk:broker1", "python") == "librdkafka"
    assert thread_kind(10, 13, "rocksdb:high", "python") == "rocksdb"
    assert thread_kind(10, 14, "jemalloc_bg", "python") == "other"


def _comm(pid: int, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()


def test_a_busy_thread_shows_under_its_kind() -> None:
    pid, burnt, done, tids = os.getpid(), threading.Event(), threading.Event(), []

    def busy() -> None:
        tids.append(threading.get_native_id())
        _burn(0.2)
        burnt.set()
        done.wait()  # alive while it is read

    before = thread_cpu([pid])
    worker = threading.Thread(target=busy)
    worker.start()
    try:
        assert burnt.wait(30)
        after = thread_cpu([pid])
        # a Python thread keeps the name of the thread that started it (the process's,
        # unless something renamed that thread): whichever kind that makes, it shows there
        kind = thread_kind(pid, tids[0], _comm(pid, tids[0]), _comm(pid, pid))
    finally:
        done.set()
        worker.join()
    assert set(after) == set(THREAD_KINDS) and kind in ("python_threads", "other")
    grown = {k: after[k] - before[k] for k in THREAD_KINDS}
    assert grown[kind] >= 0.15, (kind, grown)
    assert sum(after.values()) <= cpu_seconds(pid) + 0.02  # ended threads: only the total


def test_the_sampler_answers_the_last_sample_before_a_time() -> None:
    ticks = iter(range(1000))
    sampler = CpuSampler(lambda: next(ticks), interval_s=0.01)
    sampler.start()
    time.sleep(0.1)
    middle = time.time()
    time.sleep(0.05)
    sampler.stop()
    assert sampler.at(0.0) == 0  # before the first sample: the first
    assert 0 < sampler.at(middle) < sampler.at(time.time()) == sampler.samples[-1][1]
