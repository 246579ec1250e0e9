"""Small Kafka reads shared by seal, parity and rebuild: end offsets, group commits, ranges."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from hebrus_flywheel.consumers.exceptions import ConsumersError

_LOGGER = logging.getLogger("consumers.librdkafka")


def _consumer(bootstrap: str, group_id: str | None = None) -> Consumer:
    return Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": group_id or f"flywheel-reader-{uuid.uuid4().hex}",
        "enable.auto.commit": False, "enable.auto.offset.store": False,
        "isolation.level": "read_committed", "logger": _LOGGER,
    })


def end_offsets(bootstrap: str, topics: Iterable[str], *, timeout_s: float = 15.0,
                error: type[ConsumersError] = ConsumersError) -> dict[str, dict[int, int]]:
    """High watermark of every partition of ``topics`` (each must exist)."""
    consumer = _consumer(bootstrap)
    try:
        out: dict[str, dict[int, int]] = {}
        for topic in topics:
            meta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                raise error(f"topic {topic} does not exist on {bootstrap}; create the catalogue "
                            "(`flywheel topics create`) or fix --prefix")
            out[topic] = {p: consumer.get_watermark_offsets(TopicPartition(topic, p),
                                                            timeout=timeout_s)[1]
                          for p in sorted(meta.partitions)}
        return out
    except KafkaException as exc:
        raise error(f"cannot read end offsets from {bootstrap}: {exc}; is the broker up?") from exc
    finally:
        consumer.close()


def committed_offsets(bootstrap: str, group_id: str, partitions: Iterable[tuple[str, int]],
                      *, timeout_s: float = 15.0,
                      error: type[ConsumersError] = ConsumersError) -> dict[tuple[str, int], int]:
    """The group's committed offset per (topic, partition); -1 where none is committed."""
    consumer = _consumer(bootstrap, group_id)
    try:
        tps = [TopicPartition(t, p) for t, p in partitions]
        got = consumer.committed(tps, timeout=timeout_s) if tps else []
        return {(tp.topic, tp.partition): tp.offset if tp.offset >= 0 else -1 for tp in got}
    except KafkaException as exc:
        raise error(f"cannot read the committed offsets of group {group_id}: {exc}") from exc
    finally:
        consumer.close()


def read_ranges(bootstrap: str, ranges: Mapping[tuple[str, int], tuple[int, int]], *,
                timeout_s: float = 120.0,
                error: type[ConsumersError] = ConsumersError) -> Iterator[Any]:
    """Every message with ``start <= offset < end`` per (topic, partition), in partition order.

    Messages of different partitions interleave. A range is done at the first offset at
    or past its end, so compacted gaps never stall it. Raises ``error`` when a range is not
    complete within ``timeout_s`` of the last message received.
    """
    pending = {tp: r for tp, r in ranges.items() if r[1] > r[0]}
    if not pending:
        return
    consumer = _consumer(bootstrap)
    try:
        consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _) in pending.items()])
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise error(f"timed out reading {sorted(pending)} (ranges {pending}); the "
                            "topics may have been truncated or the broker is unreachable")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err, offset = msg.error(), msg.offset()
            if err is not None:
                if err.fatal():
                    raise error(f"fatal Kafka error while reading: {err}")
                continue
            key = (str(msg.topic()), int(msg.partition() or 0))
            if offset is None or key not in pending:
                continue
            deadline = time.monotonic() + timeout_s
            if offset < pending[key][1]:
                yield msg
            # Offsets arrive in order, so once one reaches the end nothing below it is
            # left (on a compacted topic the records just below the end may be gone).
            if offset + 1 >= pending[key][1]:
                del pending[key]
                consumer.pause([TopicPartition(*key)])
    except KafkaException as exc:
        raise error(f"cannot read source topics from {bootstrap}: {exc}") from exc
    finally:
        consumer.close()
