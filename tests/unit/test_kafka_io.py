"""core.kafka without a network: config validation, passthrough, faust translation, retry."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.settings import KAFKA_CONFIG_ENV, read_kafka_properties

UNREACHABLE = "127.0.0.1:1"


def fail(code: int) -> KafkaException:
    return KafkaException(KafkaError(code))


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.mark.parametrize(("change", "field"), [
    ({"bootstrap_servers": ""}, "bootstrap_servers"),
    ({"properties": {"group.id": "x"}}, "group.id"),
    ({"properties": {"enable.idempotence": "false"}}, "enable.idempotence"),
    ({"properties": {"bad key": "x"}}, "bad key"),
    ({"properties": {"flywheel.nope": "1"}}, "flywheel.nope"),
    ({"properties": {"client.id": None}}, "client.id"),
])
def test_config_errors_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"KafkaClientConfig.*{field}"):
        kafka.KafkaClientConfig(**{"bootstrap_servers": UNREACHABLE, **change})


@pytest.mark.parametrize(("change", "field"), [
    ({"attempts": 0}, "attempts"), ({"backoff_s": 0}, "backoff_s"),
    ({"multiplier": 0.5}, "multiplier"), ({"max_backoff_s": 0.1}, "max_backoff_s"),
])
def test_retry_policy_errors_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"RetryPolicy.{field}"):
        kafka.RetryPolicy(**change)


def test_user_properties_pass_through_and_win_over_project_defaults() -> None:
    config = kafka.KafkaClientConfig(bootstrap_servers="b:9092", properties={
        "security.protocol": "SASL_SSL", "sasl.username": "u", "client.id": "mine",
        "socket.keepalive.enable": True})
    conf = config.librdkafka({"client.id": "project", "linger.ms": 5})
    assert conf == {"bootstrap.servers": "b:9092", "client.id": "mine", "linger.ms": 5,
                    "security.protocol": "SASL_SSL", "sasl.username": "u",
                    "socket.keepalive.enable": "true"}


def test_properties_file_env_and_retry_keys(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "client.properties"
    path.write_text("# cluster\nclient.id = flywheel-a\n\nsocket.timeout.ms=9000\n"
                    "flywheel.retry.attempts=3\nflywheel.retry.backoff.ms=50\n")
    monkeypatch.setenv(KAFKA_CONFIG_ENV, str(path))
    config = kafka.client_config("h:1")
    assert dict(config.properties) == {"client.id": "flywheel-a", "socket.timeout.ms": "9000"}
    assert (config.retry.attempts, config.retry.backoff_s) == (3, 0.05)
    assert kafka.client_config(config) is config


def test_properties_file_errors_say_where(tmp_path: Path) -> None:
    path = tmp_path / "bad.properties"
    path.write_text("client.id=a\nno-equals-sign\n")
    with pytest.raises(ConfigError, match=r"bad.properties:2"):
        read_kafka_properties(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_kafka_properties(tmp_path / "missing")


def test_every_confluent_client_gets_the_properties() -> None:
    config = kafka.KafkaClientConfig(bootstrap_servers=UNREACHABLE,
                                     properties={"client.id": "x", "socket.timeout.ms": "1000"})
    for build in (kafka.make_producer, kafka.make_consumer, kafka.make_admin):
        build(config)  # librdkafka accepts them (no network until used)
    bad = kafka.KafkaClientConfig(bootstrap_servers=UNREACHABLE,
                                  properties={"no.such.property": "1"})
    for build in (kafka.make_producer, kafka.make_consumer, kafka.make_admin):
        with pytest.raises(ConfigError, match=r"no\.such\.property"):
            build(bad)


def test_faust_translation_of_sasl_and_client_id() -> None:
    config = kafka.KafkaClientConfig(bootstrap_servers="a:1,b:2", properties={
        "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "u", "sasl.password": "p", "client.id": "c"})
    out = kafka.faust_settings(config)
    assert out["broker"] == ["kafka://a:1", "kafka://b:2"]
    assert out["broker_client_id"] == "c"
    creds = out["broker_credentials"]
    assert (creds.username, creds.password, str(creds.mechanism.value)) == \
        ("u", "p", "SCRAM-SHA-512")
    assert "broker_credentials" not in kafka.faust_settings(
        kafka.KafkaClientConfig(bootstrap_servers="a:1"))


@pytest.mark.parametrize(("props", "match"), [
    ({"socket.keepalive.enable": "true"}, "no aiokafka equivalent"),
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "GSSAPI"}, "sasl.mechanism"),
    ({"security.protocol": "SSL", "ssl.ca.location": "/no/such/ca.pem"}, "ssl"),
])
def test_faust_refuses_what_it_cannot_honour(props: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        kafka.faust_settings(kafka.KafkaClientConfig(bootstrap_servers="a:1", properties=props))


@pytest.mark.parametrize("code", [
    KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT, KafkaError._TRANSPORT,
    KafkaError._DESTROY_BROKER,
])
def test_retriable_codes(code: int) -> None:
    assert kafka.is_retriable(KafkaError(code))


@pytest.mark.parametrize("code", [KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                  KafkaError.UNKNOWN_MEMBER_ID, KafkaError._INVALID_ARG])
def test_not_retriable_codes(code: int) -> None:
    assert not kafka.is_retriable(KafkaError(code))


def test_fatal_is_never_retried_and_retriable_flag_is() -> None:
    assert not kafka.is_retriable(KafkaError(KafkaError.NOT_COORDINATOR, fatal=True))
    assert kafka.is_retriable(KafkaError(KafkaError._INVALID_ARG, retriable=True))


def test_backoff_sequence_is_exponential_and_capped() -> None:
    policy = kafka.RetryPolicy(attempts=6, backoff_s=0.5, multiplier=2.0, max_backoff_s=3.0)
    assert policy.delays() == (0.5, 1.0, 2.0, 3.0, 3.0)


def test_retry_succeeds_after_retriable_errors(caplog: pytest.LogCaptureFixture) -> None:
    sleeps = Sleeps()
    policy = kafka.RetryPolicy(attempts=4, backoff_s=0.1, sleep=sleeps)
    errors = [fail(KafkaError.NOT_COORDINATOR), fail(KafkaError.COORDINATOR_LOAD_IN_PROGRESS)]

    def op() -> str:
        if errors:
            raise errors.pop(0)
        return "ok"

    with caplog.at_level(logging.WARNING, logger="hebrus_flywheel.kafka"):
        assert policy.call(op, what="committed offsets of g") == "ok"
    assert sleeps == [0.1, 0.2]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "committed offsets of g" in lines[0]
    assert "NOT_COORDINATOR" in lines[0] and "COORDINATOR_LOAD_IN_PROGRESS" in lines[1]


def test_retry_gives_up_with_a_project_error() -> None:
    sleeps = Sleeps()
    policy = kafka.RetryPolicy(attempts=3, backoff_s=0.1, sleep=sleeps)
    calls = []

    def op() -> None:
        calls.append(1)
        raise fail(KafkaError.NOT_COORDINATOR)

    with pytest.raises(kafka.KafkaRetryError, match=r"3 times.*NOT_COORDINATOR"):
        policy.call(op, what="x")
    assert len(calls) == 3 and sleeps == [0.1, 0.2]


def test_non_retriable_error_is_raised_at_once() -> None:
    sleeps = Sleeps()
    policy = kafka.RetryPolicy(sleep=sleeps)
    with pytest.raises(KafkaException):
        policy.call(lambda: (_ for _ in ()).throw(fail(KafkaError.TOPIC_AUTHORIZATION_FAILED)),
                    what="x")
    assert sleeps == []


class FakeMessage:
    def __init__(self, err: KafkaError | None) -> None:
        self._err = err

    def error(self) -> KafkaError | None:
        return self._err

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 2

    def offset(self) -> int:
        return 7


def test_message_check_classifies_every_error() -> None:
    sleeps = Sleeps()
    check = kafka.MessageCheck(kafka.RetryPolicy(attempts=2, sleep=sleeps), "reading t")
    assert check.check(FakeMessage(None)) == "data"  # type: ignore[arg-type]
    assert check.check(FakeMessage(KafkaError(KafkaError._PARTITION_EOF))) == "eof"  # type: ignore[arg-type]
    assert check.check(FakeMessage(KafkaError(KafkaError._TRANSPORT))) == "retry"  # type: ignore[arg-type]
    with pytest.raises(kafka.KafkaRetryError, match=r"t\[2\]@7"):
        check.check(FakeMessage(KafkaError(KafkaError._TRANSPORT)))  # type: ignore[arg-type]
    with pytest.raises(kafka.KafkaIOError, match=r"t\[2\]@7.*TOPIC_AUTHORIZATION_FAILED"):
        check.check(FakeMessage(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))  # type: ignore[arg-type]
