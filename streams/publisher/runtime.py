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
``TranscriptTurn.v2`` / ``RouteObservationChunk.v1`` (``RouteObservation.v3`` for
speculative tokens, or with ``chunk_max_tokens=1``), whose schemas have no plaintext
token or raw-id field at all.

Chunks (:mod:`streams.chunks`, :mod:`streams.publisher.batching`): an accepted
observation joins its thread's open chunk; the chunk is sealed (one AES-GCM envelope),
encoded and enqueued as one record when it is full (``chunk_max_tokens``), when
``chunk_max_ms`` passed since its first token (the drain thread checks while idle),
when the thread's next observation does not continue it, on a turn of the thread, on
:meth:`RuntimePublisher.end_thread`, and on ``flush`` / ``close``. A chunk's
``counter`` is stamped when it is enqueued. The producer is idempotent (``acks=all``):
librdkafka's retries never duplicate a record, and ``close`` publishes every open chunk
before it flushes, so nothing accepted is lost on a clean close. Observations still in
an open chunk when the process dies are lost like anything in the in-process queue
(``stats().tokens_buffered`` says how many are open at any moment).

The key store is ``LocalOwnerKeyStore(create=True)`` unless the caller gives one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from confluent_kafka import KafkaError

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, OwnerKeyStore
from hebrus_flywheel.schemas.codec import encode_entry, kafka_headers
from hebrus_flywheel.schemas.exceptions import RecordEncodeError
from hebrus_flywheel.schemas.registry import SchemaRegistry, default_registry
from hebrus_flywheel.streams import routes, validation
from hebrus_flywheel.streams.consent import ConsentCheck
from hebrus_flywheel.streams.consent_book import capture_gate
from hebrus_flywheel.streams.exceptions import (
    PublisherClosedError,
    PublishValidationError,
    QueueFullError,
)
from hebrus_flywheel.streams.publisher.batching import ChunkRuns, Run
from hebrus_flywheel.streams.publisher.config import (
    CHUNK_SCHEMA,
    IDENTITY_SCHEMA,
    OBSERVATION_SCHEMA,
    TURN_SCHEMA,
    PublisherConfig,
    PublisherStats,
)
from hebrus_flywheel.streams.publisher.delivery import Item, ProducerSide
from hebrus_flywheel.streams.rules import IdentityRules
from hebrus_flywheel.streams.sealing import CaptureSealer

if TYPE_CHECKING:
    from confluent_kafka._types import HeadersType

log = logging.getLogger("hebrus_flywheel.streams.publisher")
_rdkafka_log = logging.getLogger("hebrus_flywheel.streams.publisher.librdkafka")
_T = TypeVar("_T")


