"""The faust-streaming worker: thin agents around the pure stages.

Topology (``N`` = partitions of the capture topics, 4 in the catalogue)::

    transcripts ─┐                                    ┌─▶ quarantine
    observations ├─▶ capture agent (validate+assemble)┤
    ticks (N) ───┘     table ``capture-state`` (N)    └─▶ threads (1 partition:
                                                              summaries and marks)
                                                              │
                       dedup agent (split + dedup) ◀──────────┘
                         table ``dedup-state`` (1)  ──▶ decisions (N, to the thread's partition)
                                                              │
                       window agent ◀─────────────────────────┘
                         reads/retires ``capture-state`` ──▶ flywheel.windows.<split>.v1

Tables are faust tables on RocksDB (:mod:`streams.processors.state_store`: owner values
sealed at rest, under ``<data dir>/<app id>``) backed by compacted changelog topics
``<app id>-<table>-changelog``; a restart reads only the changelog written after what
RocksDB holds. Every table key expires (:mod:`streams.processors.expiry`: idle and
finished generations, producer counters, the dedup horizon) with a changelog tombstone.
Decisions go to the partition the thread was read from, so the window agent finds the
thread in its own table partition.
Before consuming anything, each worker records its full configuration and the group's
capture start offsets on ``flywheel.streams.runs.v1`` (:mod:`streams.processors.runs`),
so a rebuild can run the stream processors again with the configurations that ran.

Delivery guarantee (at-least-once, deterministic output)
--------------------------------------------------------
Offsets are committed only after the producer is flushed, so every output of a
committed record is durable. After a crash, records after the last commit are read
again. Each state entry remembers the offsets it applied (and the verdicts it gave), so
a redelivered record changes nothing and gets its original verdict; a thread that had
finished repeats its last emit. Window ids and content digests depend only on the
thread's content and the configuration, so a repeated window is byte-identical and
downstream readers drop it by ``window_id``. A window is marked done only after its
windows were acknowledged by the broker, so no window is lost. Quarantine records carry
ids derived from their source coordinates and may also repeat.

Dedup decides in event-time order, not arrival order: after each batch the capture
agent sends each capture partition's *mark* to the threads topic, and the dedup agent
decides a summary once every partition's mark has passed its end
(:mod:`streams.processors.decision_order`). Which member of a duplicate pair survives
then depends on the records, not on the number of workers or their timing; what is
still decided on arrival (idle closures, records later than ``order_lateness_ms``,
live records after a partition was caught up) is counted ``dedup/late_summaries``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
from mode import CrashingSupervisor

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import claim_exclusive, make_dirs
from hebrus_flywheel.core.privacy import OwnerKeyDestroyedError
from hebrus_flywheel.core.processes import release_free_heap
from hebrus_flywheel.core.progress import WatchdogConfig
from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams import limits, quarantine
from hebrus_flywheel.streams.consent_book import ConsentBook
from hebrus_flywheel.streams.owner_seal import Erased, OwnerSealer, open_fields, seal_fields
from hebrus_flywheel.streams.processors.band_agents import BAND_TABLE, HOME_TABLE, BandDedup
from hebrus_flywheel.streams.processors.batches import (
    all_delivered,
    batches,
    handle_in_batches,
    handling,
    own_cpu,
)
from hebrus_flywheel.streams.processors.capture import QUARANTINE, CaptureStage, Emit
from hebrus_flywheel.streams.processors.capture_progress import CaptureProgress
from hebrus_flywheel.streams.processors.common import thread_key
from hebrus_flywheel.streams.processors.crash import (
    crash_only_agent,
    crash_only_timer,
    on_crash,
    record_handled,
)
from hebrus_flywheel.streams.processors.decision_order import DecisionOrder
from hebrus_flywheel.streams.processors.dedup import DedupStage
from hebrus_flywheel.streams.processors.fetch import CaptureFetch, WorkerApp
from hebrus_flywheel.streams.processors.identities import IdentityBook
from hebrus_flywheel.streams.processors.liveness import start_monitor
from hebrus_flywheel.streams.processors.pipeline import ProcessorConfig
from hebrus_flywheel.streams.processors.poison import CrashLedger, injected_fault, poison_emit
from hebrus_flywheel.streams.processors.runs import start_run
from hebrus_flywheel.streams.processors.seek import seek_uncommitted_to_start
from hebrus_flywheel.streams.processors.state_codec import StateValue, refuse_bad_changelog
from hebrus_flywheel.streams.processors.state_seal import seal_table
from hebrus_flywheel.streams.processors.state_store import (
    ROCKSDB_OPTIONS,
    STORE_URL,
    memory_gauges,
)
from hebrus_flywheel.streams.processors.topology import DEFAULT_APP_ID, StreamTopics, ensure_topics
from hebrus_flywheel.streams.processors.window import WindowStage, window_key
from hebrus_flywheel.streams.processors.window_seal import encode_window
from hebrus_flywheel.streams.processors.write_cache import WriteCache
from hebrus_flywheel.streams.topics import describe_topics

log = logging.getLogger(__name__)
CAPTURE_TABLE = "capture-state"
DEDUP_TABLE = "dedup-state"
SUMMARY_SEALED = ("digest", "minhash")
"""Fields of a thread summary sealed on the threads topic (content fingerprints)."""
DECISION_SEALED = ("digest",)
"""Fields of a decision sealed on the decisions topic."""


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """One streams worker.

    Fields:
        bootstrap: Kafka bootstrap servers.
        prefix: prepended to every topic name and to the app id (tests use uuid prefixes).
        app_id: faust app id: the consumer group and the changelog topic prefix. Workers
            with the same app id (and prefix) share the work.
        processors: every stage's configuration.
        tick_interval_s: how often idle threads are looked for.
        commit_interval_s: how often offsets are committed.
        session_timeout_s: Kafka group session timeout (a killed worker's partitions
            move after this long).
        stats_interval_s: how often per-stage counters are logged.
        watchdog: ``--drain`` (stop with status 0 once every input partition is
            committed to its end), the stall and broker timeouts (stop non-zero); see
            :mod:`streams.processors.liveness`.
        data_dir: faust's data directory (default ``$FLYWHEEL_HOME/streams/<app id>``).
        poison_after_crashes: a record that crashed the worker this many times in a row
            is quarantined by reference as ``poison`` on the next start
            (:mod:`streams.processors.poison`).
        standby_replicas: faust ``table_standby_replicas``: with more than one worker,
            each table partition is also kept warm on this many other workers, so a
            killed worker's partitions resume without replaying the whole changelog
            (with one worker there is no other to hold a standby). Each worker needs
            its own ``data_dir``: a standby opens the partition's RocksDB files too.
            Default 1. (It was 0 while two workers could stall after a rebalance; the
            cause was partitions without a committed offset keeping a stale fetch
            position, see :mod:`streams.processors.seek`.)
        heap_release_interval_s: how often the C heap's free pages go back to the
            system (:func:`core.processes.release_free_heap`; a few milliseconds each):
            freed buffers between live blocks otherwise stay resident, and resident
            memory creeps up with the traffic (``bench/soak.py``).
        order_grace_s: how long a capture partition caught up with live records stays
            caught up before its mark lets the dedup stage decide past everything it
            read (:class:`~streams.processors.decision_order.MarkPolicy`): longer, fewer
            live generations decided out of event-time order, decisions later.
    """

    bootstrap: str
    prefix: str = ""
    app_id: str = DEFAULT_APP_ID
    processors: ProcessorConfig = field(default_factory=ProcessorConfig)
    tick_interval_s: float = 5.0
    commit_interval_s: float = 2.5
    session_timeout_s: float = 10.0
    stats_interval_s: float = 30.0
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    data_dir: Path | None = None
    poison_after_crashes: int = 3
    standby_replicas: int = 1
    heap_release_interval_s: float = 5.0
    order_grace_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.bootstrap:
            raise ConfigError("WorkerConfig.bootstrap must name at least one broker")
        for name in (
            "tick_interval_s",
            "commit_interval_s",
            "session_timeout_s",
            "stats_interval_s",
            "heap_release_interval_s",
            "order_grace_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"WorkerConfig.{name} must be > 0")
        if isinstance(self.poison_after_crashes, bool) or not isinstance(
                self.poison_after_crashes, int) or self.poison_after_crashes < 1:
            raise ConfigError("WorkerConfig.poison_after_crashes must be an integer >= 1")
        if isinstance(self.standby_replicas, bool) or not isinstance(
                self.standby_replicas, int) or self.standby_replicas < 0:
            raise ConfigError("WorkerConfig.standby_replicas must be an integer >= 0")
        if not self.app_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ConfigError("WorkerConfig.app_id may hold letters, digits, '-', '_' and '.'")

    @property
    def full_app_id(self) -> str:
        return f"{self.prefix}{self.app_id}"


def _now_ms() -> int:
    return int(time.time() * 1000)


class StreamsWorker:
    """Builds the faust app for one worker process; :meth:`run` blocks until stopped."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        # Translated first: a property faust cannot honour stops the worker before it
        # records a run or touches a topic.
        self.kafka_client = kafka.client_config(config.bootstrap)
        self.faust_kafka = kafka.faust_settings(self.kafka_client)
        self.topics = StreamTopics.from_prefix(config.prefix, config.app_id)
        bands = config.processors.dedup.band_partitioned  # streams.processors.band_agents
        self.partitions = ensure_topics(
            config.bootstrap,
            self.topics,
            app_id=config.full_app_id,
            tables=({CAPTURE_TABLE: None, BAND_TABLE: None, HOME_TABLE: None}
                    if bands else {CAPTURE_TABLE: None, DEDUP_TABLE: 1}),
            dedup_bands=bands,
        )
        # topics faust creates itself (its assignor's leader topic) are replicated like
        # the catalogue: 3 on a cluster of three or more nodes (min.insync.replicas 2)
        self.replication = describe_topics(
            config.bootstrap, [self.topics.transcripts])[self.topics.transcripts].replication
        self.streams_run = start_run(
            config.bootstrap, self.topics.runs, app_id=config.full_app_id,
            config=config.processors, capture_topics=self.topics.capture_kinds().values(),
        )
        self.counters = Counters()
        self._first_capture_s: float | None = None  # when its first capture record came
        # owner data keys (a reader: never creates one) for everything written to Kafka
        self.sealer = OwnerSealer()
        self.ledger = CrashLedger(bootstrap=config.bootstrap, topic=self.topics.crashes,
                                  group=config.full_app_id,
                                  threshold=config.poison_after_crashes)
        self.ledger.load()  # before consuming: poisoned records are skipped by reference
        on_crash(self._on_crash)
        self.identities = IdentityBook(bootstrap=config.bootstrap, topic=self.topics.identities)
        self.identities.load()
        # Fail closed: no readable ledger, no worker; no live capture grant, no window.
        self.consent = ConsentBook(bootstrap=config.bootstrap, topic=self.topics.consent)
        self.consent.load()
        self.app = self._make_app()
        self._declare()

    def _make_app(self) -> faust.App:
        c = self.config
        data_dir = c.data_dir or flywheel_home() / "streams"
        make_dirs(data_dir / c.full_app_id)
        # RocksDB locks each table partition's files: two workers on one data directory
        # fail later, mid-rebalance, on whichever partition they both open
        self._data_dir_lock = claim_exclusive(data_dir / c.full_app_id / "worker.lock")
        if self._data_dir_lock is None:
            raise ConfigError(f"another stream worker of {c.full_app_id} runs on the data "
                              f"directory {data_dir / c.full_app_id}: give each worker on "
                              "one machine its own --data-dir (or FLYWHEEL_HOME)")
        app = WorkerApp(  # a short broker-side fetch wait (streams.processors.fetch)
            c.full_app_id,
            **self.faust_kafka,  # broker list, credentials, client id
            store=STORE_URL,  # every table: RocksDB, sealed at rest (see _table)
            datadir=str(data_dir / c.full_app_id),
            processing_guarantee="at_least_once",
            topic_partitions=self.partitions,
            topic_replication_factor=self.replication,
            table_standby_replicas=c.standby_replicas,
            web_enabled=False,
            consumer_auto_offset_reset="earliest",
            broker_commit_interval=c.commit_interval_s,
            broker_session_timeout=c.session_timeout_s,
            broker_heartbeat_interval=min(3.0, c.session_timeout_s / 3),
            stream_recovery_delay=0.5,
            producer_acks=-1,
            # batch changelog and output records: one observation writes three
            # (producer counter state, its packed routes, its thread header)
            producer_linger=0.01,
            producer_max_batch_size=524_288,
            # the quarantine topic's max.message.bytes: a quarantine record always fits
            producer_max_request_size=limits.QUARANTINE_MAX_MESSAGE_BYTES,
            key_serializer="raw",
            value_serializer="raw",
        )
        # the capture topics through librdkafka, with the worker's own client config
        app.capture_fetch = CaptureFetch.of(self.kafka_client, self.topics)
        app.declare_retry = self.kafka_client.retry
        return app

    def _table(self, name: str, partitions: int) -> Any:
        # keys: faust's json codec (key_type=str); values: the state codec (MessagePack);
        # an undecodable changelog record stops the worker (streams.processors.state_codec)
        # owner values are sealed in the changelog (streams.processors.state_seal)
        # the store: RocksDB on disk (a restart reads only the changelog's tail), owner
        # values sealed at rest like in the changelog (streams.processors.state_store)
        table = self.app.Table(name, partitions=partitions, key_type=str, value_type=StateValue,
                               options=dict(ROCKSDB_OPTIONS))
        return seal_table(refuse_bad_changelog(table), self.sealer, self.counters)

    def _declare(self) -> None:
        t, p = self.topics, self.config.processors
        # writes coalesced per key within each batch (streams.processors.write_cache)
        capture_table = WriteCache(self._table(CAPTURE_TABLE, self.partitions),
                                   name="capture", counters=self.counters)
        dedup_tables: tuple[WriteCache, ...]
        if self.config.processors.dedup.band_partitioned:
            dedup_tables = (
                WriteCache(self._table(BAND_TABLE, self.partitions), name="bands",
                           counters=self.counters),
                WriteCache(self._table(HOME_TABLE, self.partitions), name="dedup",
                           counters=self.counters))
        else:
            dedup_tables = (WriteCache(self._table(DEDUP_TABLE, 1), name="dedup",
                                       counters=self.counters),)
        self.caches = (capture_table, *dedup_tables)
        self.capture = CaptureStage(
            topics=t.capture_kinds(),
            store=capture_table,
            identities=self.identities.identities,
            validate_config=p.validate,
            assemble_config=p.assemble,
            dedup_config=p.dedup,
            resolve_identity=self.identities.resolve,
            counters=self.counters,
            capture_consent=lambda owner, at_ms: self.consent.allows(owner, "capture", at_ms),
            split_config=p.split,
        )
        # one layout per worker: the one dedup partition's order, or the bands (below)
        self.order: DecisionOrder | None = None if p.dedup.band_partitioned else DecisionOrder(
            DedupStage(split_config=p.split, dedup_config=p.dedup, store=dedup_tables[0],
                       counters=self.counters), partitions=self.partitions)
        self.bands: BandDedup | None = None
        self.window = WindowStage(config=p.window, store=capture_table, counters=self.counters,
                                  sealed=True)
        self._declare_agents()

    def _declare_agents(self) -> None:
        app, t = self.app, self.topics
        raw: dict[str, Any] = {
            "key_serializer": "raw",
            "value_serializer": "raw",
            "allow_empty": True,
        }
        self.capture_topic = app.topic(t.transcripts, t.observations, t.ticks, **raw)
        self.identity_topic = app.topic(t.identities, **raw)
        self.threads_topic = app.topic(t.threads, partitions=1, **raw)
        self.decisions_topic = app.topic(t.decisions, partitions=self.partitions, **raw)
        self.ticks_topic = app.topic(t.ticks, partitions=self.partitions, **raw)
        self.quarantine_topic = app.topic(t.quarantine, **raw)
        self.window_topics = {s: app.topic(name, **raw) for s, name in t.windows.items()}
        agents: list[tuple[Any, str, Any]] = [
            (self.capture_topic, "capture", self._capture_agent),
            (self.identity_topic, "identities", self._identity_agent),
            (self.decisions_topic, "window", self._window_agent),
        ]
        if self.config.processors.dedup.band_partitioned:
            self.bands = self._band_dedup()
            agents += [(self.bands.bands_topic, "bands", self._band_agent),
                       (self.bands.homes_topic, "dedup", self._home_agent)]
        else:
            agents.append((self.threads_topic, "dedup", self._dedup_agent))
        self.progress = CaptureProgress(
            app=app, topics=t, clocks=self.capture.clocks, counters=self.counters,
            lateness_ms=self.config.processors.dedup.order_lateness_ms,
            grace_s=self.config.order_grace_s, threads_topic=self.threads_topic,
            ticks_topic=self.ticks_topic,
            mark_sink=self.bands.send_mark if self.bands is not None else None)
        # crash-only (streams.processors.crash): an error stops the worker, never skips
        for topic, name, body in agents:
            app.agent(topic, name=name, supervisor_strategy=CrashingSupervisor)(
                crash_only_agent(name, body)
            )
        app.timer(self.config.tick_interval_s)(
            crash_only_timer("send_ticks", self.progress.send_ticks))
        app.timer(max(0.05, self.config.order_grace_s / 2))(
            crash_only_timer("release_marks", self.progress.release_marks))
        app.timer(self.config.stats_interval_s)(crash_only_timer("log_stats", self._log_stats))
        app.timer(self.config.heap_release_interval_s)(
            crash_only_timer("release_heap", self._release_heap))
        app.on_rebalance_complete.connect(self._on_rebalance)
        # Table writes go through faust's send-soon buffer, which stalls (and warns) at
        # 100 queued messages; one observation queues three, so allow a deeper buffer.
        app.producer.buffer.max_messages = 20_000

    # -- agents -----------------------------------------------------------------------

    def _band_dedup(self) -> BandDedup:
        raw: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw",
                               "allow_empty": True}
        p = self.config.processors
        return BandDedup(
            app=self.app, partitions=self.partitions, split_config=p.split,
            dedup_config=p.dedup, sealer=self.sealer, counters=self.counters,
            homes_topic=self.app.topic(self.topics.homes, partitions=self.partitions, **raw),
            bands_topic=self.app.topic(self.topics.bands, partitions=self.partitions, **raw),
            band_table=self.caches[1], home_table=self.caches[2],
            send_decisions=self._send_decisions, skipped_poison=self._skipped_poison)

    async def _capture_agent(self, stream: Any) -> None:
        await handle_in_batches(stream, self._capture_one, flush=self._flush_tables,
                                on_cpu=self._cpu_counter("capture"),
                                before=self._before_capture, after=self._after_capture)

    async def _before_capture(self, messages: list[Any]) -> list[Any]:
        """Marks that must hold again go out before a capture batch's summaries."""
        deliveries = await self.progress.hold_marks(messages)
        if self.bands is not None:
            self.bands.batch_started()
        return deliveries

    async def _after_capture(self, messages: list[Any]) -> list[Any]:
        """A capture batch's marks (band-partitioned dedup: with its probes, one record
        per band partition)."""
        deliveries = await self.progress.send_marks(messages)
        if self.bands is not None:
            deliveries += await self.bands.flush_batch()
        return deliveries

    async def _band_agent(self, stream: Any) -> None:
        assert self.bands is not None
        await self.bands.band_agent(stream, self._cpu_counter("bands"))

    async def _home_agent(self, stream: Any) -> None:
        assert self.bands is not None
        await self.bands.home_agent(stream, self._cpu_counter("dedup"))

    def _cpu_counter(self, agent: str) -> Callable[[int], None]:
        """Adds an agent's CPU microseconds to ``cpu/<agent>_us``."""
        name = f"{agent}_us"
        return lambda us: self.counters.inc("cpu", name, us)

    def _flush_tables(self) -> None:
        """Write the tables' cached writes: at the end of every batch, before its records
        are acked (the changelog records are flushed before any offset commit)."""
        for cache in self.caches:
            cache.flush()

    async def _capture_one(self, msg: Any) -> list[Any]:
        """Handle one capture record; its outputs' deliveries (sent, not yet awaited)."""
        if msg.topic != self.topics.ticks:  # handled here, even if skipped as poison
            self.progress.processed[(msg.topic, msg.partition)] = msg.offset
            if self._first_capture_s is None:
                self._log_first_capture(msg)
        if await self._skipped_poison(msg):
            return []
        if msg.topic == self.topics.ticks:
            emits = self.capture.tick(msg.partition, _now_ms())
        else:
            injected_fault(msg.key)  # tests only: FLYWHEEL_STREAMS_FAULT
            emits = self._process(msg, now_ms=_now_ms())
        return [await self._send_emit(emit) for emit in emits]

    def _log_first_capture(self, msg: Any) -> None:
        """Say when this process began on capture records (``bench/streams.py`` times a
        backlog's drain from it; an operator sees how long start-up took)."""
        self._first_capture_s = time.time()
        log.info("first capture record %s[%d]@%d handled at unix time %.3f",
                 msg.topic, msg.partition, msg.offset, self._first_capture_s)

    def _process(self, msg: Any, now_ms: int = 0) -> list[Emit]:
        """The capture stage's verdict on one capture or identity record."""
        return self.capture.process_safely(
            topic=msg.topic, partition=msg.partition, offset=msg.offset, key=msg.key,
            value=msg.value, headers=_headers(msg.headers), now_ms=now_ms)

    async def _identity_agent(self, stream: Any) -> None:
        async for event in stream.events():
            msg = event.message
            if await self._skipped_poison(msg):
                continue
            await self._send_emits(self._process(msg))

    async def _dedup_agent(self, stream: Any) -> None:
        await handle_in_batches(stream, self._decide, flush=self._flush_tables,
                                on_cpu=self._cpu_counter("dedup"))

    async def _decide(self, msg: Any) -> list[Any]:
        """Split and dedup one thread summary; the decision's delivery (sent)."""
        assert self.order is not None  # this agent runs in the one-partition layout only
        if await self._skipped_poison(msg):
            return []
        wire = json.loads(msg.value)
        if "mark" in wire:  # a capture partition's progress: decides what it lets pass
            return await self._send_decisions(self.order.mark(wire["mark"], wire["at"]))
        summary = open_fields(wire, self.sealer, context=str(wire["iid"]))
        if isinstance(summary, Erased):
            self.counters.inc("sealing", "erased_summaries")  # no decision: erased
            return []
        return await self._send_decisions(self.order.arrive(summary))

    async def _send_decisions(self, decisions: list[dict[str, Any]]) -> list[Any]:
        deliveries = []
        for decision in decisions:
            try:
                sealed = seal_fields(decision, DECISION_SEALED, self.sealer,
                                     context=decision["iid"])
            except OwnerKeyDestroyedError:
                self.counters.inc("sealing", "erased_decisions")
                continue
            deliveries.append(await self.decisions_topic.send(
                key=thread_key(decision["owner"], decision["thread"]).encode(),
                value=json.dumps(sealed).encode(), partition=decision["partition"]))
        return deliveries

    async def _window_agent(self, stream: Any) -> None:
        registry = codec.default_registry()
        headers = {v: codec.kafka_headers(registry.get(f"Window.v{v}")) for v in (1, 2)}
        count_cpu = self._cpu_counter("window")
        async for events in batches(stream):
            await own_cpu(self._window_batch(events, headers), count_cpu)

    async def _window_batch(self, events: list[Any], headers: Mapping[int, list[Any]]) -> None:
        # a generation is retired (its content dropped) only after its windows were
        # acknowledged; a second decision for it in one batch waits for the first's
        done: list[tuple[Any, dict[str, Any]]] = []
        deliveries: list[Any] = []
        for event in events:
            with handling(event):
                retire = await self._publish_windows(event.message, headers, deliveries, done)
            if retire is not None:
                done.append((event, retire))
        await self._retire(done, deliveries)
        self._flush_tables()

    async def _publish_windows(self, msg: Any, headers: Mapping[int, list[Any]],
                               deliveries: list[Any], done: list[tuple[Any, dict[str, Any]]]
                               ) -> dict[str, Any] | None:
        """Send one decision's windows (their deliveries appended to ``deliveries``); the
        decision to retire its generation with once they are acknowledged. A generation
        decided earlier in the batch (``done``) is retired first."""
        if await self._skipped_poison(msg):
            return None
        wire = json.loads(msg.value)
        if any(decided.get("iid") == wire.get("iid") for _, decided in done):
            await self._retire(done, deliveries)  # sets the current event back after it
        decision, encoded = self._sealed_windows(wire)
        if decision is None:  # the owner was erased: drop what is left of the thread
            self.counters.inc("sealing", "erased_decisions")
            return {**wire, "keep": False}
        for value, record in encoded:
            extra = [
                ("window_id", record["window_id"].encode()),
                ("content_digest", record["content_digest"].encode()),
            ]
            deliveries.append(await self.window_topics[record["split"]].send(
                key=window_key(record).encode(), value=value,
                headers=headers[2 if "key_generation" in record else 1] + extra,
            ))
        return decision

    async def _retire(self, done: list[tuple[Any, dict[str, Any]]],
                      deliveries: list[Any]) -> None:
        """Once every window sent is acknowledged, retire the generations decided."""
        with record_handled(None):
            await all_delivered(deliveries)
        for event, decision in done:
            with handling(event):
                self.window.finish(decision)
        done.clear()
        deliveries.clear()

    def _sealed_windows(self, wire: dict[str, Any]
                        ) -> tuple[dict[str, Any] | None, list[tuple[bytes, dict[str, Any]]]]:
        """The decision of a decisions-topic record and its windows, each sealed under
        the owner's key (bytes and record); no decision when the owner was erased."""
        decision = open_fields(wire, self.sealer, context=str(wire["iid"]))
        if isinstance(decision, Erased):
            return None, []
        try:
            windows = self.window.windows_for(decision)
            return decision, [encode_window(w, self.sealer) for w in windows]
        except OwnerKeyDestroyedError:
            return None, []

    async def _skipped_poison(self, msg: Any) -> bool:
        """True (after its reference-only ``poison`` quarantine record was acknowledged)
        when the crash ledger says ``msg`` crashed the worker too often to process."""
        where = (str(msg.topic), int(msg.partition), int(msg.offset))
        entry = self.ledger.entry(where)
        if entry is None:
            return False
        self.counters.inc("quarantine", "poison")
        log.warning("quarantining poison record %s[%d]@%d by reference", *where)
        await self._send_emits([poison_emit(where, msg.value, entry, self.ledger.threshold)])
        return True

    def _on_crash(self, where: tuple[str, int, int], error: str) -> None:
        crashes = self.ledger.record_crash(where, error)
        log.critical("crash ledger: %s[%d]@%d has crashed the worker %s time(s) in a row; "
                     "at %d it is quarantined as poison on the next start", *where,
                     crashes or "an unrecorded number of", self.ledger.threshold)

    async def _send_emits(self, emits: list[Emit]) -> None:
        """Send one record's outputs and wait until the broker acknowledged all of them
        (a failed delivery raises, and the crash-only agent stops the worker before the
        record's offset can be committed)."""
        pending = [await self._send_emit(emit) for emit in emits]
        for delivered in pending:
            await delivered

    async def _send_emit(self, emit: Emit) -> Any:
        if emit.kind == QUARANTINE:
            out = quarantine.encode(emit.value)  # size-checked: a reference record if too big
            return await self.quarantine_topic.send(
                key=emit.key.encode(), value=out.value, headers=out.headers
            )
        try:
            summary = seal_fields(emit.value, SUMMARY_SEALED, self.sealer,
                                  context=str(emit.value["iid"]))
        except OwnerKeyDestroyedError:  # erased while assembling: no summary, no windows
            self.counters.inc("sealing", "erased_summaries")
            return _done()
        if self.bands is not None:
            return await self.bands.send_summary(emit.value, json.dumps(summary).encode(),
                                                 emit.key.encode())
        return await self.threads_topic.send(
            key=emit.key.encode(), value=json.dumps(summary).encode(), partition=0
        )

    # -- timers and signals -------------------------------------------------------------

    async def _release_heap(self) -> None:
        started = time.perf_counter()
        released = release_free_heap()
        self.counters.inc("memory", "heap_releases", int(released))
        self.counters.inc("memory", "heap_release_ms", round(1000 * (time.perf_counter()
                                                                    - started)))

    async def _log_stats(self) -> None:
        log.info("streams counters %s", json.dumps(self.counters.as_dict()))
        log.info("streams memory %s", json.dumps({**memory_gauges(),
                                                  "dedup_held": self._held()}))

    def _held(self) -> int:
        """Generations the dedup stage holds for their turn (in this worker)."""
        if self.bands is not None:
            return self.bands.held
        return self.order.held if self.order is not None else 0

    async def _on_rebalance(self, *args: Any, **kwargs: Any) -> None:
        # Hold the flow until faust has sought the stream partitions back to their
        # committed offsets. faust (0.15) sends this signal first thing in
        # Recovery.on_recovery_completed, then resumes the stream partitions, awaits the
        # seek and only then calls app.flow_control.resume(), which *clears* every agent
        # queue. Flow control is active again since the changelog restore, so records
        # fetched during the seek went into those queues and were dropped unprocessed,
        # though the consumer counted them as read (faust issue #596); its commit then
        # stepped over a single unacked offset at the head, so the record was lost for
        # good and its thread never completed. Suspended, the conductor keeps fetched
        # records until faust resumes the flow, and the clear finds nothing to drop.
        # Every path that goes on after this signal ends in flow_control.resume(); one
        # that returns early does so because another rebalance started, whose recovery
        # resumes the flow.
        self.app.flow_control.suspend()
        # before faust's seek: partitions without a commit go back to their start too
        seek_uncommitted_to_start(self.app)
        if self.bands is not None:
            self.bands.reset(self.app.consumer.assignment())
        elif self.order is not None:
            self.order.reset()
            self.order.pending()  # what waits in the partition now held (the drain waits)
        for cache in self.caches:  # empty: faust acks every batch before it revokes
            cache.discard()
        self.progress.forget()  # positions start at the commit again, marks afresh

    def run(self) -> None:
        """Run until SIGINT/SIGTERM, or until the watchdog stops the worker (drained:
        status 0; stalled, broker lost, drain timeout: non-zero)."""
        start_monitor(self.app, self.topics, self.config.full_app_id, self.config.bootstrap,
                      self.config.watchdog, holding=self._held,
                      dedup_bands=self.bands is not None)
        worker = faust.Worker(
            self.app,
            loglevel=logging.getLogger().level or logging.WARNING,
            quiet=True,
            redirect_stdouts=False,
        )
        # What start-up left alive (modules, faust's app, the config: ~150,000 objects)
        # moves to the permanent generation, so full collections stop scanning it:
        # they took 0.39-0.44 s of a 1,000-thread drain, 0.08-0.09 s after
        # (bench/streams.py with gc callbacks, 2026-12-07)
        gc.freeze()
        worker.execute_from_commandline()


def _done() -> Any:
    """An already-resolved delivery (for an output that is not sent)."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


def _headers(headers: Any) -> list[tuple[str, Any]]:
    if not headers:
        return []
    if isinstance(headers, Mapping):
        return list(headers.items())
    return [(str(k), v) for k, v in headers]
