"""The worker's consumer (streams.processors.fetch): the broker holds a fetch briefly,
and capture records read through librdkafka reach faust in aiokafka's record shape."""

from __future__ import annotations

import asyncio
from pathlib import Path

import confluent_kafka
import pytest
from aiokafka.structs import ConsumerRecord

from hebrus_flywheel.streams.processors import fetch
from hebrus_flywheel.streams.processors.exceptions import WorkerError
from hebrus_flywheel.streams.processors.fetch import (
    FETCH_MAX_WAIT_MS,
    CaptureFetch,
    CaptureRecord,
    WorkerApp,
)


def _fetch_wait_ms(tmp_path: Path) -> int:
    """The fetch wait of the aiokafka consumer a worker app builds (never started)."""
    async def build() -> int:  # aiokafka's client wants a running loop
        app = WorkerApp("fetch-test", broker="kafka://127.0.0.1:9", web_enabled=False,
                        datadir=str(tmp_path))
        thread = app.consumer._thread
        assert isinstance(thread, fetch.PromptConsumerThread)
        consumer = thread._create_worker_consumer(app.transport)
        try:
            return int(consumer._fetch_max_wait_ms)
        finally:
            await consumer.stop()

    return asyncio.run(build())


def test_worker_consumer_waits_briefly_for_idle_partitions(tmp_path: Path) -> None:
    assert _fetch_wait_ms(tmp_path) == FETCH_MAX_WAIT_MS
    assert FETCH_MAX_WAIT_MS < 1500  # faust's constant, the stall this bounds


def test_an_aiokafka_without_the_setting_is_refused(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real = fetch.AIOKafkaConsumerThread._create_worker_consumer

    def without_setting(self: object, transport: object) -> object:
        consumer = real(self, transport)
        del consumer._fetch_max_wait_ms
        return consumer

    monkeypatch.setattr(fetch.AIOKafkaConsumerThread, "_create_worker_consumer",
                        without_setting)
    with pytest.raises(WorkerError, match="_fetch_max_wait_ms"):
        _fetch_wait_ms(tmp_path)


def test_capture_records_have_every_field_of_aiokafkas_record() -> None:
    # faust's aiokafka driver reads these by name (Consumer._to_message)
    assert set(ConsumerRecord.__dataclass_fields__) <= set(CaptureRecord._fields)


def test_a_librdkafka_message_becomes_the_record_aiokafka_would_give() -> None:
    msg = confluent_kafka.Message(
        topic="t.capture", partition=3, offset=41, key=b"owner/thread", value=b"avro",
        headers=[("content-type", b"x")],
        timestamp=(confluent_kafka.TIMESTAMP_CREATE_TIME, 1_700_000_000_123))
    record = CaptureRecord.of(msg)
    assert record == CaptureRecord(
        "t.capture", 3, 41, 1_700_000_000_123, 0, b"owner/thread", b"avro", None, 12, 4,
        (("content-type", b"x"),))
    appended = CaptureRecord.of(confluent_kafka.Message(
        topic="t", partition=0, offset=0, value=None,
        timestamp=(confluent_kafka.TIMESTAMP_LOG_APPEND_TIME, 5)))
    assert (appended.timestamp, appended.timestamp_type) == (5, 1)  # Kafka's LogAppendTime
    assert (appended.key, appended.serialized_value_size, appended.headers) == (None, 0, ())
    bare = CaptureRecord.of(confluent_kafka.Message(topic="t", partition=0, offset=0))
    assert bare.timestamp is None


def test_capture_fetch_consumer_never_commits_or_joins_by_itself() -> None:
    spec = CaptureFetch(librdkafka={"bootstrap.servers": "127.0.0.1:9",
                                    "security.protocol": "SASL_SSL"},
                        topics=frozenset({"t.capture"}))
    config = spec.consumer_config("app-capture")
    assert config["security.protocol"] == "SASL_SSL"  # the worker's own client settings
    assert config["enable.auto.commit"] is False and config["enable.auto.offset.store"] is False
    assert config["fetch.wait.max.ms"] == fetch.CAPTURE_FETCH_WAIT_MS
    # a full prefetch is refilled promptly (librdkafka's default waits a second)
    assert config["fetch.queue.backoff.ms"] == fetch.PREFETCH_BACKOFF_MS < 100


@pytest.mark.parametrize(("librdkafka", "topics", "field"), [
    ({}, frozenset({"t"}), "CaptureFetch.librdkafka"),
    ({"bootstrap.servers": "h:1"}, frozenset(), "CaptureFetch.topics"),
])
def test_capture_fetch_names_the_field_it_refuses(librdkafka: dict[str, str],
                                                  topics: frozenset[str], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CaptureFetch(librdkafka=librdkafka, topics=topics)


def test_worker_app_reads_capture_through_librdkafka_once_configured(tmp_path: Path) -> None:
    async def build() -> type:
        app = WorkerApp("fetch-test", broker="kafka://127.0.0.1:9", web_enabled=False,
                        datadir=str(tmp_path))
        return type(app.consumer._thread)

    assert issubclass(asyncio.run(build()), fetch.CaptureFetchThread)
    assert WorkerApp.capture_fetch is None  # bench apps opt in; StreamsWorker always sets it


def test_librdkafka_errors_stop_the_worker_only_when_waiting_cannot_mend_them(
        caplog: pytest.LogCaptureFixture) -> None:
    error = confluent_kafka.KafkaError
    for code in (error._TRANSPORT, error._ALL_BROKERS_DOWN, error.NOT_LEADER_FOR_PARTITION):
        fetch._check(error(code))  # logged; librdkafka reconnects by itself
    assert caplog.text.count("it retries") == 3
    for code in (error.TOPIC_AUTHORIZATION_FAILED, error._SSL, error.SASL_AUTHENTICATION_FAILED):
        with pytest.raises(WorkerError, match="credentials and topic ACLs"):
            fetch._check(error(code))
    with pytest.raises(WorkerError):
        fetch._check(error(error._FATAL, fatal=True))


def test_a_fetch_returns_when_faust_stops_its_flow_instead_of_spinning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """faust's own fetch answers {} at once while its flow is stopped (rebalance,
    shutdown); the capture fetch must hand that back, not ask again until its deadline
    (it spun ~200,000 times a second for up to a second)."""
    from types import SimpleNamespace

    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
    from faust.types import TP

    asked: list[float] = []
    consumer = SimpleNamespace(flow_active=True, assignment=lambda: set(),
                               pause=lambda *tps: None)

    async def faust_fetch(self: object, _consumer: object, partitions: object,
                          timeout: float | None = None, max_records: int | None = None) -> dict:
        asked.append(timeout or 0.0)
        consumer.flow_active = False  # a rebalance began while this fetch ran
        return {}

    async def no_assign(_consumer: object, _wanted: object) -> None:
        return None

    monkeypatch.setattr(AIOKafkaConsumerThread, "_fetch_records", faust_fetch)
    thread = object.__new__(fetch.CaptureFetchThread)
    spec = SimpleNamespace(topics=frozenset({"capture"}))
    monkeypatch.setattr(thread, "_capture_fetch", lambda: spec, raising=False)
    monkeypatch.setattr(thread, "_assign", no_assign, raising=False)
    monkeypatch.setattr(thread, "_take", lambda wanted, limit: {}, raising=False)
    monkeypatch.setattr(fetch.CaptureFetchThread, "consumer", consumer, raising=False)
    partitions = {TP("capture", 0), TP("summaries", 0)}
    got = asyncio.run(thread._fetch_records(consumer, partitions, timeout=1.0))
    assert got == {} and len(asked) == 1
