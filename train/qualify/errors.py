"""Errors raised by :mod:`train.qualify`.

Every class derives from :class:`QualificationError`, itself a
:class:`train.exceptions.TrainError`, so callers can catch the qualification step, the
``train`` package or the whole project. Configuration values are refused with
:class:`flywheel.errors.ConfigError` instead (the message names the field).
"""

from __future__ import annotations

from hebrus_flywheel.train.exceptions import TrainError


class QualificationError(TrainError):
    """Base class for every error raised deliberately by :mod:`train.qualify`."""


class InputError(QualificationError, ValueError):
    """The qualification input bundle is malformed: a required piece is missing, has the
    wrong type, or contradicts another piece (geometry, expert bytes, splits)."""


class ReportError(QualificationError):
    """The report could not be rendered or written (unwritable directory, a figure that
    is not JSON-serialisable)."""
