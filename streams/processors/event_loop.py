"""The event loop a streams worker process runs on.

faust runs every agent, its consumer and producer, and the consumer's fetch thread on
asyncio event loops; at the worker's rates a large share of its CPU is the loop's own
bookkeeping (scheduling callbacks, creating tasks, polling sockets, TLS reads). uvloop
implements the same loop on libuv in C: measured on ``bench/streams.py``'s backlog, one
worker's CPU fell by about 8% and its rate rose by 7-9% (``docs/operations.md``).

It is chosen once per process, before faust builds anything (:func:`use_event_loop`):
the policy applies to every loop created afterwards, the fetch thread's included.
"""

from __future__ import annotations

import asyncio
import logging

from hebrus_flywheel.core.errors import ConfigError

log = logging.getLogger(__name__)

EVENT_LOOPS = ("uvloop", "asyncio")
DEFAULT_EVENT_LOOP = "uvloop"


def use_event_loop(name: str = DEFAULT_EVENT_LOOP) -> None:
    """Make ``name`` the event loop of every loop this process creates from now on.
    ``uvloop`` needs the uvloop package (a dependency wherever uvloop builds:
    Linux and macOS); ``asyncio`` is the standard library's loop."""
    if name not in EVENT_LOOPS:
        raise ConfigError(f"event loop {name!r} is not one of {', '.join(EVENT_LOOPS)}")
    if name == "asyncio":
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
        return
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError(
            "the uvloop event loop is not installed: `pip install uvloop` (it builds on "
            "Linux and macOS), or run the worker with --event-loop asyncio") from exc
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    log.debug("event loop: uvloop %s", uvloop.__version__)