class RuntimePublisher(ProducerSide):
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
                         (IDENTITY_SCHEMA, TURN_SCHEMA, OBSERVATION_SCHEMA, CHUNK_SCHEMA)}
        self._headers: dict[str, HeadersType] = {
            name: list(kafka_headers(e)) for name, e in self._entries.items()}
        self._geometries: dict[str, IdentityRules] = {}
        if identity is not None:
            self._register(identity)
        self._obs_tracker = validation.OrdinalTracker(field="token_ordinal")
        self._turn_tracker = validation.OrdinalTracker(field="turn_index")
        self._runs = ChunkRuns(max_tokens=self.config.chunk_max_tokens,
                               max_ms=self.config.chunk_max_ms)
        self._queue: queue.Queue[Item] = queue.Queue(maxsize=self.config.queue_capacity)
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._by_topic: Counter[tuple[str, str]] = Counter()  # (counter name, topic)
        self._first_error: str | None = None
        self._fatal: KafkaError | None = None
        self._next_counter = 0
        self._next_due_scan = 0.0
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
        self._end_run(sealed["owner"], sealed["thread"])  # the thread's routes go first
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

        def ordered() -> None:
            self._obs_tracker.check_and_advance(key, record["token_ordinal"])

        if self.config.chunk_max_tokens > 1 and record.get("speculative") is None:
            return self._buffer(record, ordered)
        sealed = self._sealer.observation(record)
        self._end_run(sealed["owner"], sealed["thread"])  # keep the thread's order
        return self._enqueue(OBSERVATION_SCHEMA, self.config.observations_topic,
                             _thread_key(sealed), sealed, ordered, stamp)

    def publish_run(self, base: Mapping[str, Any], *, first_ordinal: int,
                    token_ids: Sequence[int] | np.ndarray, expert_ids_TLK: np.ndarray,
                    weights_TLK: np.ndarray, stages: Sequence[int] | None = None) -> int:
        """Publish a run of consecutive decoded tokens of one request at once: ``base``
        holds the request's fields (owner, thread, generation, sequence_id, turn_index,
        identity_id; raw ids), token ``i`` has ordinal ``first_ordinal + i``, routes are
        ``[tokens, layers, top_k]`` arrays in layer order. Checked as a whole with the
        per-token reason codes (:func:`streams.routes.check_route_block`), then added to
        the thread's chunks without a per-token object; returns the tokens accepted (0
        when the owner has no live capture grant)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        ids = np.ascontiguousarray(expert_ids_TLK)
        layers = ids.shape[1] if ids.ndim == 3 else 0
        probe, _ = self._stamped({**base, "token_ordinal": first_ordinal + len(tokens) - 1,
                                  "token_id": int(tokens.min(initial=0)), "speculative": None,
                                  "layers": list(range(layers)), "top_k": ids.shape[-1],
                                  "stages": list(stages or [0] * layers)})
        geometry = self._guarded(lambda: validation.resolve_geometry(probe, self._geometries))
        self._guarded(lambda: validation.validate_observation_fields(probe, geometry))
        self._guarded(lambda: routes.check_route_block(ids, weights_TLK, geometry))
        self._guarded(lambda: validation.check_token_block(tokens, geometry))
        if len(tokens) != len(ids):
            raise PublishValidationError("weights_ids_length_mismatch", f"{len(tokens)} token "
                                         f"ids for {len(ids)} tokens' routes", field="token_ids")
        if not len(tokens) or not self._consented(probe):
            return 0
        self._add_block({**probe, "token_ordinal": first_ordinal}, tokens.astype("<i4"),
                        ids.astype(routes.ID_DTYPE, copy=False),
                        np.ascontiguousarray(weights_TLK, dtype=routes.WEIGHT_DTYPE))
        return len(tokens)

    def end_thread(self, owner: str, thread: str) -> bool:
        """Publish the open chunk of a thread (raw ids) now, e.g. when its request ends;
        False when none was open."""
        ids = self._sealer.ids({"owner": owner, "thread": thread, "sequence_id": ""})
        return self._end_run(ids[0], ids[1])

    def flush(self, timeout_s: float = 30.0) -> int:
        """Publish every open chunk, then wait until every queued record is delivered or
        ``timeout_s`` passes; returns
        how many are still outstanding (0 when all were delivered or failed)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            for run in self._runs.pop_all():
                self._put_run(run, wait_s=max(0.0, deadline - time.monotonic()))
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
                consent_checked=self._consent is not None,
                chunks_enqueued=self._counts["chunks_enqueued"],
                chunk_tokens_enqueued=self._counts["chunk_tokens_enqueued"],
                tokens_buffered=self._runs.buffered,
                chunk_tokens_dropped=self._counts["chunk_tokens_dropped"])

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
            item = Item(topic, key, self._encode(schema, record), self._headers[schema])
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

    # -- chunks ---------------------------------------------------------------------

    def _buffer(self, record: dict[str, Any], ordered: Callable[[], None]) -> bool:
        """Add an accepted observation to its thread's open chunk; publish the chunks
        that closed (full, not continued, or due)."""
        ids = self._sealer.ids(record)
        wait_s = self.config.max_block_ms / 1000.0
        deadline = time.monotonic() + wait_s
        if not self._lock.acquire(timeout=wait_s):
            return self._queue_full(self.config.observations_topic)
        try:
            self._check_open()
            self._guarded(ordered)
            now = time.monotonic()
            closed = self._runs.add(ids, record, now)
            if now >= self._next_due_scan:
                closed += self._runs.pop_due(now)
                self._next_due_scan = now + self._runs.max_s / 4
            for run in closed:
                self._put_run(run, wait_s=max(0.0, deadline - time.monotonic()))
        finally:
            self._lock.release()
        return True

    def _add_block(self, first: dict[str, Any], tokens: np.ndarray, ids_TLK: np.ndarray,
                   weights_TLK: np.ndarray) -> None:
        key = validation.observation_ordinal_key(first)
        last = first["token_ordinal"] + len(tokens) - 1
        wait_s = self.config.max_block_ms / 1000.0
        if not self._lock.acquire(timeout=wait_s):
            self._queue_full(self.config.observations_topic)
            return
        try:
            self._check_open()
            self._guarded(lambda: self._obs_tracker.check(key, first["token_ordinal"]))
            self._obs_tracker.check_and_advance(key, last)
            closed = self._runs.add_block(self._sealer.ids(first), first, tokens, ids_TLK,
                                          weights_TLK, time.monotonic())
            for run in closed:
                self._put_run(run, wait_s=wait_s)
        finally:
            self._lock.release()

    def _end_run(self, owner: str, thread: str) -> bool:
        """Publish the thread's open chunk (pseudonyms), if any."""
        with self._lock:
            run = self._runs.pop_thread(owner, thread)
            if run is not None:
                self._put_run(run, wait_s=self.config.max_block_ms / 1000.0)
        return run is not None

    def _flush_due_chunks(self) -> None:
        """The drain thread's idle hook: publish chunks ``chunk_max_ms`` old (the queue is
        empty then, so nothing waits; a caller holding the lock is left alone)."""
        if not self._runs.buffered or not self._lock.acquire(blocking=False):
            return
        try:
            for run in self._runs.pop_due(time.monotonic()):
                self._put_run(run, wait_s=0.0)
        except QueueFullError:
            log.warning("a due chunk was dropped on a full queue")
        finally:
            self._lock.release()

    def _put_run(self, run: Run, *, wait_s: float) -> bool:
        """Seal, encode and enqueue one closed chunk (lock held); its counter is the next."""
        topic = self.config.observations_topic
        header = run.chunk_header(self._next_counter)
        self._next_counter += 1
        sealed = self._sealer.chunk(header, run.payload())
        item = Item(topic, _thread_key(sealed), self._encode(CHUNK_SCHEMA, sealed),
                    self._headers[CHUNK_SCHEMA], len(run))
        try:
            self._queue.put(item, timeout=wait_s)
        except queue.Full:
            with self._stats_lock:
                self._counts["chunk_tokens_dropped"] += len(run)
            return self._queue_full(topic)
        with self._stats_lock:
            self._counts["enqueued"] += 1
            self._counts["chunks_enqueued"] += 1
            self._counts["chunk_tokens_enqueued"] += len(run)
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


def _thread_key(record: Mapping[str, Any]) -> bytes:
    return f"{record['owner']}/{record['thread']}".encode()
