"""Table writes coalesced per key within a batch (streams.processors.write_cache): reads
see the cached writes, the table gets each key's last value once per flush, routed as
the event that wrote it, and a key set and deleted within a batch never reaches it."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from types import SimpleNamespace
from typing import Any

import faust
import pytest

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.streams.processors.batches import handling
from hebrus_flywheel.streams.processors.write_cache import WriteCache


class Event:
    def __init__(self, partition: int, offset: int) -> None:
        self.message = SimpleNamespace(topic="cap", partition=partition, offset=offset)


class RoutedTable(MutableMapping[str, Any]):
    """A table that, like faust's, routes each write by the current event; it records
    every write and delete with the partition it was routed to."""

    def __init__(self, **items: Any) -> None:
        self.data = dict(items)
        self.log: list[tuple[str, str, Any, int | None]] = []

    def _partition(self) -> int | None:
        event = faust.current_event()
        return None if event is None else int(event.message.partition)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.log.append(("set", key, value, self._partition()))
        self.data[key] = value

    def __delitem__(self, key: str) -> None:
        self.log.append(("del", key, None, self._partition()))
        del self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def test_each_key_is_written_once_per_flush_with_its_last_value() -> None:
    table = RoutedTable()
    cache = WriteCache(table, name="capture", counters=Counters())
    for offset in range(3):
        with handling(Event(2, offset)):
            header = dict(cache.get("h|o1|t1") or {"records": 0})
            header["records"] += 1
            cache["h|o1|t1"] = header
            cache["c|producer"] = {"counter": offset}
    assert table.log == []  # nothing written before the flush
    assert cache["h|o1|t1"] == {"records": 3}  # reads see the cached writes
    assert cache.flush() == 2
    assert table.log == [("set", "h|o1|t1", {"records": 3}, 2),
                         ("set", "c|producer", {"counter": 2}, 2)]
    assert cache.pending == 0 and cache.flush() == 0


def test_a_write_is_routed_as_the_event_that_made_it() -> None:
    table = RoutedTable()
    cache = WriteCache(table)
    with handling(Event(1, 10)):
        cache["a"] = 1
    with handling(Event(3, 11)):
        cache["b"] = 2
    with handling(Event(0, 12)):  # flushed while another record is current
        cache.flush()
    assert [(key, partition) for _, key, _, partition in table.log] == [("a", 1), ("b", 3)]
    assert faust.current_event() is None


def test_deletes_hide_the_key_and_write_a_tombstone_only_for_stored_keys() -> None:
    table = RoutedTable(old={"x": 1})
    cache = WriteCache(table)
    with handling(Event(0, 1)):
        del cache["old"]
        cache["new"] = {"y": 2}
        del cache["new"]  # set and deleted within the batch: the table never sees it
        with pytest.raises(KeyError):
            del cache["never"]
    assert "old" not in cache and "new" not in cache and cache.get("old") is None
    with pytest.raises(KeyError):
        cache["old"]
    assert "old" in table  # not yet flushed
    cache.flush()
    assert table.log == [("del", "old", None, 0)]
    assert dict(table.data) == {}


def test_iteration_merges_the_cached_writes() -> None:
    table = RoutedTable(a=1, b=2)
    cache = WriteCache(table)
    with handling(Event(0, 1)):
        cache["b"] = 20
        cache["c"] = 3
        del cache["a"]
    assert dict(cache.items()) == {"b": 20, "c": 3}
    assert len(cache) == 2


def test_a_write_outside_any_record_goes_to_the_table_at_once() -> None:
    table = RoutedTable()
    cache = WriteCache(table)
    cache["k"] = 1
    assert table.log == [("set", "k", 1, None)] and cache.pending == 0


def test_discard_drops_the_cached_writes() -> None:
    table = RoutedTable(a=1)
    cache = WriteCache(table)
    with handling(Event(0, 1)):
        cache["a"] = 2
    assert cache.discard() == 1
    assert cache["a"] == 1 and cache.flush() == 0 and table.log == []
