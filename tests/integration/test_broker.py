"""The embedded broker and the topic catalogue against a real Kafka 4.x broker."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Message
from typer.testing import CliRunner

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV, KAFKA_CONFIG_ENV
from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker, find_java, probe_metadata
from hebrus_flywheel.streams.cli import broker_app, topics_app
from hebrus_flywheel.streams.exceptions import ToolNotFoundError, TopicError
from hebrus_flywheel.streams.topics import (
    IDENTITIES_TOPIC,
    TRANSCRIPTS_TOPIC,
    TopicSpec,
    check_topics,
    create_topics,
    describe_topics,
)
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

external_cluster = pytest.mark.skipif(
    bool(os.environ.get(BOOTSTRAP_ENV)), reason="an external cluster is configured"
)


def _produce(bootstrap: kafka.KafkaTarget, topic: str, records: list[tuple[str, str]]) -> None:
    producer = kafka.make_producer(kafka.client_config(bootstrap))
    for key, value in records:
        producer.produce(topic, key=key, value=value, headers={"schema": b"test.v1"})
    remaining = producer.flush(30)
    assert remaining == 0, f"{remaining} records not delivered"


def _consume(bootstrap: kafka.KafkaTarget, topic: str, count: int,
             timeout_s: float = 60.0) -> list[Message]:
    consumer = kafka.make_consumer(kafka.client_config(bootstrap),
                                   group_id=f"flywheel-reader-{uuid.uuid4().hex}",
                                   settings={"auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    got: list[Message] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < count and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                got.append(msg)
    finally:
        consumer.close()
    return got


def _pairs(messages: list[Message]) -> list[tuple[str, str]]:
    return sorted(((m.key() or b"").decode(), (m.value() or b"").decode()) for m in messages)


@external_cluster
def test_status_reports_running(kafka_bootstrap: str) -> None:
    status = EmbeddedBroker(BrokerConfig()).status()
    assert status.running and status.pid is not None
    assert status.metadata_ok
    assert status.formatted and status.cluster_id
    assert status.bootstrap == kafka_bootstrap


def test_metadata_request_succeeds(kafka_bootstrap: str) -> None:
    assert probe_metadata(kafka_bootstrap, 10.0)


def test_create_topics_twice_is_idempotent(kafka_bootstrap: str, topic_factory) -> None:
    specs = topic_factory.catalogue()
    assert set(topic_factory.create(specs).values()) == {"exists"}
    assert create_topics(kafka_bootstrap, specs) == {s.name: "exists" for s in specs}
    assert check_topics(kafka_bootstrap, specs) == []
    infos = describe_topics(kafka_bootstrap, [s.name for s in specs])
    identities = infos[topic_factory.prefix + IDENTITIES_TOPIC]
    assert identities.partitions == 1
    assert identities.configs["cleanup.policy"] == "compact"
    transcripts = infos[topic_factory.prefix + TRANSCRIPTS_TOPIC]
    assert transcripts.partitions == 4
    assert transcripts.configs["retention.ms"] == str(7 * 86_400_000)  # the default policy


def test_first_creation_reports_created(kafka_bootstrap: str, topic_factory) -> None:
    spec = TopicSpec(name=f"{topic_factory.prefix}fresh", partitions=2, doc="fresh topic")
    assert topic_factory.create([spec]) == {spec.name: "created"}


def test_existing_topic_with_other_config_is_refused(kafka_bootstrap: str, topic_factory) -> None:
    short = topic_factory("drift", partitions=1)  # created with retention -1
    drifted = TopicSpec(name=short, partitions=2, retention_ms=3_600_000, doc="drifted")
    with pytest.raises(TopicError, match="differ from the catalogue"):
        create_topics(kafka_bootstrap, [drifted])
    assert create_topics(kafka_bootstrap, [drifted], strict=False) == {short: "exists"}


def test_produce_consume_round_trip(kafka_bootstrap: str, topic_factory) -> None:
    topic = topic_factory("roundtrip", partitions=4)
    records = [(f"owner{i % 3}/thread{i % 5}", f"value-{i}") for i in range(30)]
    _produce(kafka_bootstrap, topic, records)
    got = _consume(kafka_bootstrap, topic, len(records))
    assert _pairs(got) == sorted(records)
    assert all(dict(m.headers() or [])["schema"] == b"test.v1" for m in got)
    partitions: dict[str, set[int | None]] = {}
    for m in got:
        partitions.setdefault(_pairs([m])[0][0], set()).add(m.partition())
    assert all(len(p) == 1 for p in partitions.values()), "one key must map to one partition"


@external_cluster
def test_cli_status_and_topics(kafka_bootstrap: str, topic_factory) -> None:
    runner = CliRunner()
    status = runner.invoke(broker_app, ["status"])
    assert status.exit_code == 0 and "running" in status.output
    created = runner.invoke(topics_app, ["create", "--prefix", topic_factory.prefix])
    assert created.exit_code == 0, created.output
    topic_factory.track(line.split()[1] for line in created.output.splitlines())
    again = runner.invoke(topics_app, ["create", "--prefix", topic_factory.prefix])
    assert again.exit_code == 0 and "created" not in again.output
    listing = runner.invoke(topics_app, ["list", "--all"])
    assert listing.exit_code == 0 and topic_factory.prefix in listing.output


def test_cli_unreachable_cluster_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One try: the retry policy's backoff (8 tries, ~30 s) is test_kafka_retry.py's subject.
    (tmp_path / "kafka.properties").write_text("flywheel.retry.attempts=1\n")
    monkeypatch.setenv(KAFKA_CONFIG_ENV, str(tmp_path / "kafka.properties"))
    port = free_port()
    result = CliRunner().invoke(topics_app, ["list", "-b", f"127.0.0.1:{port}", "--timeout", "2"])
    assert result.exit_code == 2
    assert "flywheel broker up" in result.output


def test_down_never_kills_a_foreign_pid(tmp_path: Path) -> None:
    broker = EmbeddedBroker(BrokerConfig(home=tmp_path))
    broker.config.kafka_dir.mkdir(parents=True)
    broker.config.pid_file.write_text(f"{os.getpid()}\n")  # alive, but not a Kafka broker
    assert broker.pid() is None
    assert broker.down() is False
    assert not broker.config.pid_file.exists()


@pytest.mark.slow
def test_restart_keeps_topic_data(tmp_path: Path) -> None:
    try:
        find_java()
    except ToolNotFoundError as exc:
        pytest.skip(str(exc))
    shared_libs = BrokerConfig().jars_dir
    config = BrokerConfig(
        home=tmp_path,
        port=free_port(),
        controller_port=free_port(),
        heap_mb=256,
        libs_dir=shared_libs if (shared_libs / ".pom.sha256").is_file() else None,
    )
    broker = EmbeddedBroker(config)
    try:
        assert broker.up() is True
        assert broker.up() is False  # idempotent
        topic = f"t-{uuid.uuid4().hex[:8]}.flywheel.test.restart.v1"
        target = broker.admin_config()  # this home's own CA and admin credential
        create_topics(target, [TopicSpec(name=topic, partitions=2, doc="restart")])
        records = [(f"o/t{i}", f"v{i}") for i in range(10)]
        _produce(target, topic, records)
        cluster_id = broker.status().cluster_id
        assert broker.down() is True
        assert not broker.status().running and not probe_metadata(config.bootstrap, 1.0)
        assert broker.up() is True
        assert broker.status().cluster_id == cluster_id
        got = _consume(target, topic, len(records))
        assert _pairs(got) == sorted(records)
    finally:
        broker.down()
