"""A table read is one RocksDB read: faust's ``Table.__getitem__`` asks ``key in store``
and then reads the key; the sealed store answers the second from what the first read
(streams.processors.state_store)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import faust
import pytest
from faust.streams import _current_event

from hebrus_flywheel.streams.processors.state_seal import StateSealer
from hebrus_flywheel.streams.processors.state_store import (
    ROCKSDB_OPTIONS,
    STORE_URL,
    SealedRocksDBStore,
)


class _Event:
    """What faust's stores read of the current event: the record's partition."""

    def __init__(self, partition: int) -> None:
        self.message = SimpleNamespace(partition=partition)


RUN = "r:thread-a:0"  # a kind the opened-value cache does not keep (route runs)
HEADER = "h:thread-a"  # one it keeps (thread headers)


@pytest.fixture
def table(tmp_path: Path) -> Iterator[Any]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app = faust.App("store-reads", store=STORE_URL, datadir=str(tmp_path), web_enabled=False)
    table = app.Table("t", partitions=1, key_type=str, options=dict(ROCKSDB_OPTIONS))
    store = table.data
    assert isinstance(store, SealedRocksDBStore)
    store.state_sealer = StateSealer(sealer=None, table="t")  # type: ignore[arg-type]  # no owner keys here
    event = _Event(0)
    token = _current_event.set(weakref.ref(event))  # faust routes by the current event
    try:
        yield table
    finally:
        _current_event.reset(token)
        for db in store._dbs.values():
            db.close()
        loop.close()
        asyncio.set_event_loop(None)


def _count(store: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"_get": 0, "_contains": 0}
    for name in calls:
        real = getattr(store, name)

        def counted(key: bytes, _real: Any = real, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(key)

        monkeypatch.setattr(store, name, counted)
    return calls


def test_a_read_is_one_rocksdb_get(table: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    table.data[RUN] = {"routes": "x" * 1000}
    calls = _count(table.data, monkeypatch)
    assert table[RUN] == {"routes": "x" * 1000}
    assert calls == {"_get": 1, "_contains": 0}
    with pytest.raises(KeyError):
        table["r:missing:0"]
    assert calls == {"_get": 2, "_contains": 0}


def test_kept_values_need_no_rocksdb_read(table: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    table.data[HEADER] = {"status": "open"}
    calls = _count(table.data, monkeypatch)
    assert HEADER in table and table[HEADER] == {"status": "open"}
    assert calls == {"_get": 0, "_contains": 0}


def test_a_write_between_the_probe_and_the_read_wins(table: Any) -> None:
    store = table.data  # written directly: a table write also sends a changelog record
    store[RUN] = {"n": 1}
    assert RUN in store  # probes the stored value
    store[RUN] = {"n": 2}
    assert store[RUN] == {"n": 2}  # a read without a probe of its own
    assert RUN in store
    del store[RUN]
    with pytest.raises(KeyError):
        table[RUN]
    assert RUN not in store


def test_a_probe_serves_only_its_own_key(table: Any) -> None:
    store = table.data
    store[RUN], store["r:thread-b:0"] = {"n": 1}, {"n": 2}
    assert RUN in store
    assert store["r:thread-b:0"] == {"n": 2}
    assert store[RUN] == {"n": 1}  # read again, not taken from the other key's probe


def test_without_a_current_event_faust_searches_every_partition(table: Any) -> None:
    table.data[RUN] = {"n": 1}
    token = _current_event.set(None)
    try:
        assert RUN in table.data and "r:missing:0" not in table.data
    finally:
        _current_event.reset(token)
