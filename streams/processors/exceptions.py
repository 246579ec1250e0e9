"""Errors raised by the stream processors (``flywheel streams worker`` / ``inspect``).

Bad *input records* are never raised: they go to the quarantine topic with a reason
code. These classes describe problems the operator must fix: a worker that cannot
reach its topics, an inconsistent configuration, or state that cannot be restored.
"""

from __future__ import annotations

from hebrus_flywheel.streams.exceptions import StreamsError


class ProcessorError(StreamsError):
    """Base class for errors raised by ``streams.processors``."""


class ProcessorStateError(ProcessorError):
    """Processor state (a table entry) is missing or inconsistent with the records read."""


class WorkerError(ProcessorError):
    """The faust worker could not start, reach its topics, or keep running."""


class InspectError(ProcessorError):
    """``flywheel streams inspect`` could not read the topics it summarises."""
