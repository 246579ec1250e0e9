"""The benchmarks' CPU readings by thread kind (tests/support/process_cpu.py)."""

from __future__ import annotations

import os
import threading
import time

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


def test_a_busy_thread_shows_under_its_kind() -> None:
    pid = os.getpid()
    before = thread_cpu([pid])
    worker = threading.Thread(target=_burn, args=(0.3,))
    worker.start()
    _burn(0.1)
    after = thread_cpu([pid])  # the busy thread is still alive: it is read
    worker.join()
    assert set(after) == set(THREAD_KINDS)
    grown = {kind: after[kind] - before[kind] for kind in THREAD_KINDS}
    assert grown["event_loop"] >= 0.05 and grown["python_threads"] >= 0.05, grown
    assert grown["librdkafka"] == grown["rocksdb"] == 0.0, grown
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
