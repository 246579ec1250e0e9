"""Runtime identities known to a worker: the compacted identities topic, read into memory.

Every worker needs every identity (capture records of any partition may name any of
them), so each worker reads the whole identities topic itself at start and again, at
most once per ``refresh_interval_s`` per unknown id, when a record names an identity it
has not seen. The runtime publishes an identity before any record that uses it, so a
refresh that reaches the topic's end either finds it or proves it unknown.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import MutableMapping

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.exceptions import SchemaError
from hebrus_flywheel.streams.exceptions import PublishValidationError
from hebrus_flywheel.streams.processors.exceptions import WorkerError
from hebrus_flywheel.streams.rules import IdentityRules
from hebrus_flywheel.streams.validation import validate_identity

log = logging.getLogger(__name__)


class IdentityBook:
    """``identity_id -> IdentityRules`` (None for a published but refused identity)."""

    def __init__(
        self,
        *,
        bootstrap: str,
        topic: str,
        refresh_interval_s: float = 5.0,
        timeout_s: float = 10.0,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.refresh_interval_s = refresh_interval_s
        self.timeout_s = timeout_s
        self.identities: MutableMapping[str, IdentityRules | None] = {}
        self._misses: dict[str, float] = {}

    def load(self) -> int:
        """Read the identities topic from the beginning to its current end."""
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"flywheel-identities-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "logger": logging.getLogger("streams.librdkafka"),
            }
        )
        try:
            return self._read_to_end(consumer)
        except KafkaException as exc:
            raise WorkerError(
                f"cannot read identities from {self.topic} on {self.bootstrap}: {exc}; check "
                "that the broker runs and the topic exists (`flywheel topics create`)"
            ) from exc
        finally:
            consumer.close()

    def _read_to_end(self, consumer: Consumer) -> int:
        metadata = consumer.list_topics(self.topic, timeout=self.timeout_s).topics.get(self.topic)
        if metadata is None or metadata.error is not None:
            raise WorkerError(f"identities topic {self.topic} does not exist; create the topics")
        ends = {}
        for p in metadata.partitions:
            _, high = consumer.get_watermark_offsets(TopicPartition(self.topic, p), self.timeout_s)
            ends[p] = high
        pending = {p for p, high in ends.items() if high > 0}
        consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in pending])
        deadline = time.monotonic() + self.timeout_s
        read = 0
        while pending and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            read += self._apply(msg.value())
            if (msg.offset() or 0) + 1 >= ends[msg.partition() or 0]:
                pending.discard(msg.partition())
        return read

    def _apply(self, value: bytes | None) -> int:
        if not value:
            return 0
        try:
            _, record = codec.decode(value)
            geometry = validate_identity(record)
        except (SchemaError, PublishValidationError, KeyError, TypeError):
            record_id = locals().get("record", {}).get("identity_id")
            if isinstance(record_id, str):
                self.identities.setdefault(record_id, None)
            return 0
        self.identities[geometry.identity_id] = geometry
        return 1

    def resolve(self, identity_id: str) -> None:
        """Re-read the topic for an unknown id (rate-limited per id)."""
        now = time.monotonic()
        if now - self._misses.get(identity_id, -1e9) < self.refresh_interval_s:
            return
        self._misses[identity_id] = now
        log.info("identity %s not known yet; re-reading %s", identity_id, self.topic)
        self.load()
