"""``streams worker --dedup-bands`` on the real broker: band-partitioned dedup spreads over
two workers, survives a kill -9, and writes exactly the windows of the in-process chain
(which decides on one partition) from traffic with exact duplicates; ``rebuild
--from-capture`` regenerates those windows from the capture topics."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.consumers.capture_check import regenerate
from hebrus_flywheel.consumers.epochs import offsets_json
from hebrus_flywheel.consumers.kafka_io import end_offsets
from hebrus_flywheel.streams.processors.runs import group_members, read_runs
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.topics import STREAMS_RUNS_TOPIC
from tests.support.streams_harness import (
    WorkerProcess,
    expected_pipeline,
    last_logged,
    produce,
    producer,
    read_windows,
    wait_until,
    window_pairs,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    ThreadSpec,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDENTITY = make_identity(layers=8, experts=64, top_k=4)
FLAGS = {"validation_fraction": 0.3, "runtime_holdout_fraction": 0.3, "stress_rate": 0.0}
APP_ID = "flywheel-streams"


def messages_with_copies(n_threads: int, copies: int, seed: int) -> list[Any]:
    """Capture records of ``n_threads`` threads, ``copies`` of them exact copies (tokens
    and routes) of an earlier thread under another owner and thread id."""
    specs = random_specs(n_threads, n_owners=7, seed=seed, assistant_tokens=24)
    for n in range(copies):
        j = 3 * n + 2
        specs[j] = ThreadSpec(**{**specs[j - 2].__dict__, "owner": specs[j].owner,
                                 "thread": specs[j].thread, "start_ms": specs[j].start_ms})
    clock = ProducerClock(producer_id=f"runtime-{seed}")
    messages = [identity_message(IDENTITY)]
    for spec in specs:
        messages.extend(thread_messages(spec, IDENTITY, clock))
    return messages


def counters(worker: WorkerProcess) -> dict[str, int]:
    return last_logged(worker.log_path, "streams counters ")


def regenerated_pairs(bootstrap: str, prefix: str, topics: StreamTopics) -> set[tuple[str, str]]:
    """``(window_id, content_digest)`` of what ``rebuild --from-capture`` regenerates from
    every capture record so far, with the streams runs the seal would record."""
    runs = read_runs(bootstrap, prefix + STREAMS_RUNS_TOPIC)
    end = end_offsets(bootstrap, [topics.transcripts, topics.observations, topics.identities])
    fresh = regenerate(bootstrap, prefix, {"end": offsets_json(end),
                                           "streams_runs": [r.to_json() for r in runs]})
    return {(w["window_id"], w["content_digest"]) for w in fresh.windows.values()}


def band_worker(topic_factory: Any, prefix: str, tmp: Path, tag: str) -> WorkerProcess:
    return WorkerProcess(bootstrap=topic_factory.bootstrap, prefix=prefix, app_id=APP_ID,
                         log_path=tmp / f"worker-{tag}.log", flags=FLAGS,
                         home=tmp / f"home-{tag[0]}", extra=["--dedup-bands"])


def test_two_band_partitioned_workers_write_the_one_partition_windows(
    topic_factory: Any, tmp_path: Path
) -> None:
    prefix, topics = topic_factory.streams_namespace(f"bands{uuid.uuid4().hex[:6]}", APP_ID)
    messages = messages_with_copies(30, copies=8, seed=5)
    reference = expected_pipeline(messages, worker_processor_config(FLAGS))
    expected = window_pairs(reference.windows)
    decided = reference.counters.stage("dedup")
    assert sum(decided.values()) - decided["unique"] == 8, decided  # exact or cross-split
    workers = [band_worker(topic_factory, prefix, tmp_path, tag).start() for tag in "ab"]
    bootstrap = topic_factory.bootstrap
    try:
        wait_until(lambda: group_members(bootstrap, prefix + APP_ID) >= 2, timeout_s=120,
                   interval_s=0.5, what="both workers in the group")
        produce(producer(bootstrap), topics, messages)
        wait_until(lambda: window_pairs(read_windows(bootstrap, topics)) >= expected,
                   timeout_s=180, what="all expected windows")
        time.sleep(2.5)  # the counters logged after the last decision
    finally:
        for w in workers:
            w.stop()
    assert window_pairs(read_windows(bootstrap, topics)) == expected
    assert regenerated_pairs(bootstrap, prefix, topics) == expected
    seen = [counters(w) for w in workers]
    for reason, n in decided.items():  # the same decisions, by reason
        assert sum(c.get(f"dedup/{reason}", 0) for c in seen) == n, (reason, seen)
    # the band and home partitions spread over both workers: each did some of the work
    assert all(c.get("cpu/bands_us", 0) > 0 and c.get("cpu/dedup_us", 0) > 0 for c in seen)
    held = {p.name for p in (tmp_path / "home-a").glob("streams/*/v1/tables/*.db")}
    assert {"dedup-bands-0.db", "dedup-homes-0.db"} <= held and not any(
        name.startswith("dedup-state") for name in held), held


def test_a_killed_band_partitioned_worker_resumes_from_its_tables(
    topic_factory: Any, tmp_path: Path
) -> None:
    prefix, topics = topic_factory.streams_namespace(f"bandk{uuid.uuid4().hex[:6]}", APP_ID)
    messages = messages_with_copies(24, copies=6, seed=6)
    expected = window_pairs(expected_pipeline(messages, worker_processor_config(FLAGS)).windows)
    bootstrap = topic_factory.bootstrap
    prod = producer(bootstrap)
    half = len(messages) // 2
    worker = band_worker(topic_factory, prefix, tmp_path, "k0").start()
    try:
        produce(prod, topics, messages[:half])
        wait_until(lambda: len(read_windows(bootstrap, topics)) >= 2, timeout_s=180,
                   interval_s=0.5, what="the first windows")
        worker.kill()  # kill -9 mid-stream: tables restore from RocksDB and the changelog
        produce(prod, topics, messages[half:])
        worker = band_worker(topic_factory, prefix, tmp_path, "k1").start()
        wait_until(lambda: window_pairs(read_windows(bootstrap, topics)) >= expected,
                   timeout_s=180, what="all expected windows")
    finally:
        worker.stop()
    windows = read_windows(bootstrap, topics)
    assert window_pairs(windows) == expected  # repeats allowed, each byte-identical
    assert regenerated_pairs(bootstrap, prefix, topics) == expected  # over both runs
