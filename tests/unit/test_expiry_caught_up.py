"""expiry.caught_up: idle timeouts only while the worker has read its whole input."""

from __future__ import annotations

import pytest

from hebrus_flywheel.streams.processors.expiry import caught_up


@pytest.mark.parametrize(("processed", "committed", "highwater", "expected"), [
    (None, None, None, True),   # nothing fetched yet: nothing known to wait for
    (9, None, 10, True),        # the last record (offset 9 of 10) processed here
    (8, None, 10, False),       # one record still in the backlog
    (None, 10, 10, True),       # nothing new since the group's commit
    (None, 7, 10, False),       # records after the commit not processed yet
    (None, None, 3, False),     # never committed: the partition is read from its start
    (12, 5, 10, True),          # processed past a stale high watermark
])
def test_idle_ticks_wait_until_the_partition_is_caught_up(
        processed: int | None, committed: int | None, highwater: int | None,
        expected: bool) -> None:
    assert caught_up(processed, committed, highwater) is expected
