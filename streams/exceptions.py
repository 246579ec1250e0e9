"""Errors raised by the ``streams`` package (broker control, topics, publishing, processors).

Every class derives from :class:`StreamsError`, itself a
:class:`flywheel.errors.FlywheelError`, so the CLI can report any of them as a clear
message. Messages say what was wrong and what to do about it.
"""

from __future__ import annotations

from hebrus_flywheel.core.errors import FlywheelError


class StreamsError(FlywheelError):
    """Base class for errors raised by the streams package."""


class ToolNotFoundError(StreamsError):
    """An external program the embedded broker needs (java, mvn) is missing or too old."""


class BrokerError(StreamsError):
    """The embedded Kafka broker could not be resolved, formatted, started, stopped or reached."""


class TopicError(StreamsError):
    """A topic name breaks the convention, or creating/describing/deleting topics failed."""


class PublishValidationError(StreamsError, ValueError):
    """A record breaks a flywheel invariant; ``reason`` is a stable code from
    ``streams.validation.REASONS`` (also the quarantine reason) and ``field`` names the
    offending field path when there is one."""

    def __init__(self, reason: str, message: str, *, field: str | None = None) -> None:
        super().__init__(f"[{reason}] {message}")
        self.reason = reason
        self.field = field


class PublisherClosedError(StreamsError):
    """A record was published after ``close()``, or after the producer hit a fatal error."""


class QueueFullError(StreamsError):
    """The publisher's queue stayed full for longer than ``max_block_ms`` under the
    ``block_then_raise`` policy; the record was not enqueued."""


class ConsentError(StreamsError):
    """A consent ledger entry is invalid, or the ledger cannot be read or written."""
