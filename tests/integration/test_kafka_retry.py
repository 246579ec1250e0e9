"""core.kafka against the real broker: coordinator-not-ready is retried (or given up on
with a project error), reads that cannot reach their end raise, deliveries are checked.

The only thing injected is the error: a wrapper around a REAL consumer makes its first N
``committed()`` / ``get_watermark_offsets()`` calls fail with NOT_COORDINATOR, as a fresh
broker does while its group coordinator loads, then delegates to the broker.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from hebrus_flywheel.core import kafka

pytestmark = pytest.mark.integration


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


class CoordinatorNotReady:
    """A real consumer whose first ``failures`` calls of ``methods`` raise NOT_COORDINATOR."""

    def __init__(self, real: Any, failures: int,
                 methods: tuple[str, ...] = ("committed", "get_watermark_offsets")) -> None:
        self.real, self.left, self.methods, self.calls = real, failures, methods, 0

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.real, name)
        if name not in self.methods:
            return target

        def flaky(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.left > 0:
                self.left -= 1
                raise KafkaException(KafkaError(KafkaError.NOT_COORDINATOR))
            return target(*args, **kwargs)

        return flaky


def policy(attempts: int, sleeps: Sleeps) -> kafka.RetryPolicy:
    return kafka.RetryPolicy(attempts=attempts, backoff_s=0.01, multiplier=2.0, sleep=sleeps)


@pytest.fixture(scope="module")
def seeded(kafka_bootstrap: str, topic_factory: Any) -> tuple[str, str]:
    """A topic with 5 records and a group that committed offset 3 on it."""
    topic = topic_factory("retry", partitions=1)
    config = kafka.client_config(kafka_bootstrap)
    producer = kafka.CheckedProducer(config)
    for i in range(5):
        producer.produce(topic, f"v{i}".encode(), key=b"k")
    producer.flush(30, what="seed records")
    group = f"t-retry-{uuid.uuid4().hex[:8]}"
    committer = kafka.make_consumer(config, group_id=group)
    try:
        committer.commit(offsets=[TopicPartition(topic, 0, 3)], asynchronous=False)
    finally:
        committer.close()
    return topic, group


def test_committed_is_retried_until_the_coordinator_answers(kafka_bootstrap: str,
                                                            seeded: tuple[str, str]) -> None:
    topic, group = seeded
    sleeps = Sleeps()
    config = kafka.client_config(kafka_bootstrap)
    real = kafka.make_consumer(config, group_id=group)
    try:
        flaky = CoordinatorNotReady(real, failures=3)
        got = kafka.committed(flaky, [(topic, 0)], retry=policy(5, sleeps), timeout_s=15,
                              group_id=group)
    finally:
        real.close()
    assert got == {(topic, 0): 3}
    assert flaky.calls == 4 and sleeps == [0.01, 0.02, 0.04]


def test_committed_gives_up_after_the_policy_attempts(kafka_bootstrap: str,
                                                      seeded: tuple[str, str]) -> None:
    topic, group = seeded
    sleeps = Sleeps()
    real = kafka.make_consumer(kafka.client_config(kafka_bootstrap), group_id=group)
    try:
        flaky = CoordinatorNotReady(real, failures=10)
        with pytest.raises(kafka.KafkaRetryError, match=r"3 times.*NOT_COORDINATOR"):
            kafka.committed(flaky, [(topic, 0)], retry=policy(3, sleeps), timeout_s=15,
                            group_id=group)
    finally:
        real.close()
    assert flaky.calls == 3 and sleeps == [0.01, 0.02]


def test_end_offsets_are_retried_too(kafka_bootstrap: str, seeded: tuple[str, str]) -> None:
    topic, _ = seeded
    sleeps = Sleeps()
    real = kafka.make_consumer(kafka.client_config(kafka_bootstrap))
    try:
        flaky = CoordinatorNotReady(real, failures=2)
        marks = kafka.watermarks(flaky, [topic], retry=policy(4, sleeps), timeout_s=15)
    finally:
        real.close()
    assert marks == {(topic, 0): (0, 5)} and sleeps == [0.01, 0.02]


def test_read_to_end_reads_everything(kafka_bootstrap: str, seeded: tuple[str, str]) -> None:
    topic, _ = seeded
    values = [m.value() for m in kafka.read_to_end(kafka.client_config(kafka_bootstrap), [topic])]
    assert values == [f"v{i}".encode() for i in range(5)]


def test_a_read_that_cannot_reach_its_end_raises(kafka_bootstrap: str,
                                                 seeded: tuple[str, str]) -> None:
    topic, _ = seeded
    seen = []
    with pytest.raises(kafka.ReadIncompleteError, match=rf"{topic}\[0\] at 5 of end 9"):
        for msg in kafka.read_ranges(kafka.client_config(kafka_bootstrap),
                                     {(topic, 0): (0, 9)}, timeout_s=3):
            seen.append(msg.offset())
    assert seen == [0, 1, 2, 3, 4]  # what was there, then an error: never a quiet return


def test_refused_deliveries_are_listed(kafka_bootstrap: str, topic_factory: Any) -> None:
    topic = topic_factory("small", partitions=1, configs={"max.message.bytes": "1024"})
    producer = kafka.CheckedProducer(kafka.client_config(kafka_bootstrap))
    producer.produce(topic, b"x" * 10_000, key=b"big")
    with pytest.raises(kafka.DeliveryError, match=rf"1 failed: {topic}.*MSG_SIZE_TOO_LARGE"):
        producer.flush(30, what="oversized records")
