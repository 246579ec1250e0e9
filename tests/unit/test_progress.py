"""Lag arithmetic, the drain predicate and watchdog decisions with an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.progress import (
    BROKER_LOST,
    DRAIN_TIMEOUT,
    DRAINED,
    RUNNING,
    STALLED,
    Watchdog,
    WatchdogConfig,
    drain_complete,
    format_health,
    partition_lag,
    read_health,
    write_health,
)

A, B = ("t", 0), ("t", 1)


def test_lag_uses_log_start_without_a_commit_and_after_retention() -> None:
    ends = {A: (0, 10), B: (5, 8)}
    assert partition_lag(ends, {}) == {A: 10, B: 3}
    assert partition_lag(ends, {A: 4, B: 2}) == {A: 6, B: 3}  # B: retention passed commit
    assert partition_lag(ends, {A: 10, B: 8}) == {A: 0, B: 0}
    assert partition_lag({A: (0, 0)}, {A: -1}) == {A: 0}


def test_drain_needs_two_equal_end_reads_and_zero_lag() -> None:
    ends = {A: (0, 10)}
    assert not drain_complete(None, ends, {A: 10})  # first read: not confirmed yet
    assert drain_complete(ends, ends, {A: 10})
    assert not drain_complete({A: (0, 9)}, ends, {A: 10})  # end moved
    assert not drain_complete(ends, ends, {A: 9})
    assert not drain_complete({}, {}, {})  # no input partitions: nothing was read


def _dog(**kw: object) -> Watchdog:
    return Watchdog(WatchdogConfig(**kw), started=0.0)  # type: ignore[arg-type]


def test_drained_reports_processed_records() -> None:
    dog = _dog(drain=True)
    assert dog.observe(1, {A: (0, 10), B: (0, 4)}, {A: 2}).state == RUNNING
    assert dog.observe(2, {A: (0, 10), B: (0, 4)}, {A: 10, B: 4}).state == RUNNING
    verdict = dog.observe(3, {A: (0, 10), B: (0, 4)}, {A: 10, B: 4})
    assert verdict.state == DRAINED and verdict.exit_code == 0
    assert dog.processed == 12 and "processed 12 records, final lag 0" in verdict.message


def test_records_held_in_state_keep_a_worker_from_draining() -> None:
    """The streams worker commits the summaries it holds for their turn in decision order:
    lag 0 with summaries held is not drained, nor a stall."""
    dog, ends = _dog(drain=True, stall_timeout_s=5), {A: (0, 10)}
    assert dog.observe(1, ends, {A: 10}, holding=3).state == RUNNING
    assert dog.observe(20, ends, {A: 10}, holding=3).state == RUNNING  # no stall either
    assert dog.observe(21, ends, {A: 10}, holding=0).state == DRAINED


def test_without_drain_lag_zero_runs_on() -> None:
    dog = _dog()
    for t in range(5):
        assert dog.observe(t, {A: (0, 3)}, {A: 3}).state == RUNNING


def test_stall_only_with_lag_and_no_committed_progress() -> None:
    dog = _dog(stall_timeout_s=10)
    dog.observe(0, {A: (0, 10)}, {A: 1})
    assert dog.observe(9, {A: (0, 10)}, {A: 2}).state == RUNNING  # progress at 9
    assert dog.observe(18, {A: (0, 10)}, {A: 2}).state == RUNNING
    verdict = dog.observe(20, {A: (0, 10)}, {A: 2})
    assert verdict.state == STALLED and verdict.exit_code == 3
    assert "t[0]=8" in verdict.message


def test_caught_up_is_never_a_stall() -> None:
    dog = _dog(stall_timeout_s=5)
    dog.observe(0, {A: (0, 3)}, {A: 3})
    assert dog.observe(100, {A: (0, 3)}, {A: 3}).state == RUNNING
    # new input arrives: the stall clock starts at the last caught-up read
    assert dog.observe(103, {A: (0, 5)}, {A: 3}).state == RUNNING
    assert dog.observe(106, {A: (0, 5)}, {A: 3}).state == STALLED


def test_broker_time_is_not_idle_time_but_is_bounded() -> None:
    dog = _dog(drain=True, stall_timeout_s=1000, broker_timeout_s=30)
    dog.observe(0, {A: (0, 3)}, {A: 3})
    assert dog.broker_failed(20, "down").state == RUNNING  # never "idle, so done"
    verdict = dog.broker_failed(31, "down")
    assert verdict.state == BROKER_LOST and verdict.exit_code == 4
    # once back, the broker clock restarts
    dog2 = _dog(broker_timeout_s=30)
    dog2.broker_failed(20, "down")
    dog2.observe(25, {A: (0, 3)}, {A: 3})
    assert dog2.broker_failed(50, "down").state == RUNNING


def test_drain_timeout_exits_non_zero_with_lag() -> None:
    dog = _dog(drain=True, drain_timeout_s=10, stall_timeout_s=100)
    for t in range(10):
        assert dog.observe(t, {A: (0, 100)}, {A: t}).state == RUNNING
    verdict = dog.observe(11, {A: (0, 100)}, {A: 11})
    assert verdict.state == DRAIN_TIMEOUT and verdict.exit_code == 5


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="stall_timeout_s"):
        WatchdogConfig(stall_timeout_s=0)
    with pytest.raises(ConfigError, match="drain_timeout_s"):
        WatchdogConfig(drain_timeout_s=-1)


def test_health_file_round_trip_and_line(tmp_path: Path) -> None:
    dog = _dog()
    dog.observe(0, {A: (0, 10)}, {A: 4})
    record = dog.health(1000.0, 5.0, kind="streams", name="g", pid=42,
                        agents={"capture": "running", "dedup": "crashed"})
    write_health(tmp_path, record)
    [back] = read_health(tmp_path, "streams")
    assert back["lag_by_partition"] == {"t[0]": 6} and back["last_progress_at"] == 995.0
    line = format_health(back, 1010.0, alive=True)
    assert line.startswith("g pid=42 up lag=6 processed=0 progress=15s-ago broker=ok")
    assert "agents=1/2 running (dedup=crashed)" in line
    assert read_health(tmp_path, "replay") == []


def test_records_held_for_a_boundary_are_not_a_stall() -> None:
    dog = _dog(stall_timeout_s=10)
    dog.observe(0, {A: (0, 10)}, {A: 4}, consumed={A: 6})
    assert dog.observe(5, {A: (0, 10)}, {A: 4}, consumed={A: 10}).state == RUNNING
    # all consumed, commit waits (open block): never stalled
    assert dog.observe(100, {A: (0, 10)}, {A: 4}, consumed={A: 10}).state == RUNNING
    # new records that are not read: a stall
    assert dog.observe(105, {A: (0, 12)}, {A: 4}, consumed={A: 10}).state == RUNNING
    assert dog.observe(111, {A: (0, 12)}, {A: 4}, consumed={A: 10}).state == STALLED


def test_read_offsets_that_move_are_progress_between_commits() -> None:
    dog = _dog(stall_timeout_s=10)
    dog.observe(0, {A: (0, 1000)}, {A: 4}, read={A: 100})
    # no commit for 24 s, but the worker keeps reading: busy, not stalled
    for t, offset in ((8, 300), (16, 500), (24, 700)):
        assert dog.observe(t, {A: (0, 1000)}, {A: 4}, read={A: offset}).state == RUNNING
    # reading stopped too: a stall once the timeout passed since the last read moved
    assert dog.observe(30, {A: (0, 1000)}, {A: 4}, read={A: 700}).state == RUNNING
    assert dog.observe(35, {A: (0, 1000)}, {A: 4}, read={A: 700}).state == STALLED


def test_everything_read_does_not_excuse_commits_that_never_come() -> None:
    dog = _dog(stall_timeout_s=10)
    dog.observe(0, {A: (0, 10)}, {A: 4}, read={A: 9})
    assert dog.observe(5, {A: (0, 10)}, {A: 4}, read={A: 9}).state == RUNNING
    assert dog.observe(11, {A: (0, 10)}, {A: 4}, read={A: 9}).state == STALLED
