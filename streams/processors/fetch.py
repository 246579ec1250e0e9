"""The worker's consumer: faust's aiokafka consumer group, with a short broker-side fetch
wait, and the capture topics read through librdkafka.

**Fetch wait.** faust builds its aiokafka consumer with ``fetch_max_wait_ms=1500``, a
constant. aiokafka keeps at most one fetch request in flight per broker, and leaves a
partition out of the next request while records it fetched earlier are still waiting to
be consumed; once they have waited ``prefetch_backoff`` (0.1 s), it sends the next
request with the other partitions only. A worker that is busy with one fetch for longer
than that (every worker draining a backlog is) therefore asks the broker for its *idle*
partitions (ticks, standby changelogs, an empty decisions partition): the broker holds
such a request until data arrives or the wait runs out, and until it answers, the busy
partitions cannot be fetched again. The worker's capture then advances in bursts, up to
1.5 s apart; with a standby replica, the worker holding it advanced about every other
second (``bench/streams.py``, 2026-12-05). :data:`FETCH_MAX_WAIT_MS` bounds that stall.
The price is an empty fetch request per broker every :data:`FETCH_MAX_WAIT_MS` while
the worker is idle.

**Capture through librdkafka** (:class:`CaptureFetchThread`). The capture topics are
most of what a worker reads (a chunk's routes are hundreds of KB), and aiokafka reads
them in Python: its fetch thread (TLS records, response parsing, record unpacking) took
1.4 CPU s of a 4.4 s one-worker drain and held the GIL the agents need (py-spy,
2026-12-06). So the capture partitions faust assigns this worker are read by a
confluent-kafka consumer (librdkafka: C threads, C TLS) inside faust's consumer thread,
while aiokafka stays the group member: faust's assignor, heartbeats, commits,
changelogs, standbys and every other topic are unchanged. The librdkafka consumer never
joins a group or commits. It is assigned the capture partitions faust marks active, each
at aiokafka's position (the committed offset, or wherever faust seeked it), and aiokafka
is paused on them. Its records reach faust in aiokafka's record shape
(:class:`CaptureRecord`), so faust acks and commits their offsets as before. A revoked
partition is unassigned before faust's revocation runs; a seek hands the partition back
to aiokafka's position.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import confluent_kafka
import faust
from aiokafka.structs import TopicPartition as AIOKafkaTP
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.transport.drivers.aiokafka import Transport as AIOKafkaTransport

from hebrus_flywheel.core.kafka.retry import RetryPolicy
from hebrus_flywheel.streams.processors.declare import RetryingDeclare
from hebrus_flywheel.streams.processors.exceptions import WorkerError

if TYPE_CHECKING:
    from hebrus_flywheel.core.kafka.config import KafkaClientConfig
    from hebrus_flywheel.streams.processors.topology import StreamTopics

log = logging.getLogger(__name__)

FETCH_MAX_WAIT_MS = 100
"""Longest the broker holds a fetch of partitions without data (faust's constant: 1500)."""

POLL_SLICE_S = 0.005
"""The first wait on aiokafka while the capture partitions have nothing either; each
further empty wait of one fetch doubles, up to :data:`POLL_SLICE_MAX_S`."""
POLL_SLICE_MAX_S = 0.05
"""Longest a capture record arriving at an idle worker waits to be taken (an idle worker
polled every 5 ms took 1.7 % of a core more than with aiokafka alone)."""


CAPTURE_FETCH_WAIT_MS = 500
"""Longest the broker holds librdkafka's fetch of capture partitions without data. Unlike
aiokafka's fetches (:data:`FETCH_MAX_WAIT_MS`), these hold capture partitions only, and the
broker answers as soon as any of them has a record: the wait is paid only while every
one is idle, as one empty fetch per broker and wait."""

PREFETCH_KBYTES = 32_768
"""Most capture bytes librdkafka holds fetched ahead of the agents (its default: 64 MiB)."""

PREFETCH_BACKOFF_MS = 10
"""How long librdkafka waits to fetch again once that much is held. Its default, 1,000 ms,
stalled a fast reader: capture records are ~70 KB, so the prefetch fills in a few hundred
records, and a faust agent that only counts them then waited a second per refill
(``bench/streams.py``: 1.3 s wall for 0.6 CPU s over 159 MB)."""


class PromptConsumerThread(AIOKafkaConsumerThread):
    """faust's consumer thread whose aiokafka consumer waits at most
    :data:`FETCH_MAX_WAIT_MS` for a fetch."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # aiokafka reads it when the consumer starts (its Fetcher is built in start())
        if not isinstance(getattr(consumer, "_fetch_max_wait_ms", None), int):
            raise WorkerError("aiokafka's consumer no longer keeps _fetch_max_wait_ms: "
                              "streams.processors.fetch must follow the installed aiokafka")
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


@dataclass(frozen=True, kw_only=True)
class CaptureFetch:
    """Which topics a worker reads through librdkafka, with which client settings."""

    librdkafka: dict[str, Any]
    """The confluent-kafka client config: bootstrap list, security, the user's properties."""
    topics: frozenset[str]
    """The capture topics (transcripts and observations)."""

    def __post_init__(self) -> None:
        if not self.librdkafka.get("bootstrap.servers"):
            raise ValueError("CaptureFetch.librdkafka: wants bootstrap.servers")
        if not self.topics:
            raise ValueError("CaptureFetch.topics: wants at least one topic")

    @classmethod
    def of(cls, client: KafkaClientConfig, topics: StreamTopics) -> CaptureFetch:
        """The capture fetch of a worker (or bench app) with ``client``'s settings."""
        return cls(librdkafka=client.librdkafka(),
                   topics=frozenset((topics.transcripts, topics.observations)))

    def consumer_config(self, group: str) -> dict[str, Any]:
        """The librdkafka consumer's config. ``group`` is required by librdkafka but never
        joined: partitions are assigned by hand and faust commits (through aiokafka)."""
        return {**self.librdkafka, "group.id": group, "enable.auto.commit": False,
                "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": CAPTURE_FETCH_WAIT_MS,
                "queued.max.messages.kbytes": PREFETCH_KBYTES,
                "fetch.queue.backoff.ms": PREFETCH_BACKOFF_MS}


class CaptureRecord(NamedTuple):
    """A librdkafka message in the shape of aiokafka's ``ConsumerRecord``, the shape
    faust's aiokafka driver turns into a ``ConsumerMessage``."""

    topic: str
    partition: int
    offset: int
    timestamp: int | None
    timestamp_type: int
    key: bytes | None
    value: bytes | None
    checksum: None
    serialized_key_size: int
    serialized_value_size: int
    headers: tuple[tuple[str, bytes], ...]

    @classmethod
    def of(cls, msg: Any) -> CaptureRecord:
        ts_type, ts = msg.timestamp()
        key, value = msg.key(), msg.value()
        known = ts_type != confluent_kafka.TIMESTAMP_NOT_AVAILABLE
        return cls(msg.topic(), msg.partition(), msg.offset(), ts if known else None,
                   # librdkafka numbers create time 1 and log-append time 2; Kafka 0 and 1
                   ts_type - 1 if known else -1,
                   key, value, None, len(key) if key else 0, len(value) if value else 0,
                   tuple(msg.headers() or ()))


STOPPING_ERRORS = frozenset((
    confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED,
    confluent_kafka.KafkaError.GROUP_AUTHORIZATION_FAILED,
    confluent_kafka.KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    confluent_kafka.KafkaError.SASL_AUTHENTICATION_FAILED,
    confluent_kafka.KafkaError._AUTHENTICATION,
    confluent_kafka.KafkaError._SSL,
))
"""librdkafka errors that stop the worker: waiting cannot mend them. Every other one
(a broker down, a leader moving, a timeout) is logged; librdkafka reconnects and
fetches again by itself, as aiokafka does for the worker's other topics."""


def _check(err: confluent_kafka.KafkaError) -> None:
    """Raise for an error :data:`STOPPING_ERRORS` names or librdkafka calls fatal; log
    the others."""
    if err.fatal() or err.code() in STOPPING_ERRORS:
        raise WorkerError(f"reading the capture topics through librdkafka: {err.str()} "
                          "(check the streams role's credentials and topic ACLs)")
    if err.code() != confluent_kafka.KafkaError._PARTITION_EOF:
        log.warning("capture fetch through librdkafka: %s (it retries)", err.str())


def _rd(tp: Any, offset: int | None = None) -> confluent_kafka.TopicPartition:
    if offset is None:
        return confluent_kafka.TopicPartition(tp.topic, tp.partition)
    return confluent_kafka.TopicPartition(tp.topic, tp.partition, offset)


class CaptureFetchThread(PromptConsumerThread):
    """faust's consumer thread reading the capture partitions through librdkafka (see
    the module docstring); an app without ``capture_fetch`` reads all through aiokafka."""

    _capture: Any = None  # the confluent_kafka.Consumer, made on the first fetch
    _topics: frozenset[str]  # the capture topics it reads
    _next: dict[Any, int]  # assigned capture partition -> next offset to hand faust
    _moved: set[Any]  # partitions faust seeked since: reassigned at aiokafka's position

    def _capture_fetch(self) -> CaptureFetch | None:
        spec: CaptureFetch | None = getattr(self.app, "capture_fetch", None)
        if spec is not None and self._capture is None:
            self._topics, self._next, self._moved = spec.topics, {}, set()
            self._capture = confluent_kafka.Consumer({
                **spec.consumer_config(f"{self.app.conf.id}-capture"),
                "error_cb": self._on_client_error})
            self._client_error: confluent_kafka.KafkaError | None = None
        return spec

    async def _fetch_records(self, consumer: Any, active_partitions: Any,
                             timeout: float | None = None,
                             max_records: int | None = None) -> Any:
        spec = self._capture_fetch()
        if spec is None or not self.consumer.flow_active:
            return await super()._fetch_records(consumer, active_partitions,
                                                timeout=timeout, max_records=max_records)
        held = [tp for tp in consumer.assignment() if tp.topic in spec.topics]
        if held:  # idempotent: aiokafka never fetches a capture partition
            consumer.pause(*held)
        active = set(active_partitions or ())
        wanted = {tp for tp in active if tp.topic in spec.topics}
        await self._assign(consumer, wanted)
        rest, limit = active - wanted, max_records or 500
        deadline, slice_s = time.monotonic() + (timeout or 0.0), POLL_SLICE_S
        while True:
            records = self._take(wanted, limit) if wanted else {}
            wait = 0.0 if records else max(0.0, min(deadline - time.monotonic(), slice_s))
            other = await super()._fetch_records(consumer, rest, timeout=wait,
                                                 max_records=limit)
            if other:
                records.update(other)
            # faust's fetch returns {} at once while its flow is stopped (a rebalance, a
            # shutdown): asking again until the deadline spun ~200,000 times a second
            if records or time.monotonic() >= deadline or not self.consumer.flow_active:
                return records
            slice_s = min(2 * slice_s, POLL_SLICE_MAX_S)

    async def _assign(self, consumer: Any, wanted: set[Any]) -> None:
        """Make the librdkafka assignment the capture partitions faust wants now."""
        drop = [tp for tp in self._next if tp not in wanted or tp in self._moved]
        if drop:
            self._capture.incremental_unassign([_rd(tp) for tp in drop])
            assigned = consumer.assignment()
            for tp in drop:
                next_offset = self._next.pop(tp)
                back = AIOKafkaTP(tp.topic, tp.partition)
                if tp not in self._moved and back in assigned:
                    consumer.seek(back, next_offset)  # paused by faust: resume from here
            self._moved.difference_update(drop)
        add = [tp for tp in wanted if tp not in self._next]
        if add:
            parts = []
            for tp in add:  # aiokafka is paused there already (_fetch_records)
                self._next[tp] = await consumer.position(AIOKafkaTP(tp.topic, tp.partition))
                parts.append(_rd(tp, self._next[tp]))
            self._capture.incremental_assign(parts)
            log.info("capture partitions read through librdkafka from %s",
                     {f"{p.topic}[{p.partition}]": p.offset for p in parts})

    def _on_client_error(self, err: confluent_kafka.KafkaError) -> None:
        # librdkafka calls this inside consume(), where an exception would be lost
        try:
            _check(err)
        except WorkerError:
            self._client_error = err

    def _take(self, wanted: set[Any], limit: int) -> dict[Any, list[CaptureRecord]]:
        """What librdkafka has fetched already (never waits), as faust's record map."""
        if self._client_error is not None:
            _check(self._client_error)
        by_key = {(tp.topic, tp.partition): tp for tp in wanted}
        records: dict[Any, list[CaptureRecord]] = {}
        for msg in self._capture.consume(num_messages=limit, timeout=0):
            err = msg.error()
            if err is not None:
                _check(err)
                continue
            tp = by_key.get((msg.topic(), msg.partition()))
            if tp is None or msg.offset() < self._next.get(tp, 0):
                continue  # unassigned, or seeked back since librdkafka fetched it
            records.setdefault(tp, []).append(CaptureRecord.of(msg))
            self._next[tp] = msg.offset() + 1
        return records

    def highwater(self, tp: Any) -> int:
        if self._capture is None or tp.topic not in self._topics:
            return super().highwater(tp)
        # aiokafka is paused there and learns no highwater; librdkafka's last fetch does
        _, high = self._capture.get_watermark_offsets(_rd(tp), cached=True)
        return None if high < 0 else high  # type: ignore[return-value]  # unknown: None

    def seek(self, partition: Any, offset: int) -> None:
        super().seek(partition, offset)
        self._moved_to_aiokafka([partition])

    async def _seek_wait(self, consumer: Any, partitions: Any) -> None:
        await super()._seek_wait(consumer, partitions)
        self._moved_to_aiokafka(partitions)

    async def seek_to_committed(self) -> Any:
        offsets = await super().seek_to_committed()
        self._moved_to_aiokafka(list(getattr(self, "_next", ())))
        return offsets

    def _moved_to_aiokafka(self, partitions: Any) -> None:
        if self._capture is not None:
            self._moved.update(tp for tp in partitions if tp in self._next)

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if self._capture is not None:
            gone = [tp for tp in self._next if tp in revoked]
            if gone:  # before faust's revocation: nothing of theirs is handed out after
                self._capture.incremental_unassign([_rd(tp) for tp in gone])
                for tp in gone:
                    del self._next[tp]
                    self._moved.discard(tp)
        await super().on_partitions_revoked(revoked)

    async def on_thread_stop(self) -> None:
        await super().on_thread_stop()
        if self._capture is not None:
            self._capture.close()
            self._capture = None


class PromptConsumer(AIOKafkaConsumer):
    def _new_consumer_thread(self) -> CaptureFetchThread:
        return CaptureFetchThread(self, loop=self.loop, beacon=self.beacon)


class DeclaringTransport(RetryingDeclare, AIOKafkaTransport):
    """faust's aiokafka transport whose topic declarations retry transient failures
    (:mod:`streams.processors.declare`)."""


class PromptTransport(DeclaringTransport):
    """:class:`DeclaringTransport` with :class:`PromptConsumer`."""

    Consumer = PromptConsumer


class WorkerApp(faust.App):
    """The worker's ``faust.App``: consumes through :class:`PromptConsumer`, the capture
    topics through librdkafka once :attr:`capture_fetch` is set."""

    capture_fetch: CaptureFetch | None = None
    declare_retry: RetryPolicy = RetryPolicy()
    """How faust's own topic declarations are retried (the worker's Kafka retry policy)."""

    def _new_transport(self) -> PromptTransport:
        transport = PromptTransport(self.conf.broker_consumer, self)
        transport.declare_retry = self.declare_retry
        return transport

    def _new_producer_transport(self) -> DeclaringTransport:
        # faust declares its topics through the producer's transport, not the consumer's
        transport = DeclaringTransport(self.conf.broker_producer, self)
        transport.declare_retry = self.declare_retry
        return transport
