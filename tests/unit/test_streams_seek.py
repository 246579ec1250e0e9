"""After a rebalance, stream partitions without a committed offset go back to their start
(aiokafka's seek_to_committed leaves them where its fetcher was)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, NamedTuple

from hebrus_flywheel.streams.processors.seek import seek_uncommitted_to_start, uncommitted


class TP(NamedTuple):
    topic: str
    partition: int


OBS, LOG = "p.flywheel.capture.observations.v1", "p.flywheel-streams-capture-state-changelog"


def test_only_stream_partitions_without_a_commit_above_zero_are_picked() -> None:
    committed = {TP(OBS, 0): 12, TP(OBS, 1): None, TP(OBS, 2): 0, TP(LOG, 1): None}
    assert uncommitted(committed, {LOG}) == [TP(OBS, 1), TP(OBS, 2)]


def test_the_wrapped_seek_sends_them_to_offset_zero_once_installed() -> None:
    sought: list[dict[Any, int]] = []

    class Consumer:
        async def seek_to_committed(self) -> dict[Any, Any]:
            return {TP(OBS, 0): 7, TP(OBS, 3): None, TP(LOG, 0): None}

        async def seek_wait(self, partitions: dict[Any, int]) -> None:
            sought.append(partitions)

    consumer = Consumer()
    app = SimpleNamespace(consumer=consumer, tables=SimpleNamespace(changelog_topics={LOG}))
    seek_uncommitted_to_start(app)
    seek_uncommitted_to_start(app)  # a second rebalance does not wrap it twice
    committed = asyncio.run(consumer.seek_to_committed())
    assert committed[TP(OBS, 0)] == 7  # faust still gets the committed offsets
    assert sought == [{TP(OBS, 3): 0}]
