"""Errors raised by the ``consumers`` package (replay worker, shards, seal, verify, rebuild).

Every class derives from :class:`ConsumersError`, itself a
:class:`flywheel.errors.FlywheelError`, so the CLI turns any of them into a clear
message and exit status 2. Messages say what was wrong and what to do about it.
"""

from __future__ import annotations

from hebrus_flywheel.core.errors import FlywheelError


class ConsumersError(FlywheelError):
    """Base class for errors raised deliberately by the ``consumers`` package."""


class ShardError(ConsumersError):
    """A shard cannot be built, written, renamed or read, or differs from its earlier bytes."""


class DatasetError(ConsumersError):
    """A dataset directory is missing, or was started with another identity or config."""


class ControlError(ConsumersError):
    """The epoch control topic is unreachable, holds a malformed record, or disagrees."""


class WorkerError(ConsumersError):
    """The replay worker cannot reach Kafka, replay a block, or commit its progress."""


class SealError(ConsumersError):
    """An epoch cannot be sealed (out of order, workers behind, parity refused, conflict)."""


class ManifestError(ConsumersError):
    """A manifest is missing, malformed, or its digest does not match its content."""


class VerifyError(ConsumersError):
    """A sealed snapshot differs from its manifest (byte flip, missing or extra file)."""


class RebuildError(ConsumersError):
    """A snapshot cannot be rebuilt, or the rebuilt shards differ from the sealed ones."""
