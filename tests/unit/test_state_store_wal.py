"""The tables' RocksDB databases write without a write-ahead log (the changelog is the
table's log), and flush their memtables when faust lets a database go, so a clean stop
or a revocation leaves everything on disk (streams.processors.state_store)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from faust.streams import _current_event
from faust.types import TP

from hebrus_flywheel.streams.processors import state_store
from tests.support.tables import close_databases, sealed_table

VALUE = {"routes": bytes(range(256)) * 40, "first": 0}  # ~10 KB
KEYS = [f"o:thread-{i}:r0" for i in range(50)]


class _Event:
    def __init__(self, partition: int) -> None:
        self.message = SimpleNamespace(partition=partition)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    token = _current_event.set(weakref.ref(_EVENT))  # type: ignore[arg-type]  # faust routes by it
    try:
        yield loop
    finally:
        _current_event.reset(token)
        loop.close()
        asyncio.set_event_loop(None)


_EVENT = _Event(0)


def _table(datadir: Path) -> Any:
    return sealed_table("store-wal", datadir)


def _files(datadir: Path, suffix: str) -> list[Path]:
    return [p for p in datadir.rglob(f"*{suffix}") if p.is_file()]


@pytest.mark.parametrize("wal", [False, True])
def test_writes_skip_the_write_ahead_log(tmp_path: Path, loop: Any, wal: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_store, "WRITE_AHEAD_LOG", wal)
    table = _table(tmp_path)
    try:
        for key in KEYS:
            table.data[key] = VALUE
        logged = sum(p.stat().st_size for p in _files(tmp_path, ".log") if p.name != "LOG")
        assert (logged > len(KEYS) * 10_000) is wal, logged
    finally:
        close_databases(table)


def test_a_stop_leaves_every_write_on_disk(tmp_path: Path, loop: Any) -> None:
    table = _table(tmp_path)
    for key in KEYS:
        table.data[key] = VALUE
    assert not _files(tmp_path, ".sst")  # all in the memtable so far
    held = table.data._dbs[0]  # a reference left elsewhere: dropping it closes nothing
    loop.run_until_complete(table.data.stop())
    assert _files(tmp_path, ".sst")
    held.close()
    again = _table(tmp_path)
    try:
        assert all(again.data[key] == VALUE for key in KEYS)
    finally:
        close_databases(again)


def test_a_revocation_flushes_the_revoked_partitions(tmp_path: Path, loop: Any) -> None:
    table = _table(tmp_path)
    try:
        for key in KEYS:
            table.data[key] = VALUE
        changelog = table.changelog_topic.get_topic_name()
        held = table.data._dbs[0]  # a reference left elsewhere: dropping it closes nothing
        table.data.revoke_partitions(table, {TP("other-topic", 0)})
        assert not _files(tmp_path, ".sst")  # not a changelog partition of this table
        table.data.revoke_partitions(table, {TP(changelog, 0)})
        assert _files(tmp_path, ".sst")
        assert 0 not in table.data._dbs
        held.close()
    finally:
        close_databases(table)
