"""Topic creation asks again for the topics whose creation failed transiently (a KRaft
controller dying or moving under the request), and only for those (no broker needed: the
CreateTopics request is replaced by scripted answers in confluent-kafka's own future
and error types)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import NewTopic

from hebrus_flywheel.core.kafka import RetryPolicy
from hebrus_flywheel.streams.exceptions import TopicError
from hebrus_flywheel.streams.topics import create_retrying, is_transient_create_error

OK = None
"""An answer meaning: created."""


def _future(answer: int | None) -> Future[None]:
    fut: Future[None] = Future()
    if answer is None:
        fut.set_result(None)
    else:
        fut.set_exception(KafkaException(KafkaError(answer)))
    return fut


class ScriptedCluster:
    """Answers each CreateTopics request from a per-topic script of error codes."""

    def __init__(self, script: Mapping[str, Sequence[int | None]]) -> None:
        self.script = {name: list(answers) for name, answers in script.items()}
        self.requests: list[list[str]] = []

    def create(self, topics: list[NewTopic]) -> dict[str, Future[None]]:
        names = [topic.topic for topic in topics]
        self.requests.append(names)
        return {name: _future(self.script[name].pop(0)) for name in names}


def _policy(attempts: int = 4) -> tuple[RetryPolicy, list[float]]:
    waits: list[float] = []
    return RetryPolicy(attempts=attempts, backoff_s=0.5, sleep=waits.append), waits


def _topics(*names: str) -> list[NewTopic]:
    return [NewTopic(name, num_partitions=1, replication_factor=-1) for name in names]


def _create(cluster: ScriptedCluster, names: Sequence[str], policy: RetryPolicy) -> dict[str, str]:
    return dict(create_retrying(cluster.create, _topics(*names), policy=policy,
                                where="127.0.0.1:9092", timeout_s=1.0))


@pytest.mark.parametrize("code", [KafkaError.UNKNOWN, KafkaError.NOT_CONTROLLER,
                                  KafkaError.REQUEST_TIMED_OUT, KafkaError._TRANSPORT])
def test_a_changing_controller_s_answers_are_transient(code: int) -> None:
    assert is_transient_create_error(KafkaError(code))


@pytest.mark.parametrize("code", [KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                  KafkaError.INVALID_REPLICATION_FACTOR, KafkaError.INVALID_CONFIG,
                                  KafkaError.POLICY_VIOLATION])
def test_a_refusal_is_not_transient(code: int) -> None:
    assert not is_transient_create_error(KafkaError(code))


def test_only_the_topics_that_failed_transiently_are_asked_for_again() -> None:
    cluster = ScriptedCluster({"a": [OK], "b": [KafkaError.UNKNOWN, OK],
                               "c": [KafkaError.NOT_CONTROLLER, KafkaError.UNKNOWN, OK]})
    policy, waits = _policy()
    assert _create(cluster, ["a", "b", "c"], policy) == {"a": "created", "b": "created",
                                                         "c": "created"}
    assert cluster.requests == [["a", "b", "c"], ["b", "c"], ["c"]]
    assert waits == list(policy.delays()[:2])


def test_a_topic_made_by_a_request_whose_answer_was_lost_reads_as_existing() -> None:
    cluster = ScriptedCluster({"a": [KafkaError.REQUEST_TIMED_OUT,
                                     KafkaError.TOPIC_ALREADY_EXISTS]})
    policy, _ = _policy()
    assert _create(cluster, ["a"], policy) == {"a": "exists"}


def test_a_refusal_is_raised_at_once() -> None:
    cluster = ScriptedCluster({"a": [KafkaError.INVALID_REPLICATION_FACTOR, OK]})
    policy, waits = _policy()
    with pytest.raises(TopicError, match="could not create topic a") as info:
        _create(cluster, ["a"], policy)
    assert isinstance(info.value.__cause__, KafkaException)
    assert cluster.requests == [["a"]] and waits == []


def test_an_unauthorized_creation_says_who_should_create_it() -> None:
    cluster = ScriptedCluster({"a": [KafkaError.TOPIC_AUTHORIZATION_FAILED]})
    with pytest.raises(TopicError, match="may not create it"):
        _create(cluster, ["a"], _policy()[0])


def test_a_controller_that_stays_away_stops_after_the_policy_s_attempts() -> None:
    cluster = ScriptedCluster({"a": [KafkaError.UNKNOWN] * 3, "b": [OK]})
    policy, waits = _policy(attempts=3)
    with pytest.raises(TopicError, match=r"topic a on 127.0.0.1:9092: creating topic a failed "
                                         r"3 times with retriable errors, last UNKNOWN") as info:
        _create(cluster, ["a", "b"], policy)
    assert "flywheel.retry.attempts" in str(info.value)  # the policy's own advice
    assert cluster.requests == [["a", "b"], ["a"], ["a"]]
    assert waits == list(policy.delays())
    cause = info.value.__cause__
    assert isinstance(cause, KafkaException) and cause.args[0].code() == KafkaError.UNKNOWN
