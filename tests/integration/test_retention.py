"""Retention per topic class against the real broker: applied at creation, operator changes
accepted at startup, guarantee-breaking changes refused, and rebuild refusing partitions
whose first records retention removed."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource
from typer.testing import CliRunner

from hebrus_flywheel.consumers.exceptions import RebuildError
from hebrus_flywheel.consumers.kafka_io import low_offsets
from hebrus_flywheel.consumers.rebuild import check_retained
from hebrus_flywheel.core import kafka
from hebrus_flywheel.streams.cli import topics_app
from hebrus_flywheel.streams.exceptions import TopicError
from hebrus_flywheel.streams.processors.topology import StreamTopics, ensure_topics
from hebrus_flywheel.streams.retention import DAY_MS, HOUR_MS, RetentionPolicy
from hebrus_flywheel.streams.topics import (
    CONTROL_TOPIC,
    IDENTITIES_TOPIC,
    QUARANTINE_TOPIC,
    TRANSCRIPTS_TOPIC,
    catalogue,
    compare_topics,
    create_topics,
    describe_topics,
    window_topic,
)

pytestmark = pytest.mark.integration


def _alter(bootstrap: str, topic: str, key: str, value: str) -> None:
    admin = kafka.make_admin(kafka.client_config(bootstrap))
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[
        ConfigEntry(key, value, incremental_operation=AlterConfigOpType.SET)])
    for fut in admin.incremental_alter_configs([resource]).values():
        fut.result(timeout=30)
    deadline = time.monotonic() + 30  # the broker applies it through its metadata log
    while describe_topics(bootstrap, [topic])[topic].configs.get(key) != value:
        assert time.monotonic() < deadline, f"{topic} never showed {key}={value}"
        time.sleep(0.2)


def _retention(bootstrap: str, names: list[str]) -> dict[str, str]:
    infos = describe_topics(bootstrap, names)
    return {n: infos[n].configs["retention.ms"] for n in names}


def test_policy_at_creation_and_operator_retention_accepted(kafka_bootstrap: str,
                                                            topic_factory) -> None:
    prefix = topic_factory.prefix + "policy."
    policy = RetentionPolicy(capture_ms=3 * DAY_MS, quarantine_ms=12 * HOUR_MS)
    topic_factory.create(catalogue(prefix, policy))
    transcripts, window = prefix + TRANSCRIPTS_TOPIC, prefix + window_topic("train")
    assert _retention(kafka_bootstrap, [transcripts, prefix + QUARANTINE_TOPIC, window,
                                        prefix + CONTROL_TOPIC]) == {
        transcripts: str(3 * DAY_MS), prefix + QUARANTINE_TOPIC: str(12 * HOUR_MS),
        window: str(7 * DAY_MS), prefix + CONTROL_TOPIC: "-1"}
    identities = describe_topics(kafka_bootstrap, [prefix + IDENTITIES_TOPIC])
    assert identities[prefix + IDENTITIES_TOPIC].configs["cleanup.policy"] == "compact"

    _alter(kafka_bootstrap, transcripts, "retention.ms", str(30 * DAY_MS))
    topics = StreamTopics.from_prefix(prefix)
    topic_factory.track([topics.threads, topics.decisions, topics.ticks, topics.crashes])
    assert ensure_topics(kafka_bootstrap, topics) == 4  # worker startup accepts it
    check = compare_topics(kafka_bootstrap, catalogue(prefix))  # against the defaults
    assert check.problems == []
    assert f"{transcripts}: effective retention.ms={30 * DAY_MS} (set on the broker; the " \
           f"policy default is {7 * DAY_MS})" in check.notes
    assert _retention(kafka_bootstrap, [topics.threads, topics.ticks]) == {
        topics.threads: str(7 * DAY_MS), topics.ticks: str(HOUR_MS)}


def test_guarantee_breaking_changes_fail_startup(kafka_bootstrap: str, topic_factory) -> None:
    prefix = topic_factory.prefix + "broken."
    specs = catalogue(prefix, RetentionPolicy())
    topic_factory.create(specs)
    _alter(kafka_bootstrap, prefix + window_topic("validation"), "retention.ms", "60000")
    with pytest.raises(TopicError, match="under the minimum 3600000 for windows topics"):
        create_topics(kafka_bootstrap, specs)
    _alter(kafka_bootstrap, prefix + window_topic("validation"), "retention.ms", "-1")
    assert create_topics(kafka_bootstrap, specs) == {s.name: "exists" for s in specs}
    _alter(kafka_bootstrap, prefix + IDENTITIES_TOPIC, "cleanup.policy", "delete")
    with pytest.raises(TopicError, match=r"cleanup\.policy=delete, catalogue wants compact"):
        ensure_topics(kafka_bootstrap, StreamTopics.from_prefix(prefix))


def test_topics_create_cli_sets_and_reports_retention(kafka_bootstrap: str,
                                                      topic_factory) -> None:
    prefix = topic_factory.prefix + "cli."
    topic_factory.track(s.name for s in catalogue(prefix))
    first = CliRunner().invoke(topics_app, ["create", "-b", kafka_bootstrap, "--prefix", prefix,
                                            "--retention", "capture=2d"])
    assert first.exit_code == 0, first.output
    assert "retention: capture=2d, windows=7d, quarantine=1d" in first.output
    assert f"created  {prefix}{TRANSCRIPTS_TOPIC}" in first.output
    again = CliRunner().invoke(topics_app, ["create", "-b", kafka_bootstrap, "--prefix", prefix])
    assert again.exit_code == 0, again.output
    assert (f"note: {prefix}{TRANSCRIPTS_TOPIC}: effective retention.ms={2 * DAY_MS}"
            in again.output)
    bad = CliRunner().invoke(topics_app, ["create", "-b", kafka_bootstrap, "--prefix", prefix,
                                          "--retention", "windows=5m"])
    assert bad.exit_code == 2
    assert "RetentionPolicy.windows_ms must be at least 1h" in bad.output


def test_rebuild_refuses_partitions_retention_emptied(kafka_bootstrap: str,
                                                      topic_factory) -> None:
    topic = topic_factory("windows", partitions=2)
    producer = kafka.make_producer(kafka.client_config(kafka_bootstrap))
    for i in range(10):
        producer.produce(topic, key=f"o/t{i}", value=b"w", partition=0)
    assert producer.flush(30) == 0
    admin = kafka.make_admin(kafka.client_config(kafka_bootstrap))
    for fut in admin.delete_records([TopicPartition(topic, 0, 6)]).values():
        fut.result(timeout=30)
    assert low_offsets(kafka_bootstrap, [topic]) == {(topic, 0): 6, (topic, 1): 0}
    check_retained(kafka_bootstrap, {(topic, 0): 6, (topic, 1): 0}, what="the window records")
    with pytest.raises(RebuildError, match=rf"{topic}\[0\] starts at offset 6 on the broker "
                                           "but the rebuild needs the window records from "
                                           "offset 4"):
        check_retained(kafka_bootstrap, {(topic, 0): 4}, what="the window records")
