"""Tombstones for one owner's state in the stream workers' tables.

The stream workers keep their state in faust tables backed by compacted changelog
topics ``<prefix><group>-capture-state-changelog`` and ``...-dedup-state-changelog``
(:mod:`streams.processors.app`). Every key that holds an owner's state names the owner:
capture state is keyed by the thread instance ``owner␟thread␟generation`` (headers
``h␟``, turns ``t␟``, observations ``o␟``), dedup state by the instance (decisions
``d␟``) or by ``owner/thread`` (sticky splits ``s␟``); the band-partitioned dedup's
tables (``…-dedup-bands-changelog``, ``…-dedup-homes-changelog``) by the instance too
(``q␟ p␟ d␟ g␟ u␟ k␟``); producer counters (``c␟``), marks and clocks (``m␟ n␟``) hold
no owner. Erasure reads each changelog to its end, takes
the owner's keys and produces a ``None`` value for each live one to the partition it was
read from, so compaction drops the state and a restoring worker forgets it.

Counted are the owner's *keys*, live or already tombstoned, so a rerun after a crash
reports the same number (while the broker keeps tombstones: ``delete.retention.ms``).

Limits: a running stream worker holds its tables in memory and reads the changelog only
on start, so it must be stopped (or restarted) around the erasure, or it may write the
owner's state again. The old records stay in the changelog's log segments until the
broker compacts them (closed segments only); the threads and decisions topics are
``delete``-policy topics, which tombstones cannot edit: their copies age out with the
topic retention (and are sealed under the owner's data key once capture sealing is in).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from hebrus_flywheel.consumers.supersede import EraseError
from hebrus_flywheel.core import kafka

# one definition: erase must tombstone exactly the keys whose values the workers seal
from hebrus_flywheel.streams.processors.state_seal import owner_of_key

# streams.processors.app's CAPTURE_TABLE and DEDUP_TABLE, and the band-partitioned
# dedup's BAND_TABLE and HOME_TABLE (streams.processors.band_agents; those modules
# import faust; tests/unit/test_erasure.py checks the names agree)
TABLES: tuple[str, ...] = ("capture-state", "dedup-state", "dedup-bands", "dedup-homes")
CHANGELOG_SUFFIXES: tuple[str, ...] = tuple(f"-{t}-changelog" for t in TABLES)


def table_key(raw: bytes | None) -> str:
    """A faust table key: JSON-encoded (the table's key serializer) or raw UTF-8."""
    data = raw or b""
    if data.startswith(b'"'):
        try:
            text = json.loads(data)
        except ValueError:
            text = None
        if isinstance(text, str):
            return text
    return data.decode("utf-8", "replace")


def changelog_topics(target: kafka.KafkaTarget, prefix: str = "") -> list[str]:
    """Every stream-table changelog topic on the cluster (names starting with ``prefix``)."""
    admin = kafka.make_admin(kafka.client_config(target), log_name=__name__)
    try:
        names = admin.list_topics(timeout=15).topics
    except Exception as exc:  # librdkafka raises KafkaException subclasses
        raise EraseError(f"cannot list the topics to find the stream changelogs: {exc}; is "
                         "the broker up (`flywheel broker status`)?") from exc
    return sorted(n for n in names if n.startswith(prefix)
                  and any(n.endswith(s) for s in CHANGELOG_SUFFIXES))


def _live_owner_keys(target: kafka.KafkaTarget, topic: str,
                     owner: str) -> tuple[set[tuple[int, bytes]], set[tuple[int, bytes]]]:
    """(every key of ``owner`` seen, those whose latest value is not a tombstone)."""
    seen: set[tuple[int, bytes]] = set()
    live: set[tuple[int, bytes]] = set()
    try:
        for msg in kafka.read_to_end(kafka.client_config(target), [topic], missing_ok=True,
                                     log_name=__name__):
            raw = msg.key()
            if raw is None or owner_of_key(table_key(raw)) != owner:
                continue
            where = (int(msg.partition() or 0), bytes(raw))
            seen.add(where)
            (live.add if msg.value() is not None else live.discard)(where)
    except kafka.KafkaIOError as exc:
        raise EraseError(f"cannot read the changelog {topic}: {exc}") from exc
    return seen, live


def tombstone_owner(target: kafka.KafkaTarget, owner: str,
                    topics: Iterable[str]) -> dict[str, dict[str, int]]:
    """Tombstone every live key of ``owner`` in ``topics``; per topic the owner's keys
    and the tombstones written by this call."""
    out: dict[str, dict[str, int]] = {}
    errors: list[str] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(f"{msg.topic()}[{msg.partition()}]: {err}")

    producer = kafka.make_producer(kafka.client_config(target), log_name=__name__)
    for topic in topics:
        seen, live = _live_owner_keys(target, topic, owner)
        for partition, key in sorted(live):
            producer.produce(topic, key=key, value=None, partition=partition,
                             on_delivery=on_delivery)
            producer.poll(0)
        out[topic] = {"owner_keys": len(seen), "tombstones_written": len(live)}
    left = producer.flush(60)
    if left or errors:
        raise EraseError(f"tombstones were not all acknowledged ({len(errors)} failed: "
                         f"{'; '.join(errors[:3])}; {left} outstanding); check the broker "
                         "and run `flywheel erase` again (it resumes)")
    return out
