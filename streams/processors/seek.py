"""Seek partitions without a committed offset back to their start after a rebalance.

faust seeks every assigned partition to its committed offset when a rebalance completes
(``Consumer.perform_seek``), but aiokafka's ``seek_to_committed`` moves only partitions
whose committed offset is above 0. A partition with no commit yet (or one at 0) keeps the
position aiokafka's fetcher had reached. When the rebalance comes before the group's
first commit, that position lies past records faust had fetched and then dropped at the
revocation (``flow_control.clear()`` empties the agent queues): they would never be read
again, the partition would stall with lag, and a later commit past them would lose them
for good. The two-worker streams test caught it (the worker owning partitions 2 and 3
had read nothing from them, with lag from offset 0).

:func:`seek_uncommitted_to_start` wraps the consumer's ``seek_to_committed`` so that
every such stream partition (never a table changelog, which recovery positions itself)
is sought to offset 0 as well: the group's ``auto.offset.reset=earliest`` start, and
past retention aiokafka resets it to the earliest offset kept.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)
_MARK = "_flywheel_seeks_uncommitted"


def uncommitted(committed: Mapping[Any, int | None], changelogs: set[str]) -> list[Any]:
    """The stream partitions of ``committed`` that aiokafka left unsought (no commit, or 0)."""
    return sorted((tp for tp, offset in committed.items()
                   if (offset is None or offset <= 0) and tp.topic not in changelogs),
                  key=lambda tp: (tp.topic, tp.partition))


def seek_uncommitted_to_start(app: Any) -> None:
    """Install the wrapper on ``app.consumer`` (once)."""
    consumer = app.consumer
    if getattr(consumer, _MARK, False):
        return
    original: Callable[[], Awaitable[Mapping[Any, int | None]]] = consumer.seek_to_committed

    async def seek_to_committed() -> Mapping[Any, int | None]:
        committed = await original()
        fresh = uncommitted(committed, set(app.tables.changelog_topics))
        if fresh:
            log.info("seeking %d partition(s) without a committed offset to their start: %s",
                     len(fresh), ", ".join(f"{tp.topic}[{tp.partition}]" for tp in fresh))
            await consumer.seek_wait({tp: 0 for tp in fresh})
        return committed

    consumer.seek_to_committed = seek_to_committed
    setattr(consumer, _MARK, True)
