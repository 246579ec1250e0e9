"""A table changelog is decoded once on restore: the channel faust's table manager reads
it through hands records over undecoded, and the sealed RocksDB store decodes, opens and
refuses them (streams.processors.state_codec, streams.processors.state_store)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faust.types import TP, Message

from hebrus_flywheel.streams.processors import state_codec
from hebrus_flywheel.streams.processors.state_codec import (
    STATE_CODEC,
    StoreDecodedChangelogTopic,
    dumps,
    refuse_bad_changelog,
)
from tests.support.tables import close_databases, sealed_table

HEADER = "h:thread-a"


class Refused(Exception):
    """Raised instead of ending the process (crash) in these tests."""


@pytest.fixture
def table(tmp_path: Path) -> Iterator[Any]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    table = refuse_bad_changelog(sealed_table("changelog-read", tmp_path))
    try:
        yield table
    finally:
        close_databases(table)
        loop.close()
        asyncio.set_event_loop(None)


def _message(topic: str, offset: int, key: bytes, value: bytes | None) -> Message:
    return Message(topic=topic, partition=0, offset=offset, timestamp=0.0, timestamp_type=0,
                   headers=[], key=key, value=value, checksum=None, tp=TP(topic, 0))


def _read(table: Any, message: Message) -> Any:
    """The event faust's table manager makes of a changelog record."""
    channel = table.changelog_topic.clone_using_queue(asyncio.Queue())
    return asyncio.get_event_loop().run_until_complete(channel.decode(message, propagate=True))


def test_the_changelog_is_read_undecoded_and_written_as_before(table: Any) -> None:
    topic = table.changelog_topic
    assert isinstance(topic, StoreDecodedChangelogTopic)
    # what the table sends is encoded as before: faust passes the table's serializers
    assert (table.key_serializer, table.value_serializer) == ("json", STATE_CODEC)
    assert (topic.key_serializer, topic.value_serializer) == ("json", STATE_CODEC)
    key, value = json.dumps(HEADER).encode(), dumps({"status": "open", "n": 3})
    event = _read(table, _message(topic.get_topic_name(), 7, key, value))
    assert (event.key, event.value) == (key, value)  # bytes: no decode in the channel


def test_a_restored_record_is_decoded_once(table: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store, topic = table.data, table.changelog_topic.get_topic_name()
    decoded: list[bytes] = []
    real = state_codec.loads

    def counted(raw: bytes) -> Any:
        decoded.append(raw)
        return real(raw)

    monkeypatch.setattr(state_codec, "loads", counted)  # every state-codec decode
    value = dumps({"status": "open", "n": 3})
    event = _read(table, _message(topic, 0, json.dumps(HEADER).encode(), value))
    store.apply_changelog_batch([event], table._to_key, table._to_value)
    assert decoded == [value]
    assert store[HEADER] == {"status": "open", "n": 3}  # no current event: every partition


@pytest.mark.parametrize("part", ["key", "value"])
def test_a_record_that_does_not_decode_stops_the_restore(table: Any, part: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store, topic = table.data, table.changelog_topic.get_topic_name()
    lines: list[str] = []

    def refused(what: str, exc: BaseException) -> None:
        lines.append(what)
        raise Refused(what) from exc

    monkeypatch.setattr(state_codec, "crash", refused)
    pickled = pickle.dumps({"status": "open"}, protocol=5)
    key = pickled if part == "key" else json.dumps(HEADER).encode()
    value = pickled if part == "value" else dumps({"status": "open"})
    event = _read(table, _message(topic, 41, key, value))
    with pytest.raises(Refused):
        store.apply_changelog_batch([event], table._to_key, table._to_value)
    assert lines == [f"changelog restore (bad record {part}, refused unread) on {topic}[0]@41"]
    assert HEADER not in store


def test_the_restore_bench_prints_its_figures(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(__file__).resolve().parents[2] / "bench" / "changelog_restore.py"
    spec = importlib.util.spec_from_file_location("bench_changelog_restore", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", [str(path), "--records", "20", "--run-kib", "4",
                                      "--repeat", "1"])
    bench.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["figure"] for line in lines] == [
        "changelog_restore_store_decoded_records_per_s",
        "changelog_restore_channel_decoded_records_per_s",
        "changelog_restore_store_decoded_logged_records_per_s",
        "changelog_restore_store_decoded_sealed_records_per_s",
        "changelog_restore_store_decoded_sealed_opened_records_per_s",
        "changelog_restore_store_to_channel_decoded_ratio",
        "changelog_restore_unlogged_to_logged_ratio",
        "changelog_restore_sealed_checked_to_opened_ratio"]
    assert all(line["value"] > 0 for line in lines)
