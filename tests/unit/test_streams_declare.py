"""faust's topic declarations retry transient failures (streams.processors.declare): a
worker that starts while a broker is killed waits for the cluster instead of exiting."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    NotControllerError,
    TopicAuthorizationFailedError,
    UnknownError,
)
from faust.exceptions import NotReady
from faust.transport.drivers.aiokafka import Transport as AIOKafkaTransport

from hebrus_flywheel.core.kafka.retry import RetryPolicy
from hebrus_flywheel.streams.processors.declare import is_transient
from hebrus_flywheel.streams.processors.exceptions import WorkerError
from hebrus_flywheel.streams.processors.fetch import (
    DeclaringTransport,
    PromptTransport,
    WorkerApp,
)

FAST = RetryPolicy(attempts=4, backoff_s=0.001, max_backoff_s=0.001)


@pytest.mark.parametrize("exc", [
    UnknownError("Cannot create topic: t (-1): None"),  # the fault benchmark's failure
    NotControllerError(), KafkaConnectionError(), NotReady("Not connected to Kafka Broker"),
    TimeoutError(), RuntimeError("Invalid controller: 2"),
    Exception("Controller node not found"), Exception("Controller node is None"),
])
def test_what_a_cluster_in_transition_answers_is_transient(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    TopicAuthorizationFailedError(), RuntimeError("something else"), ValueError("Invalid"),
    KeyError("Controller node"),
])
def test_refusals_and_bugs_are_not_transient(exc: BaseException) -> None:
    assert not is_transient(exc)


def _declare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             failures: list[BaseException]) -> list[str]:
    """Declare one topic through a worker app's producer transport (never started) whose
    CreateTopics requests fail with ``failures`` in turn, then succeed."""
    calls: list[str] = []

    async def create(self: object, owner: object, client: object, topic: str,
                     *args: Any, **kwargs: Any) -> None:
        calls.append(topic)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]

    monkeypatch.setattr(AIOKafkaTransport, "_really_create_topic", create)

    async def declare() -> None:
        app = WorkerApp("declare-test", broker="kafka://127.0.0.1:9", web_enabled=False,
                        datadir=str(tmp_path))
        app.declare_retry = FAST
        transport = app.producer_transport
        assert isinstance(transport, DeclaringTransport)
        await transport._create_topic(app, object(), "leader-topic", 1, 3)

    asyncio.run(declare())
    return calls


def test_a_declaration_is_retried_until_the_cluster_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failures = [UnknownError("Cannot create topic (-1)"), RuntimeError("Invalid controller: 1")]
    assert _declare(tmp_path, monkeypatch, failures) == ["leader-topic"] * 3


def test_a_refused_declaration_is_raised_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TopicAuthorizationFailedError):
        _declare(tmp_path, monkeypatch, [TopicAuthorizationFailedError()])


def test_a_cluster_that_stays_away_stops_the_worker_with_what_to_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(WorkerError, match=r"leader-topic failed 4 times .*broker status") \
            as caught:
        _declare(tmp_path, monkeypatch, [UnknownError("(-1)")] * 4)
    assert isinstance(caught.value.__cause__, UnknownError)


def test_both_transports_of_a_worker_app_retry_with_its_policy(tmp_path: Path) -> None:
    async def transports() -> tuple[Any, Any]:
        app = WorkerApp("declare-test", broker="kafka://127.0.0.1:9", web_enabled=False,
                        datadir=str(tmp_path))
        app.declare_retry = FAST
        return app.transport, app.producer_transport

    consumer_side, producer_side = asyncio.run(transports())
    assert isinstance(consumer_side, PromptTransport)
    assert isinstance(producer_side, DeclaringTransport)
    assert consumer_side.declare_retry is FAST and producer_side.declare_retry is FAST
