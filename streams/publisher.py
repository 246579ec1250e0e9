"""The capture publisher a decode runtime embeds: validate, encode, enqueue, produce.

``publish_*`` runs on the caller's thread: it validates the record
(:mod:`streams.validation`, which covers every Avro type and range of the schemas it
writes),
stamps ``producer_id`` / ``counter`` / ``wall_time_ms`` when unset, encodes it (Avro
single-object, :mod:`schemas.codec`) and puts the bytes on a bounded in-process queue;
it never waits longer than ``max_block_ms`` for room. A background thread hands the
bytes to an idempotent confluent-kafka producer (``acks=all``) and polls for delivery
reports; it holds the GIL only briefly, so it does not stall a decode loop. When the
queue stays full for ``max_block_ms`` the ``full_policy`` applies and the record is
counted in ``dropped_queue_full``. ``counter`` is consumed by every valid record,
enqueued or dropped, so counter gaps on a topic reveal records dropped here.

Observations are built as ``RouteObservation.v2`` dicts: routes packed as uint16 expert
ids and float32 weights (:mod:`streams.routes`). A runtime builds those fields straight
from its arrays with :func:`streams.routes.pack_routes`; a record with v1 per-layer
routes is still accepted, checked with the same reason codes, and packed here.

Privacy: callers pass raw owner, thread and sequence ids and plaintext tokens; nothing
of them leaves the process. After validation every turn and observation goes through
:class:`streams.sealing.CaptureSealer`: ids become pseudonyms (also in the Kafka key),
token ids and routes are sealed under the owner's data key, and what is encoded is
``TranscriptTurn.v2`` / ``RouteObservation.v3``, whose schemas have no plaintext token or
raw-id field at all. The key store is ``LocalOwnerKeyStore(create=True)`` unless the
caller gives one.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from confluent_kafka import KafkaError, KafkaException, Message

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, OwnerKeyStore
from hebrus_flywheel.core.settings import bootstrap_servers
from hebrus_flywheel.schemas.codec import encode_entry, kafka_headers
from hebrus_flywheel.schemas.exceptions import RecordEncodeError
from hebrus_flywheel.schemas.registry import SchemaRegistry, default_registry
from hebrus_flywheel.streams import routes, validation
from hebrus_flywheel.streams.consent import CONSENT_TOPIC, ConsentCheck
from hebrus_flywheel.streams.consent_book import capture_gate
from hebrus_flywheel.streams.exceptions import (
    PublisherClosedError,
    PublishValidationError,
    QueueFullError,
)
from hebrus_flywheel.streams.rules import IdentityRules
from hebrus_flywheel.streams.sealing import OBSERVATION_V3, TURN_V2, CaptureSealer
from hebrus_flywheel.streams.topics import IDENTITIES_TOPIC, OBSERVATIONS_TOPIC, TRANSCRIPTS_TOPIC

if TYPE_CHECKING:
    from confluent_kafka._types import HeadersType

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger(f"{__name__}.librdkafka")

FULL_POLICIES = ("block_then_drop_newest", "block_then_raise")
COMPRESSIONS = ("lz4", "zstd")
IDENTITY_SCHEMA = "hebrus.flywheel.v1.RuntimeIdentity.v3"
TURN_SCHEMA = TURN_V2
OBSERVATION_SCHEMA = OBSERVATION_V3
_PROTECTED = frozenset({"bootstrap.servers", "enable.idempotence", "acks", "on_delivery",
                        "error_cb", "logger", "client.id"})
_IDLE_POLL_S = 0.02
_T = TypeVar("_T")
_BUFFER_RETRY_S = 0.05


def default_producer_id() -> str:
    """``<host>-<pid>-<random>``: unique per process lifetime, since counters restart at 0."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """Configuration of :class:`RuntimePublisher`.

    Attributes:
        bootstrap_servers: Kafka bootstrap list (default: ``flywheel.settings``).
        identities_topic: topic of ``RuntimeIdentity`` records (keyed by identity id).
        transcripts_topic: topic of ``TranscriptTurn`` records (keyed ``owner/thread``).
        observations_topic: topic of ``RouteObservation`` records (keyed ``owner/thread``).
        producer_id: stamped into records that leave it unset; unique per process.
        queue_capacity: encoded records the in-process queue holds (~3.3 KB each for a
            48x10 observation) before ``publish_*`` waits.
        max_block_ms: longest a ``publish_*`` call waits for the lock and queue space, on
            top of its validate + encode CPU time.
        full_policy: after ``max_block_ms`` of a full queue, ``block_then_drop_newest``
            drops the record (``publish_*`` returns False); ``block_then_raise`` raises
            :class:`QueueFullError`. Both count ``dropped_queue_full``.
        linger_ms: librdkafka ``linger.ms`` (batching delay).
        compression: ``lz4`` or ``zstd``.
        delivery_timeout_ms: librdkafka ``delivery.timeout.ms``; undelivered after that
            counts as failed.
        vocab_size: when set, token ids are checked against ``[0, vocab_size)``.
        close_timeout_s: how long ``close()`` waits for outstanding deliveries.
        producer_overrides: extra librdkafka settings (cannot change idempotence, acks,
            bootstrap or callbacks).
        consent_topic: the consent ledger (:mod:`streams.consent`).
        consent_check: refuse (not publish, count ``refused_no_consent``) every turn and
            observation whose owner has no live ``capture`` grant at its
            ``wall_time_ms``. False is for tests and benchmarks only: the publisher
            then logs a warning at start and every stats snapshot says so
            (``consent_checked=False``).
    """

    bootstrap_servers: str = field(default_factory=lambda: bootstrap_servers(None))
    identities_topic: str = IDENTITIES_TOPIC
    transcripts_topic: str = TRANSCRIPTS_TOPIC
    observations_topic: str = OBSERVATIONS_TOPIC
    producer_id: str = field(default_factory=default_producer_id)
    queue_capacity: int = 10_000
    max_block_ms: float = 5.0
    full_policy: str = "block_then_drop_newest"
    linger_ms: int = 5
    compression: str = "lz4"
    delivery_timeout_ms: int = 120_000
    vocab_size: int | None = None
    close_timeout_s: float = 30.0
    producer_overrides: Mapping[str, Any] = field(default_factory=dict)
    consent_topic: str = CONSENT_TOPIC
    consent_check: bool = True

    def __post_init__(self) -> None:
        for name in ("bootstrap_servers", "identities_topic", "transcripts_topic",
                     "observations_topic", "producer_id", "consent_topic"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"PublisherConfig.{name} must be a non-empty string")
        for name, low in (("queue_capacity", 1), ("max_block_ms", 0), ("linger_ms", 0),
                          ("delivery_timeout_ms", 1), ("close_timeout_s", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"PublisherConfig.{name} must be ≥ {low}, got "
                                  f"{getattr(self, name)}")
        if self.full_policy not in FULL_POLICIES:
            raise ConfigError(f"PublisherConfig.full_policy must be one of {FULL_POLICIES}, "
                              f"got {self.full_policy!r}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"PublisherConfig.compression must be one of {COMPRESSIONS}, "
                              f"got {self.compression!r}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"PublisherConfig.vocab_size must be ≥ 1, got {self.vocab_size}")
        clash = sorted(_PROTECTED & set(self.producer_overrides))
        if clash:
            raise ConfigError(f"PublisherConfig.producer_overrides may not set {clash}; the "
                              "publisher fixes them (idempotent, acks=all, own callbacks)")
        object.__setattr__(self, "producer_overrides",
                           MappingProxyType(dict(self.producer_overrides)))

    def producer_settings(self) -> dict[str, Any]:
        """The librdkafka configuration (without callbacks)."""
        return {
            "bootstrap.servers": self.bootstrap_servers,
            "client.id": f"flywheel-publisher-{self.producer_id}",
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": self.linger_ms,
            "compression.type": self.compression,
            "delivery.timeout.ms": self.delivery_timeout_ms,
            **self.producer_overrides,
        }


@dataclass(frozen=True, kw_only=True)
class PublisherStats:
    """A snapshot of the publisher's counters.

    Attributes:
        enqueued: records accepted onto the in-process queue.
        delivered: records the broker acknowledged.
        failed: enqueued records that librdkafka refused or did not deliver
            (``first_error`` has the first reason).
        dropped_queue_full: records dropped (or refused) because the queue stayed full.
        dropped_on_close: queued records discarded because ``close()`` timed out.
        rejected_invalid: records refused by validation, by reason code.
        delivered_by_topic / failed_by_topic: the same counts per topic.
        bytes_on_wire: key + value + header bytes of delivered records per topic
            (before compression).
        queue_depth: records waiting in the in-process queue now.
        in_flight: records inside librdkafka awaiting delivery now.
        first_error: the first delivery / produce / fatal error, if any.
        refused_no_consent: turns and observations not published because their owner
            had no live ``capture`` grant (or the consent ledger could not be read).
        consent_checked: False when the publisher runs with ``consent_check=False``.
    """

    enqueued: int
    delivered: int
    failed: int
    dropped_queue_full: int
    dropped_on_close: int
    rejected_invalid: Mapping[str, int]
    delivered_by_topic: Mapping[str, int]
    failed_by_topic: Mapping[str, int]
    bytes_on_wire: Mapping[str, int]
    queue_depth: int
    in_flight: int
    first_error: str | None
    refused_no_consent: int = 0
    consent_checked: bool = True


class _Item(NamedTuple):
    topic: str
    key: bytes
    value: bytes
    headers: HeadersType


class RuntimePublisher:
    """Publishes identities, transcript turns and route observations. Thread-safe.

    ``identity`` (a ``RuntimeIdentity`` dict) registers the geometry that turns and
    observations are checked against, without publishing it: call ``publish_identity``
    too, which also registers further identities. ``keys`` is the owner key store that
    pseudonymizes and seals (default ``LocalOwnerKeyStore(create=True)``). Use as a
    context manager, or call :meth:`close`.

    ``consent`` answers whether an owner may be captured (default: a
    :class:`~streams.consent_book.ConsentBook` over ``config.consent_topic``); it is
    consulted for every turn and observation unless ``config.consent_check`` is False.
    """

    def __init__(self, config: PublisherConfig | None = None, *,
                 identity: Mapping[str, Any] | None = None,
                 registry: SchemaRegistry | None = None,
                 keys: OwnerKeyStore | None = None,
                 consent: ConsentCheck | None = None) -> None:
        self.config = config if config is not None else PublisherConfig()
        self._sealer = CaptureSealer(keys if keys is not None
                                     else LocalOwnerKeyStore(create=True))
        self._consent = capture_gate(
            consent, enabled=self.config.consent_check, bootstrap=self.config.bootstrap_servers,
            topic=self.config.consent_topic, who=f"publisher {self.config.producer_id}")
        reg = registry if registry is not None else default_registry()
        self._entries = {name: reg.get(name) for name in
                         (IDENTITY_SCHEMA, TURN_SCHEMA, OBSERVATION_SCHEMA)}
        self._headers: dict[str, HeadersType] = {
            name: list(kafka_headers(e)) for name, e in self._entries.items()}
        self._geometries: dict[str, IdentityRules] = {}
        if identity is not None:
            self._register(identity)
        self._obs_tracker = validation.OrdinalTracker(field="token_ordinal")
        self._turn_tracker = validation.OrdinalTracker(field="turn_index")
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=self.config.queue_capacity)
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._by_topic: Counter[tuple[str, str]] = Counter()  # (counter name, topic)
        self._first_error: str | None = None
        self._fatal: KafkaError | None = None
        self._next_counter = 0
        self._closed = False
        self._abort = threading.Event()
        self._last_warning = 0.0
        # The process's Kafka properties (security, client.id, ...) apply here too; an
        # invalid one raises ConfigError naming it.
        settings = {k: v for k, v in self.config.producer_settings().items()
                    if k != "bootstrap.servers"}
        try:
            self._producer = kafka.make_producer(
                kafka.client_config(self.config.bootstrap_servers),
                settings={**settings, "error_cb": self._on_error}, log_name=_rdkafka_log.name)
        except ConfigError as exc:
            raise ConfigError(f"cannot create the Kafka producer from PublisherConfig: {exc}; "
                              "check bootstrap_servers and producer_overrides") from exc
        self._thread = threading.Thread(target=self._drain, name="flywheel-publisher",
                                        daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------

    def publish_identity(self, identity: Mapping[str, Any]) -> bool:
        """Validate and enqueue a ``RuntimeIdentity`` (key: its identity id); once enqueued,
        turns and observations may name it."""
        record = dict(identity)
        geometry = self._guarded(lambda: validation.validate_identity(
            record, vocab_size=self.config.vocab_size))
        enqueued = self._enqueue(IDENTITY_SCHEMA, self.config.identities_topic,
                                 record["identity_id"].encode(), record)
        if enqueued:
            self._geometries[geometry.identity_id] = geometry
        return enqueued

    def publish_turn(self, turn: Mapping[str, Any]) -> bool:
        """Validate, pseudonymize, seal and enqueue a ``TranscriptTurn`` (v1 fields, raw
        ids); False if its owner has no live capture grant or it was dropped on a full
        queue."""
        record, stamp = self._stamped(turn)
        self._guarded(lambda: validation.validate_turn(
            record, validation.resolve_geometry(record, self._geometries)))
        if not self._consented(record):
            return False
        key = (record["owner"], record["thread"], record["generation"])
        sealed = self._sealer.turn(record)
        return self._enqueue(
            TURN_SCHEMA, self.config.transcripts_topic, _thread_key(sealed), sealed,
            lambda: self._turn_tracker.check_and_advance(key, record["turn_index"]), stamp)

    def publish_observation(self, obs: Mapping[str, Any]) -> bool:
        """Validate, pseudonymize, seal and enqueue a ``RouteObservation`` (packed v2
        routes, or v1 per-layer routes that are packed here; raw ids); False if its owner
        has no live capture grant or it was dropped on a full queue."""
        stamped, stamp = self._stamped(obs)
        self._guarded(lambda: validation.validate_observation(
            stamped, validation.resolve_geometry(stamped, self._geometries)))
        if not self._consented(stamped):
            return False
        record = stamped if routes.is_packed(stamped) else self._guarded(
            lambda: routes.to_v2(stamped))
        key = validation.observation_ordinal_key(record)
        sealed = self._sealer.observation(record)
        return self._enqueue(
            OBSERVATION_SCHEMA, self.config.observations_topic, _thread_key(sealed), sealed,
            lambda: self._obs_tracker.check_and_advance(key, record["token_ordinal"]), stamp)

    def flush(self, timeout_s: float = 30.0) -> int:
        """Wait until every queued record is delivered or ``timeout_s`` passes; returns
        how many are still outstanding (0 when all were delivered or failed)."""
        deadline = time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks and (left := deadline - time.monotonic()) > 0:
                self._queue.all_tasks_done.wait(left)
            queued = self._queue.unfinished_tasks
        return queued + self._producer.flush(max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float | None = None) -> None:
        """Flush (up to ``timeout_s``, default ``close_timeout_s``), then stop. Idempotent;
        anything still undelivered is purged and counted as failed or dropped_on_close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        timeout = self.config.close_timeout_s if timeout_s is None else timeout_s
        remaining = self.flush(timeout)
        self._abort.set()
        self._thread.join()
        if self._consent is not None:
            self._consent.close()
        if remaining:
            self._producer.purge()
            self._producer.flush(0)
        stats = self.stats()
        if remaining or stats.failed or stats.dropped_queue_full:
            log.warning("publisher %s closed with %d undelivered, %d failed, %d dropped on a "
                        "full queue; first error: %s", self.config.producer_id, remaining,
                        stats.failed, stats.dropped_queue_full, stats.first_error)

    def stats(self) -> PublisherStats:
        """A consistent snapshot of the counters."""
        with self._stats_lock:
            return PublisherStats(
                enqueued=self._counts["enqueued"], delivered=self._counts["delivered"],
                failed=self._counts["failed"],
                dropped_queue_full=self._counts["dropped_queue_full"],
                dropped_on_close=self._counts["dropped_on_close"],
                rejected_invalid=dict(self._rejected),
                delivered_by_topic=self._topic_counts("delivered"),
                failed_by_topic=self._topic_counts("failed"),
                bytes_on_wire=self._topic_counts("bytes"),
                queue_depth=self._queue.qsize(), in_flight=len(self._producer),
                first_error=self._first_error,
                refused_no_consent=self._counts["refused_no_consent"],
                consent_checked=self._consent is not None)

    def __enter__(self) -> RuntimePublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- caller side --------------------------------------------------------------

    def _register(self, identity: Mapping[str, Any]) -> None:
        geometry = validation.validate_identity(identity, vocab_size=self.config.vocab_size)
        self._geometries[geometry.identity_id] = geometry

    def _consented(self, record: Mapping[str, Any]) -> bool:
        """The consent hook: False (counted, warned) when the record's owner has no live
        ``capture`` grant at its wall time."""
        if self._consent is None:
            return True
        self._check_open()
        # the ledger is keyed by pseudonyms; the raw id is never logged
        owner = self._sealer.owner_pseudonym(str(record["owner"]))
        if self._consent.allows(owner, record["wall_time_ms"]):
            return True
        self._bump("refused_no_consent")
        self._warn_throttled("owner %s has no live capture grant at %d: record not published "
                             "(grant with `flywheel consent grant`)", owner,
                             record["wall_time_ms"])
        return False

    def _stamped(self, record: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """A copy with producer fields filled in; True when ``counter`` is ours to assign
        (set to 0 for validation, replaced under the lock in enqueue order)."""
        out = dict(record)
        stamp_counter = out.get("counter") is None
        if stamp_counter:
            out["counter"] = 0
        if out.get("producer_id") is None:
            out["producer_id"] = self.config.producer_id
        if out.get("wall_time_ms") is None:
            out["wall_time_ms"] = time.time_ns() // 1_000_000
        return out, stamp_counter

    def _guarded(self, check: Callable[[], _T]) -> _T:
        self._check_open()
        try:
            return check()
        except PublishValidationError as exc:
            self._count_rejected(exc.reason)
            raise

    def _enqueue(self, schema: str, topic: str, key: bytes, record: dict[str, Any],
                 ordered_check: Callable[[], None] | None = None,
                 stamp_counter: bool = False) -> bool:
        deadline = time.monotonic() + self.config.max_block_ms / 1000.0
        if not self._lock.acquire(timeout=self.config.max_block_ms / 1000.0):
            return self._queue_full(topic)
        try:
            self._check_open()
            if stamp_counter:
                record["counter"] = self._next_counter
            item = _Item(topic, key, self._encode(schema, record), self._headers[schema])
            if ordered_check is not None:
                self._guarded(ordered_check)
            self._next_counter += stamp_counter
            try:
                self._queue.put(item, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                return self._queue_full(topic)
        finally:
            self._lock.release()
        self._bump("enqueued")
        return True

    def _encode(self, schema: str, record: dict[str, Any]) -> bytes:
        try:
            return encode_entry(self._entries[schema], record, validate=False)
        except RecordEncodeError as exc:
            self._count_rejected(exc.reason)
            raise PublishValidationError(exc.reason, str(exc), field=exc.field) from exc

    def _queue_full(self, topic: str) -> bool:
        self._bump("dropped_queue_full")
        self._warn_throttled("publisher queue full for %.1f ms (capacity %d): %s record for "
                             "%s dropped", self.config.max_block_ms, self.config.queue_capacity,
                             self.config.full_policy, topic)
        if self.config.full_policy == "block_then_raise":
            raise QueueFullError(
                f"publisher queue stayed full for {self.config.max_block_ms} ms (capacity "
                f"{self.config.queue_capacity}); the record was not enqueued — the broker is "
                "slow or unreachable, or raise queue_capacity")
        return False

    def _check_open(self) -> None:
        if self._fatal is not None:
            raise PublisherClosedError(f"the Kafka producer hit a fatal error ({self._fatal}); "
                                       "close this publisher and create a new one")
        if self._closed:
            raise PublisherClosedError("publisher is closed; create a new one to publish more")

    # -- background side ----------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                self._producer.poll(0)
                if self._abort.is_set():
                    return
                continue
            try:
                if self._abort.is_set():
                    self._bump("dropped_on_close")
                else:
                    self._send(item)
            except Exception as exc:  # one bad record must not stop the drain thread
                self._record_failure(item.topic, f"unexpected: {exc!r}")
                log.exception("publisher thread failed on a record for %s", item.topic)
            finally:
                self._queue.task_done()
            self._producer.poll(0)

    def _send(self, item: _Item) -> None:
        while True:
            try:
                self._producer.produce(item.topic, item.value, item.key, headers=item.headers,
                                       on_delivery=self._on_delivery)
                return
            except BufferError:
                if self._abort.is_set():
                    self._bump("dropped_on_close")
                    return
                self._producer.poll(_BUFFER_RETRY_S)
            except KafkaException as exc:
                self._record_failure(item.topic, f"produce: {exc}")
                return

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        topic = msg.topic() or "?"
        if err is not None:
            self._record_failure(topic, f"delivery: {err}")
            return
        size = len(msg.value() or b"") + len(msg.key() or b"") + _headers_size(msg.headers())
        with self._stats_lock:
            self._counts["delivered"] += 1
            self._by_topic["delivered", topic] += 1
            self._by_topic["bytes", topic] += size

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = err
            self._record_failure("", f"fatal: {err}", count=False)
            log.error("Kafka producer fatal error: %s; the publisher refuses further records",
                      err)
            return
        self._warn_throttled("Kafka producer error (librdkafka keeps retrying): %s", err)

    # -- counters -----------------------------------------------------------------

    def _bump(self, name: str) -> None:
        with self._stats_lock:
            self._counts[name] += 1

    def _count_rejected(self, reason: str) -> None:
        with self._stats_lock:
            self._rejected[reason] += 1

    def _record_failure(self, topic: str, message: str, *, count: bool = True) -> None:
        with self._stats_lock:
            if count:
                self._counts["failed"] += 1
                self._by_topic["failed", topic] += 1
            if self._first_error is None:
                self._first_error = f"{topic}: {message}" if topic else message

    def _topic_counts(self, name: str) -> dict[str, int]:
        return {topic: n for (kind, topic), n in self._by_topic.items() if kind == name}

    def _warn_throttled(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning(fmt, *args)


def _headers_size(headers: HeadersType | None) -> int:
    pairs = headers.items() if isinstance(headers, dict) else headers or ()
    return sum(len(name) + len(value or b"") for name, value in pairs)


def _thread_key(record: Mapping[str, Any]) -> bytes:
    return f"{record['owner']}/{record['thread']}".encode()
