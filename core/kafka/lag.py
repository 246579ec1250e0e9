"""Read a group's lag: end watermarks and committed offsets, through the retry policy.

:class:`LagProbe` keeps one consumer of the group that never joins it (it only asks
for offsets), so a worker can watch its own group's progress from a side thread.
"""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import KafkaException

from hebrus_flywheel.core.kafka.clients import LIBRDKAFKA_LOG, make_consumer
from hebrus_flywheel.core.kafka.config import KafkaClientConfig
from hebrus_flywheel.core.kafka.io import TP, _io_error, committed, watermarks


class LagProbe:
    """End watermarks of ``topics`` and ``group_id``'s committed offsets on them."""

    def __init__(self, config: KafkaClientConfig, group_id: str, topics: Iterable[str], *,
                 timeout_s: float = 5.0, log_name: str = LIBRDKAFKA_LOG) -> None:
        self.config, self.group_id, self.topics = config, group_id, list(topics)
        self.timeout_s = timeout_s
        self.consumer = make_consumer(config, group_id=group_id, log_name=log_name)

    def read(self) -> tuple[dict[TP, tuple[int, int]], dict[TP, int]]:
        """(watermarks, committed) of every input partition; raises
        :class:`~hebrus_flywheel.core.kafka.errors.KafkaIOError` when the broker does
        not answer within the retry policy."""
        retry = self.config.retry
        try:
            ends = watermarks(self.consumer, self.topics, retry=retry, timeout_s=self.timeout_s)
            done = committed(self.consumer, list(ends), retry=retry, timeout_s=self.timeout_s,
                             group_id=self.group_id)
        except KafkaException as exc:
            raise _io_error(f"reading the lag of group {self.group_id}", exc) from exc
        return ends, done

    def close(self) -> None:
        self.consumer.close()
