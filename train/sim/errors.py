"""Errors raised by the shadow SSD-prefetch simulator (``train.sim``).

Both classes derive from :class:`train.exceptions.TrainError` (and so from
:class:`flywheel.errors.FlywheelError`). Messages say what was wrong and what to do.
"""

from __future__ import annotations

from hebrus_flywheel.train.exceptions import TrainError


class SimulationError(TrainError):
    """The simulator cannot run these inputs under this configuration (for example a
    cache smaller than one layer's exact demand), or an internal invariant broke."""


class TraceError(SimulationError, ValueError):
    """A decode trace or prediction set is malformed: wrong shape or dtype, an id out
    of range, duplicate experts in one route, or a prediction whose input would exist
    only after the deadline it targets."""
