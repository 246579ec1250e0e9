"""Crash-only agents and timers for the faust worker.

faust's default supervisor restarts a crashed agent *past* the record it failed on,
whose offset is then committed: the record is in no output and the worker goes on as
if nothing happened. Here every agent and timer body is wrapped so that an unhandled
error logs one line (the error, and the record's topic, partition and offset when
known) and ends the process at once with :data:`CRASH_EXIT_STATUS`, before faust can
ack or commit anything further. Offsets are committed only after the producer is
flushed, and the agents await the delivery of every output of a record before taking
the next (or, in a batch, before the batch's records are acked:
:mod:`streams.processors.batches`), so the committed offset never passes a record whose
outputs were not acknowledged: a restarted worker resumes at that record (architecture invariant 11,
crash-only). The app also uses :class:`mode.CrashingSupervisor`, so an error that
escaped the wrappers would still not be absorbed by a restart. Before exiting, the
crash hooks run (:func:`on_crash`): the streams worker counts the crash on its record in
the crash ledger, so a record that crashes it every time is quarantined as ``poison``
after a bounded number of restarts (:mod:`streams.processors.poison`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn

import faust

log = logging.getLogger(__name__)
CRASH_EXIT_STATUS = 70
"""Exit status of a worker stopped by an unhandled error (``EX_SOFTWARE``)."""


CrashHook = Callable[[tuple[str, int, int], str], None]
"""Called with the failing record's (topic, partition, offset) and the error text
before the process ends (the crash ledger of :mod:`streams.processors.poison`)."""
_hooks: list[CrashHook] = []


def on_crash(hook: CrashHook) -> None:
    """Run ``hook`` when an agent crashes on a known record (before the exit)."""
    _hooks.append(hook)


_RECORD_ATTR = "_flywheel_streams_record"


@contextmanager
def record_handled(record: tuple[str, int, int] | None) -> Iterator[None]:
    """Name ``record`` as the one an error raised inside the block happened on (the
    innermost block names it); ``None``: no record, as for a batch waiting for its
    deliveries (a failed delivery is not the fault of the stream's current event, which
    a crash would otherwise name and count towards a poison verdict)."""
    try:
        yield
    except Exception as exc:
        if not hasattr(exc, _RECORD_ATTR):
            with suppress(AttributeError):  # an exception type with __slots__
                setattr(exc, _RECORD_ATTR, record)
        raise


def _record(stream: Any, exc: BaseException | None = None) -> tuple[str, int, int] | None:
    if hasattr(exc, _RECORD_ATTR):
        named: tuple[str, int, int] | None = getattr(exc, _RECORD_ATTR)
        return named
    event = faust.current_event() or getattr(stream, "current_event", None)
    message = getattr(event, "message", None)
    if message is None:
        return None
    return str(message.topic), int(message.partition), int(message.offset)


def _run_hooks(record: tuple[str, int, int], exc: BaseException) -> None:
    for hook in _hooks:
        try:
            hook(record, f"{type(exc).__name__}: {exc}")
        except Exception:  # the exit must happen whatever a hook does
            log.exception("crash hook %r failed", hook)


def crash(what: str, exc: BaseException, record: tuple[str, int, int] | None = None
          ) -> NoReturn:
    """Log one line naming the error and the record, run the crash hooks (when the
    record is known), then end the process now."""
    where = "" if record is None else f" on {record[0]}[{record[1]}]@{record[2]}"
    log.critical(
        "streams worker crashed: %s failed%s: %s: %s; exiting %d without committing past "
        "it, a restart resumes at that record", what, where, type(exc).__name__, exc,
        CRASH_EXIT_STATUS,
    )
    if record is not None:
        _run_hooks(record, exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(CRASH_EXIT_STATUS)


def crash_only_agent(name: str, body: Callable[[Any], Awaitable[None]]
                     ) -> Callable[[Any], Awaitable[None]]:
    """An agent function that runs ``body(stream)`` and crashes the process if it raises."""

    async def agent(stream: Any) -> None:
        try:
            await body(stream)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            crash(f"agent {name}", exc, _record(stream, exc))

    agent.__name__ = agent.__qualname__ = name
    return agent


def crash_only_timer(name: str, body: Callable[[], Awaitable[None]]
                     ) -> Callable[[], Awaitable[None]]:
    """A timer function that runs ``body()`` and crashes the process if it raises."""

    async def timer() -> None:
        try:
            await body()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            crash(f"timer {name}", exc)

    timer.__name__ = timer.__qualname__ = name
    return timer
