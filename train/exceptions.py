"""Errors raised by the ``train`` package.

Every class derives from :class:`TrainError`, itself a
:class:`flywheel.errors.FlywheelError`, so callers can catch the package or the project
as a whole. Messages say what was wrong and what to do about it.

This module is shared: new error families (snapshot reading, checkpoints, the trainer,
qualification, ...) are appended below, never renamed or removed.
"""

from __future__ import annotations

from hebrus_flywheel.core.errors import FlywheelError


class TrainError(FlywheelError):
    """Base class for every error raised deliberately by the ``train`` package."""


class SplitMixingError(TrainError):
    """Rows of the wrong split reached a component.

    Raised when a ``train`` row reaches an evaluator, or when a row of an evaluation
    split reaches something that may only be fitted on training data (the frequency
    baseline, the trainer).
    """


class BatchError(TrainError, ValueError):
    """A batch has the wrong shape, dtype, length or value range for the call it reached,
    or arrives out of the order a stateful consumer (history, union growth) requires."""


class BaselineError(TrainError):
    """A baseline was used before it was ready (e.g. scored before it was fitted) or was
    given inputs it cannot use (router weights of the wrong geometry)."""


class NoNativeGateError(BaselineError):
    """The teacher's router is not one ``(E, H)`` matrix on the layer's input (ZAYA's is an
    MLP over a state carried across layers), so the native-gate control does not exist
    for it; evaluation and qualification skip that control and say why."""


class CheckpointError(TrainError):
    """A checkpoint is missing, unreadable, or does not match the model or lineage."""


class SnapshotError(TrainError):
    """A sealed snapshot is missing, unverifiable, or does not match its manifest."""
