"""Errors of the Kafka I/O layer; every one is a :class:`FlywheelError`."""

from __future__ import annotations

from hebrus_flywheel.core.errors import FlywheelError


class KafkaIOError(FlywheelError):
    """A Kafka request failed; the message says which, on what, and what to do."""


class KafkaRetryError(KafkaIOError):
    """A retriable Kafka error persisted through every attempt of the retry policy."""


class DeliveryError(KafkaIOError):
    """Produced records were refused by the broker or not acknowledged in time."""


class ReadIncompleteError(KafkaIOError):
    """A read could not reach the end offsets it was asked for within its timeout."""


class MissingTopicError(KafkaIOError):
    """A topic that must exist is not on the cluster."""


class NotAuthorizedError(KafkaIOError):
    """The broker refused this process's principal access to a topic (never read as
    "missing": that would fail open)."""
