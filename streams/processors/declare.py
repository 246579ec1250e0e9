"""faust's own topic declarations, retried while the cluster changes under them.

A starting worker declares faust's topics itself (the leader assignor's topic, the
tables' changelogs): one CreateTopics request, sent by aiokafka to the node its metadata
names controller, without retries. While a node of the cluster is down or restarting,
that request can fail although nothing is wrong: the node is gone (a connection error),
it is no longer the controller (NOT_CONTROLLER, which faust turns into a
``RuntimeError``), or the node forwarding the request to the KRaft controller answers
UNKNOWN_SERVER_ERROR (-1). The last one stopped a restarted worker in the fault
benchmark (``bench/faults.py``, 2026-12-06: a broker was killed while the worker
started; the worker exited 1). :class:`RetryingDeclare` retries such failures with the
worker's retry policy (``flywheel.retry.*`` in its Kafka config); anything else (a
principal that may not create the topic, a bad replication factor, an invalid config)
is raised at once, and a transient failure that outlasts the policy stops the worker
with a :class:`WorkerError` that says what to check.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka.errors import KafkaError, UnknownError
from faust.exceptions import NotReady

from hebrus_flywheel.core.kafka.retry import RetryPolicy
from hebrus_flywheel.streams.processors.exceptions import WorkerError

log = logging.getLogger(__name__)

_TRANSIENT_MESSAGES = (
    "Invalid controller",  # faust's RuntimeError for NOT_CONTROLLER
    "Controller node",  # faust: no controller in the metadata ("not found", "is None")
)


def is_transient(exc: BaseException) -> bool:
    """Whether a failed topic declaration is worth another attempt."""
    if isinstance(exc, KafkaError):
        # UNKNOWN_SERVER_ERROR is not retriable in general, but here it is what a
        # forwarded CreateTopics gets when the controller dies under it; retries are
        # bounded, and a retry of a topic that was created meanwhile sees TOPIC_EXISTS
        return bool(exc.retriable) or isinstance(exc, UnknownError)
    if isinstance(exc, (NotReady, TimeoutError, ConnectionError)):
        return True
    return type(exc) in (RuntimeError, Exception) and str(exc).startswith(_TRANSIENT_MESSAGES)


class RetryingDeclare:
    """Transport mixin (before faust's aiokafka ``Transport``): topic creation retried
    on transient failures with :attr:`declare_retry`."""

    declare_retry: RetryPolicy = RetryPolicy()

    async def _create_topic(self, owner: Any, client: Any, topic: str, partitions: int,
                            replication: int, **kwargs: Any) -> None:
        policy = self.declare_retry
        for attempt, delay in enumerate((*policy.delays(), None), start=1):
            try:
                await super()._create_topic(  # type: ignore[misc]
                    owner, client, topic, partitions, replication, **kwargs)
                return
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if delay is None:
                    raise WorkerError(
                        f"declaring topic {topic} failed {policy.attempts} times with "
                        f"transient errors, last {exc!r}; the cluster is not ready (a node "
                        "down or restarting, a controller election): check it (`flywheel "
                        "broker status`) and start the worker again, or allow more attempts "
                        "(flywheel.retry.attempts in the --kafka-config file)") from exc
                log.warning("retrying the declaration of topic %s in %.2fs (attempt %d of "
                            "%d): %r", topic, delay, attempt + 1, policy.attempts, exc)
                await asyncio.sleep(delay)
