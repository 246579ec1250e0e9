"""Hostile capture records against the real broker: each is quarantined within the
quarantine topic's size, the valid thread after them is windowed, nothing vanishes."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams import limits
from hebrus_flywheel.streams.processors.accounting import account
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.topics import catalogue
from tests.support.streams_harness import (
    WorkerProcess,
    expected_pipeline,
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
    encode_message,
    identity_message,
    make_identity,
    thread_messages,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDENTITY = make_identity(layers=8, experts=64, top_k=4)
FLAGS = {"validation_fraction": 0.0, "runtime_holdout_fraction": 0.0, "stress_rate": 0.0}
BIG = 900_000


def test_oversized_owner_and_key_are_quarantined_and_the_valid_thread_is_windowed(
    topic_factory: Any, tmp_path: Path
) -> None:
    prefix = f"{topic_factory.prefix}hostile{uuid.uuid4().hex[:6]}."
    topic_factory.create(catalogue(prefix))
    topics = StreamTopics.from_prefix(prefix, "flywheel-streams")
    clock = ProducerClock()
    valid = [identity_message(IDENTITY),
             *thread_messages(ThreadSpec(owner="ok", thread="t1"), IDENTITY, clock)]
    obs = copy.deepcopy(next(m for m in valid if m[0] == "observations"))
    big_owner = {**obs[2], "owner": "o" * BIG, "counter": clock.next()}
    big_key = {**obs[2], "counter": clock.next()}
    worker = WorkerProcess(bootstrap=topic_factory.bootstrap, prefix=prefix,
                           app_id="flywheel-streams", log_path=tmp_path / "worker.log",
                           flags=FLAGS, home=tmp_path / "home").start()
    prod = producer(topic_factory.bootstrap)
    try:
        produce(prod, topics, valid[:1])
        for key, record in ((b"o/t1", big_owner),
                            (b"k" * BIG, big_key)):
            value, headers = encode_message("observations", record)
            prod.produce(topics.observations, key=key, value=value, headers=list(headers))
        prod.flush(30)
        produce(prod, topics, valid[1:])
        expected = window_pairs(expected_pipeline(valid, worker_processor_config(FLAGS)).windows)
        assert expected
        wait_until(lambda: window_pairs(read_windows(topic_factory.bootstrap, topics))
                   >= expected, timeout_s=120, what="windows of the valid thread")
        wait_until(lambda: len(list(read_topic(topic_factory.bootstrap, topics.quarantine))) >= 2,
                   timeout_s=60, what="two quarantine records")
        assert worker.alive(), worker.log_path.read_text(errors="replace")[-3000:]
    finally:
        worker.stop()
    messages = list(read_topic(topic_factory.bootstrap, topics.quarantine))
    records = [codec.decode(m.value() or b"")[1] for m in messages]
    assert sorted(r["reason"] for r in records) == ["field_too_long", "invalid_key"]
    for m in messages:
        assert len(m.value()) + len(m.key() or b"") < limits.QUARANTINE_MAX_MESSAGE_BYTES
    by_reason = {r["reason"]: r for r in records}
    assert by_reason["field_too_long"]["owner"] == "o" * 256
    assert any(c["field"] == "source_key" and c["size"] == BIG
               for c in by_reason["invalid_key"]["cuts"])
    print("quarantine record sizes:", sorted(len(m.value()) for m in messages))
    totals = account(topic_factory.bootstrap, prefix=prefix, app_id="flywheel-streams")["totals"]
    print("accounting:", totals)
    assert totals["records"] == len(valid) + 2 and totals["unaccounted"] == 0, totals
    assert totals["quarantined"] == 2 and totals["identity"] == 1
