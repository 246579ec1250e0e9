"""Small Kafka reads shared by seal, parity and rebuild: end offsets, group commits, ranges.

Thin adapters over :mod:`hebrus_flywheel.core.kafka` (which retries and checks every
error) that keep this package's error types.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from hebrus_flywheel.consumers.exceptions import ConsumersError
from hebrus_flywheel.core import kafka

_LOG = "consumers.librdkafka"


def end_offsets(bootstrap: kafka.KafkaTarget, topics: Iterable[str], *, timeout_s: float = 15.0,
                error: type[ConsumersError] = ConsumersError) -> dict[str, dict[int, int]]:
    """High watermark of every partition of ``topics`` (each must exist)."""
    config, topics = kafka.client_config(bootstrap), list(topics)
    try:
        marks = kafka.end_watermarks(config, topics, timeout_s=timeout_s, log_name=_LOG)
    except kafka.KafkaIOError as exc:
        raise error(f"cannot read end offsets from {config.bootstrap_servers}: {exc}") from exc
    out: dict[str, dict[int, int]] = {t: {} for t in topics}
    for (topic, partition), (_, high) in sorted(marks.items()):
        out.setdefault(topic, {})[partition] = high
    return out


def low_offsets(bootstrap: kafka.KafkaTarget, topics: Iterable[str], *, timeout_s: float = 15.0,
                error: type[ConsumersError] = ConsumersError) -> dict[tuple[str, int], int]:
    """Low watermark (earliest offset still on the broker) of every partition of ``topics``;
    above 0 once retention (or ``delete_records``) removed the partition's first records."""
    config, topics = kafka.client_config(bootstrap), list(topics)
    try:
        marks = kafka.end_watermarks(config, topics, timeout_s=timeout_s, log_name=_LOG)
    except kafka.KafkaIOError as exc:
        raise error(f"cannot read the offsets of {', '.join(topics)} from "
                    f"{config.bootstrap_servers}: {exc}") from exc
    return {tp: low for tp, (low, _) in marks.items()}


def committed_offsets(bootstrap: kafka.KafkaTarget, group_id: str,
                      partitions: Iterable[tuple[str, int]], *, timeout_s: float = 15.0,
                      error: type[ConsumersError] = ConsumersError) -> dict[tuple[str, int], int]:
    """The group's committed offset per (topic, partition); -1 where none is committed."""
    try:
        return kafka.committed_offsets(kafka.client_config(bootstrap), group_id, partitions,
                                       timeout_s=timeout_s, log_name=_LOG)
    except kafka.KafkaIOError as exc:
        raise error(f"cannot read the committed offsets of group {group_id}: {exc}") from exc


def read_ranges(bootstrap: kafka.KafkaTarget, ranges: Mapping[tuple[str, int], tuple[int, int]],
                *, timeout_s: float = 120.0,
                error: type[ConsumersError] = ConsumersError) -> Iterator[Any]:
    """Every message with ``start <= offset < end`` per (topic, partition), in partition order.

    Messages of different partitions interleave. A range is done at the first offset at
    or past its end, so compacted gaps never stall it. Raises ``error`` when a range is not
    complete within ``timeout_s`` of the last message received.
    """
    try:
        yield from kafka.read_ranges(kafka.client_config(bootstrap), ranges, timeout_s=timeout_s,
                                     what="reading source topic ranges", log_name=_LOG)
    except kafka.KafkaIOError as exc:
        raise error(f"cannot read source topics: {exc}") from exc
