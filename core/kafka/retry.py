"""One retry policy for every Kafka request: which errors retry, and how long to wait.

A fresh broker answers metadata before its group coordinator has loaded
``__consumer_offsets``; requests in that window fail with NOT_COORDINATOR or
COORDINATOR_LOAD_IN_PROGRESS although nothing is wrong. Those errors, leader moves,
rebalances, transient timeouts and transport errors are retried with exponential
backoff (no jitter, so tests see a fixed sequence); anything else is raised at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from confluent_kafka import KafkaError, KafkaException

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka.errors import KafkaRetryError

log = logging.getLogger("hebrus_flywheel.kafka")
_T = TypeVar("_T")

RETRIABLE_CODES: frozenset[int] = frozenset({
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError._TIMED_OUT,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError._TRANSPORT,
    # the connection to one node was torn down under the request (that node died or
    # restarted); the next attempt goes to the partition's new leader
    KafkaError._DESTROY_BROKER,
})


def kafka_error(exc: BaseException) -> KafkaError | None:
    """The KafkaError a KafkaException carries, if any."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def is_retriable(err: KafkaError) -> bool:
    """Whether ``err`` is worth another attempt (never for a fatal error)."""
    if err.fatal():
        return False
    return err.code() in RETRIABLE_CODES or bool(err.retriable())


def describe(err: KafkaError) -> str:
    return f"{err.name()} ({err.str()})"


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently a retriable Kafka error is retried.

    Fields:
        attempts: total tries, the first one included (>= 1; 1 disables retries).
        backoff_s: wait before the second try (> 0).
        multiplier: each further wait is the previous one times this (>= 1).
        max_backoff_s: longest single wait (>= backoff_s).
        sleep: how to wait; tests pass a recorder so nothing sleeps.
    """

    attempts: int = 8
    backoff_s: float = 0.25
    multiplier: float = 2.0
    max_backoff_s: float = 5.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) \
                or self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts must be an integer >= 1, got "
                              f"{self.attempts!r}")
        if not self.backoff_s > 0:
            raise ConfigError(f"RetryPolicy.backoff_s must be > 0, got {self.backoff_s!r}")
        if not self.multiplier >= 1:
            raise ConfigError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier!r}")
        if not self.max_backoff_s >= self.backoff_s:
            raise ConfigError(f"RetryPolicy.max_backoff_s must be >= backoff_s "
                              f"({self.backoff_s}), got {self.max_backoff_s!r}")

    def delays(self) -> tuple[float, ...]:
        """The wait before each retry, in order (``attempts - 1`` of them)."""
        return tuple(min(self.max_backoff_s, self.backoff_s * self.multiplier ** i)
                     for i in range(self.attempts - 1))

    def wait(self, retry: int, what: str, err: KafkaError) -> None:
        """Log the one line saying what is retried and why, then back off (``retry`` >= 1)."""
        delay = self.delays()[retry - 1]
        log.warning("retrying %s in %.2fs (attempt %d of %d): %s", what, delay, retry + 1,
                    self.attempts, describe(err))
        self.sleep(delay)

    def give_up(self, what: str, err: KafkaError) -> KafkaRetryError:
        return KafkaRetryError(
            f"{what} failed {self.attempts} times with retriable errors, last {describe(err)}; "
            "the cluster is not ready (coordinator loading, leader election, unreachable "
            "broker): check it (`flywheel broker status`) and run again, or allow more "
            "attempts (flywheel.retry.attempts in the --kafka-config file)")

    def call(self, fn: Callable[[], _T], *, what: str,
             retry_if: Callable[[KafkaError], bool] = is_retriable) -> _T:
        """``fn()``, retried on retriable KafkaExceptions; other exceptions pass through.

        Raises :class:`KafkaRetryError` once ``attempts`` tries failed retriably.
        """
        for attempt in range(1, self.attempts):
            try:
                return fn()
            except KafkaException as exc:
                err = kafka_error(exc)
                if err is None or not retry_if(err):
                    raise
                self.wait(attempt, what, err)
        try:
            return fn()
        except KafkaException as exc:
            err = kafka_error(exc)
            if err is not None and retry_if(err):
                raise self.give_up(what, err) from exc
            raise
