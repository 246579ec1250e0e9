"""Errors raised by the ``consumers`` package (replay worker, shards, seal, verify, rebuild).

Every class derives from :class:`ConsumersError`, itself a
:class:`flywheel.errors.FlywheelError`, so the CLI turns any of them into a clear
message and exit status 2. Messages say what was wrong and what to do about it.
``ManifestError`` and ``VerifyError`` are the snapshot contract's own
(:mod:`hebrus_flywheel.core.snapshot`), re-exported so that writer and readers raise
and catch one type.
"""

from __future__ import annotations

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.core.snapshot.errors import ManifestError, VerifyError

__all__ = ["ConsumersError", "ControlError", "DatasetError", "ExpireError", "ManifestError",
           "RebuildError", "SealError", "ShardError", "VerifyError", "WorkerError"]


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


class JobRefused(WorkerError):
    """A candidate worker cannot serve a job at all (its snapshot cannot be opened, the
    teacher is not the snapshot's, a planned window is gone); the planner is told."""


class SealError(ConsumersError):
    """An epoch cannot be sealed (out of order, workers behind, parity refused, conflict)."""


class ExpireError(ConsumersError):
    """Old snapshots cannot be expired as asked (e.g. a file cannot be deleted)."""


class RebuildError(ConsumersError):
    """A snapshot cannot be rebuilt, or the rebuilt shards differ from the sealed ones."""


class PublishError(SealError):
    """A sealed epoch could not be published to its object store root, or another
    snapshot already sealed that epoch there."""
