"""``flywheel replay worker``: a consumer group on the window topics that writes shards.

Per message (in partition order): :func:`consumers.intake.classify` accepts the window
or quarantines it (``identity_mismatch`` and the other reason codes) on the quarantine
topic; an accepted window whose id was already accepted earlier in its partition is
dropped; the rest wait in their partition's open block. When every offset of a block
was consumed (see :mod:`consumers.epochs`) the block is replayed in fixed batches and
written as one shard (:mod:`consumers.blocks`), the quarantine producer is flushed, and
only then is the block's end offset committed (manual commits, no auto offset store).

A crash anywhere loses only uncommitted work: the restarted worker resumes at the
committed offset, which is always a block start, rebuilds the set of already written
window ids from the shards before it, and writes the same bytes again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from hebrus_flywheel.consumers import faults
from hebrus_flywheel.consumers.blocks import BlockSettings, close_block
from hebrus_flywheel.consumers.content_policy import (
    ContentPolicy,
    ContentPolicyConfig,
    Finding,
    tokenizer_decoder,
)
from hebrus_flywheel.consumers.control import ControlChannel
from hebrus_flywheel.consumers.dataset import (
    config_digest,
    dataset_record,
    open_dataset,
    written_ids,
)
from hebrus_flywheel.consumers.epochs import Block, EpochPlan
from hebrus_flywheel.consumers.exceptions import ControlError, WorkerError
from hebrus_flywheel.consumers.intake import PartitionLog, Verdict, classify, quarantine_record
from hebrus_flywheel.consumers.labels import SourceRef
from hebrus_flywheel.consumers.shards import ShardConfig, clean_staging
from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.execution import Execution
from hebrus_flywheel.core.liveness import Monitor, MonitorTarget
from hebrus_flywheel.core.progress import DRAINED, WatchdogConfig
from hebrus_flywheel.core.progress import Verdict as WatchdogVerdict
from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.streams import limits, quarantine
from hebrus_flywheel.streams.consent import CONSENT_TOPIC, now_ms, scope_for_split
from hebrus_flywheel.streams.consent_book import ConsentBook
from hebrus_flywheel.streams.topics import CONTROL_TOPIC, QUARANTINE_TOPIC, SPLITS, window_topic

log = logging.getLogger(__name__)
_LOG = "consumers.librdkafka"
_REBALANCE_CODES = {KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION,
                    KafkaError.UNKNOWN_MEMBER_ID}


@dataclass(frozen=True, kw_only=True)
class ReplayWorkerConfig:
    """One replay worker process.

    Fields:
        teacher: local teacher checkpoint directory.
        dataset: dataset root the shards go under.
        bootstrap: Kafka bootstrap servers.
        prefix: topic-name prefix (tests use uuid prefixes); also prefixes the group id.
        group_id: consumer group; workers with the same group share the partitions.
        tokenizer_dir: tokenizer directory (default: the teacher's own).
        dtype: teacher compute dtype (part of the runtime identity).
        device, attention: the teacher's device and attention kernel (with ``dtype``,
            the kernel path in the identity: windows captured on another path are
            refused as identity mismatches).
        shard: block cutting and Parquet writer settings.
        batch_windows: windows per engine call (consecutive windows of one block).
        torch_threads: torch intra-op threads (None: torch's default); recorded.
        replay_options: keyword arguments of ``replay.prefill.ReplayConfig``.
        poll_timeout_s: consumer poll timeout.
        control_sync_s: how often the control topic is re-read while idle.
        stop_after_epoch: exit once this epoch's boundary is known and every assigned
            partition is committed up to it (None: run on).
        instance_id: static group membership id (``group.instance.id``): a worker
            restarted with the same id takes its partitions back at once instead of
            waiting for the killed member's session to expire. None: dynamic member.
        session_timeout_s, max_poll_interval_s: Kafka group liveness settings; a block's
            replay must finish within ``max_poll_interval_s``.
        max_quarantine_value_bytes: original bytes kept in a QuarantineRecord.
        stats_interval_s: how often counters are logged.
        watchdog: ``drain`` (return once every window partition is committed to its
            end: lag 0) and the stall / broker timeouts (the process exits non-zero);
            the health file goes to ``$FLYWHEEL_HOME/health/replay-<group>.json``. A
            control topic that stays unreadable longer than the broker timeout also
            ends the worker (status 2); until then open blocks just wait.
        content_policy: the secrets and tool-output policy run on every accepted window
            before replay (:mod:`consumers.content_policy`); recorded in the dataset's
            determinism record so a rebuild drops the same windows.
        splits: the splits whose window topics this worker consumes (default: all). Every
            worker of one group must consume the same splits; a group per split lets the
            busy train split get more workers than the holdouts.
    """

    teacher: Path
    dataset: Path
    bootstrap: str
    prefix: str = ""
    group_id: str = "flywheel-replay"
    tokenizer_dir: Path | None = None
    dtype: str = "float32"
    device: str = "cpu"
    attention: str = "auto"
    shard: ShardConfig = field(default_factory=ShardConfig)
    batch_windows: int = 8
    torch_threads: int | None = None
    replay_options: Mapping[str, Any] = field(default_factory=dict)
    poll_timeout_s: float = 0.5
    control_sync_s: float = 1.0
    stop_after_epoch: int | None = None
    instance_id: str | None = None
    session_timeout_s: float = 30.0
    max_poll_interval_s: float = 900.0
    max_quarantine_value_bytes: int = 1 << 20
    stats_interval_s: float = 30.0
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    content_policy: ContentPolicyConfig = field(default_factory=ContentPolicyConfig)
    splits: tuple[str, ...] = SPLITS

    def __post_init__(self) -> None:
        if not self.bootstrap:
            raise ConfigError("ReplayWorkerConfig.bootstrap must name at least one broker")
        Execution(device=self.device, dtype=self.dtype, attention=self.attention)
        for name in ("batch_windows", "max_quarantine_value_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ReplayWorkerConfig.{name} must be a positive integer")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError("ReplayWorkerConfig.torch_threads must be >= 1 or None")
        for name in ("poll_timeout_s", "control_sync_s", "session_timeout_s",
                     "max_poll_interval_s", "stats_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ReplayWorkerConfig.{name} must be > 0")
        if self.stop_after_epoch is not None and self.stop_after_epoch < 0:
            raise ConfigError("ReplayWorkerConfig.stop_after_epoch must be >= 0 or None")
        if not isinstance(self.shard, ShardConfig):
            raise ConfigError("ReplayWorkerConfig.shard must be a ShardConfig")
        if not isinstance(self.content_policy, ContentPolicyConfig):
            raise ConfigError("ReplayWorkerConfig.content_policy must be a ContentPolicyConfig")
        if not self.splits or not set(self.splits) <= set(SPLITS):
            raise ConfigError(f"ReplayWorkerConfig.splits must be a non-empty subset of "
                              f"{SPLITS}, got {self.splits!r}")

    @property
    def full_group_id(self) -> str:
        return f"{self.prefix}{self.group_id}"

    def window_topics(self) -> dict[str, str]:
        """Topic name -> split, for every split this worker consumes."""
        return {self.prefix + window_topic(s): s for s in self.splits}


class ReplayWorker:
    """Runs the consume → classify → block → replay → shard → commit loop."""

    def __init__(self, config: ReplayWorkerConfig, *, teacher: Any = None) -> None:
        from hebrus_flywheel.consumers.engine import determinism_record, load_engine, window_check

        self.config = config
        self.stats = Counters()
        self._stop = threading.Event()
        self.bundle = load_engine(teacher_dir=config.teacher, dtype=config.dtype,
                                  device=config.device, attention=config.attention,
                                  replay_options=config.replay_options,
                                  torch_threads=config.torch_threads,
                                  tokenizer_dir=config.tokenizer_dir, teacher=teacher)
        determinism = determinism_record(shard=config.shard, batch_windows=config.batch_windows,
                                         bundle=self.bundle, dtype=config.dtype,
                                         replay_options=config.replay_options,
                                         content_policy=config.content_policy.to_dict())
        source = {"prefix": config.prefix, "group_id": config.full_group_id}
        record = dataset_record(identity=self.bundle.identity, determinism=determinism,
                                source=source)
        self.root = open_dataset(config.dataset, record)
        clean_staging(self.root)
        self.settings = BlockSettings(
            root=self.root, shard=config.shard, batch_windows=config.batch_windows,
            route=self.bundle.teacher.geometry, identity_id=self.bundle.identity["identity_id"],
            config_digest=config_digest(record["determinism"]),
            feature_contract=self.bundle.replay_config.get("feature_contract"))
        self._check = window_check(self.bundle)
        self.policy = ContentPolicy(config.content_policy, tokenizer_decoder(
            config.tokenizer_dir or self.bundle.teacher.path))
        self.splits = config.window_topics()
        self.logs: dict[tuple[str, int], PartitionLog] = {}
        self.kafka = kafka.client_config(config.bootstrap)
        # fail closed: no readable ledger, no worker; no live grant, no replay
        self.consent = ConsentBook(bootstrap=self.kafka, topic=config.prefix + CONSENT_TOPIC)
        self.consent.load()
        self.control = ControlChannel(self.kafka, config.prefix + CONTROL_TOPIC)
        self.plan = EpochPlan(config.shard.offsets_per_shard, self.control.sync().ordered())
        self._last_sync = self._control_ok = time.monotonic()
        self._paused = False
        self._messages = kafka.MessageCheck(self.kafka.retry, "replay worker consume")
        self.consumer = kafka.make_consumer(self.kafka, group_id=config.full_group_id,
                                            settings=self._consumer_conf(), log_name=_LOG)
        self.producer = kafka.CheckedProducer(
            self.kafka, log_name=_LOG,
            settings={"message.max.bytes": limits.QUARANTINE_MAX_MESSAGE_BYTES})
        self._consumed: dict[tuple[str, int], int] = {}
        self._write_on_revoke = True  # False once a failed run closes: no more writes
        self.drained: str | None = None
        self.monitor = Monitor(
            MonitorTarget(kind="replay", name=config.full_group_id, topics=tuple(self.splits),
                          home=flywheel_home()),
            config.watchdog, self.kafka, on_verdict=self._on_verdict,
            consumed=lambda: dict(self._consumed),
            dropped=lambda: self.stats.stage("policy_dropped"))

    def _consumer_conf(self) -> dict[str, Any]:
        c = self.config
        static = {} if c.instance_id is None else {"group.instance.id": c.instance_id}
        return {
            **static, "auto.offset.reset": "earliest", "isolation.level": "read_committed",
            "session.timeout.ms": int(c.session_timeout_s * 1000),
            "max.poll.interval.ms": int(c.max_poll_interval_s * 1000),
            # incremental rebalances: a joining or leaving worker moves only the
            # partitions that change owner; the others keep replaying undisturbed
            "partition.assignment.strategy": "cooperative-sticky",
        }

    # -- group membership -----------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        try:
            offsets = kafka.committed(consumer, [(tp.topic, tp.partition) for tp in partitions],
                                      retry=self.kafka.retry, timeout_s=30,
                                      group_id=self.config.full_group_id)
        except (kafka.KafkaIOError, KafkaException) as exc:
            raise WorkerError(f"cannot read the committed offsets of the assigned partitions: "
                              f"{exc}; restart the worker once the broker is healthy") from exc
        committed = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        for tp in committed:
            resume = max(tp.offset, 0)
            base = self.plan.block(tp.topic, tp.partition, resume).first
            ids = written_ids(self.root, tp.topic, tp.partition, before=base)
            self.logs[(tp.topic, tp.partition)] = PartitionLog(
                topic=tp.topic, partition=tp.partition, split=self.splits[tp.topic], base=base,
                written_ids=ids)
            tp.offset = base
            self._consumed[(tp.topic, tp.partition)] = base
            log.info("assigned %s[%d]: resume at %d (committed %d), %d window ids already "
                     "written", tp.topic, tp.partition, base, resume, len(ids))
        # cooperative-sticky: ``partitions`` are only the newly added ones
        consumer.incremental_assign(committed)
        if self._paused and committed:  # a live seal intent holds every partition we own
            consumer.pause(committed)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions leave this worker (cooperative: only those): every block of theirs
        that is complete is written and committed first, while they are still ours, so
        the next owner starts after it; the open rest is dropped (re-read there)."""
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        if self._write_on_revoke and not self._paused and revoked & set(self.logs):
            try:
                self._close_ready(only=revoked)
            except WorkerError as exc:  # nothing is committed past an unwritten shard
                log.warning("revoke: complete blocks left for the next owner: %s", exc)
        self._forget(partitions, "revoked")
        consumer.incremental_unassign(partitions)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions taken away without a revoke (this member's session expired): they
        belong to another worker already, so nothing is written or committed for them."""
        self._forget(partitions, "lost")
        consumer.incremental_unassign(partitions)

    def _forget(self, partitions: list[TopicPartition], how: str) -> None:
        for tp in partitions:
            dropped = self.logs.pop((tp.topic, tp.partition), None)
            self._consumed.pop((tp.topic, tp.partition), None)
            if dropped is not None and dropped.pending:
                log.info("%s %s[%d] with %d uncommitted windows (the next owner re-reads "
                         "them)", how, tp.topic, tp.partition, len(dropped.pending))

    # -- messages -------------------------------------------------------------------

    def _handle(self, msg: Any) -> None:
        plog = self.logs.get((msg.topic(), msg.partition()))
        if plog is None or plog.seen(msg.offset()):
            self.stats.inc("intake", "redelivered")
            return
        source = SourceRef(topic=msg.topic(), partition=msg.partition(), offset=msg.offset())
        with self.stats.timer("intake"):
            verdict = classify(msg.value(), msg.headers(), msg.key(), split=plog.split,
                               identity_id=self.settings.identity_id,
                               vocab_size=self.bundle.vocab_size, check=self._check)
        if not verdict.accepted:
            self._quarantine(verdict, source, msg)
            plog.skip(msg.offset())
        elif not self._consented(verdict.window or {}, plog.split, source, msg):
            plog.skip(msg.offset())
        elif (finding := self._screen(verdict.window or {})) is not None:
            self._drop(finding, source)
            plog.skip(msg.offset())
        elif plog.admit(msg.offset(), verdict.window or {}):
            self.stats.inc("intake", "accepted")
        else:
            self.stats.inc("intake", "duplicate")

    def _consented(self, window: Mapping[str, Any], split: str, source: SourceRef,
                   msg: Any) -> bool:
        """Whether the window's owner has a live grant of its split's scope now (train
        split: ``train``; the others: ``evaluate``); else it is quarantined
        ``no_consent`` by reference (no value bytes, owner or thread)."""
        scope = scope_for_split(split)
        if self.consent.allows(str(window.get("owner")), scope, now_ms()):
            return True
        verdict = Verdict(window=None, reason="no_consent",
                          detail=f"no live {scope} grant at replay time")
        self._quarantine(verdict, source, msg, metadata_only=True)
        return False

    def _screen(self, window: Mapping[str, Any]) -> Finding | None:
        with self.stats.timer("policy"):
            return self.policy.screen(window)

    def _drop(self, finding: Finding, source: SourceRef) -> None:
        """A window the content policy refuses: counted by reason, logged as metadata
        only (never its tokens or text), its offset consumed like a quarantined one."""
        self.stats.inc("policy_dropped", finding.reason)
        log.info("dropped by the content policy %s[%d]@%d: %s", source.topic,
                 source.partition, source.offset, finding.reason)

    def _quarantine(self, verdict: Verdict, source: SourceRef, msg: Any, *,
                    metadata_only: bool = False) -> None:
        record = quarantine_record(verdict, source, value=msg.value(), key=msg.key(),
                                   headers=msg.headers(),
                                   max_value_bytes=self.config.max_quarantine_value_bytes)
        if metadata_only:
            record = quarantine.reference(record, f"{verdict.reason}: metadata only")
        out = quarantine.encode(record)  # size-checked: a reference record if it won't fit
        key = (f"{out.record['owner']}/{out.record['thread']}" if out.record["owner"]
               else "replay").encode()
        self.producer.produce(self.config.prefix + QUARANTINE_TOPIC, key=key, value=out.value,
                              headers=out.headers)
        self.stats.inc("quarantine", str(verdict.reason))
        log.warning("quarantined %s[%d]@%d: %s (%s)", source.topic, source.partition,
                    source.offset, verdict.reason, verdict.detail)

    # -- blocks ---------------------------------------------------------------------

    def _sync_control(self) -> bool:
        """Re-read the control topic; pause while a live seal intent blocks open blocks.

        True means open-epoch blocks must not close now (a live intent, or the topic
        could not be read: a boundary may be unseen)."""
        if self._control_ok < self._last_sync \
                and time.monotonic() - self._last_sync < self.config.control_sync_s:
            return True  # the last read failed moments ago: no retry storm
        try:
            state = self.control.sync()
        except ControlError as exc:
            return self._control_unreadable(exc)
        self._last_sync = self._control_ok = time.monotonic()
        ordered = state.ordered()
        if len(ordered) != len(self.plan.boundaries):
            self.plan = EpochPlan(self.config.shard.offsets_per_shard, ordered)
            log.info("epoch %d boundary recorded; open epoch is now %d", ordered[-1].epoch,
                     self.plan.open_epoch)
        blocked = state.pending_intent() is not None
        assignment = self.consumer.assignment()
        if blocked != self._paused and assignment:
            (self.consumer.pause if blocked else self.consumer.resume)(assignment)
            self._paused = blocked
            log.info("seal intent for epoch %d %s", state.next_epoch,
                     "seen: pausing until its boundary arrives" if blocked else "resolved")
        return blocked

    def _control_unreadable(self, exc: ControlError) -> bool:
        """A failed control read (a broker outage): open blocks wait, the loop goes on;
        unreadable for longer than the broker timeout ends the worker (status 2)."""
        now = time.monotonic()
        self._last_sync, down = now, now - self._control_ok
        limit = self.config.watchdog.broker_timeout_s
        if down > limit:
            raise WorkerError(f"{exc} (unreadable for {down:.0f}s > --broker-timeout-s "
                              f"{limit:g}); restart the worker once the broker is healthy") \
                from exc
        self.stats.inc("control", "read_errors")
        log.warning("control topic unreadable for %.0fs; open blocks wait: %s", down, exc)
        return True

    def _close_ready(self, only: set[tuple[str, int]] | None = None) -> None:
        """Write and commit every complete block (of the partitions in ``only``, or all)."""
        synced = False
        for key, plog in list(self.logs.items()):
            if only is not None and key not in only:
                continue
            while (block := plog.next_block(self.plan)) is not None:
                if not block.final and not synced:
                    synced = True
                    if self._sync_control():
                        self.stats.inc("control", "waits_for_boundary")
                        return
                    continue  # the plan may have changed: recompute the block
                self._close(plog, block)

    def _close(self, plog: PartitionLog, block: Block) -> None:
        items = plog.take(block)
        try:
            close_block(self.bundle.engine, self.settings, block, plog.split, items, self.stats)
        except OSError as exc:  # an infrastructure fault: stop, commit nothing past it
            raise WorkerError(
                f"writing the shard of {block.topic}[{block.partition}] offsets "
                f"{block.first}-{block.last} under {self.config.dataset} failed: "
                f"{type(exc).__name__}: {exc}; nothing was committed past offset {block.first}, "
                "fix the dataset directory and restart the worker") from exc
        try:
            self.producer.flush(30, what="quarantine records")
        except kafka.KafkaIOError as exc:
            raise WorkerError(f"{exc}; offsets stay uncommitted — restart the worker") from exc
        where = TopicPartition(block.topic, block.partition, block.end)
        try:
            # A rebalance means another member owns the block now: not worth a retry.
            self.kafka.retry.call(
                lambda: self.consumer.commit(offsets=[where], asynchronous=False),
                what=f"commit of {block.topic}[{block.partition}]@{block.end}",
                retry_if=lambda e: kafka.is_retriable(e) and e.code() not in _REBALANCE_CODES)
        except (KafkaException, kafka.KafkaRetryError) as exc:
            err = kafka.kafka_error(exc)
            if err is not None and err.code() in _REBALANCE_CODES:
                log.warning("commit of %s[%d]@%d lost to a rebalance; the next owner rewrites "
                            "the same shard", block.topic, block.partition, block.end)
                return
            raise WorkerError(f"cannot commit {block.topic}[{block.partition}]@{block.end}: "
                              f"{exc}; the shard is durable and will be rewritten "
                              "identically after a restart") from exc
        self.stats.inc("commit", "blocks")
        faults.hit("after_commit")

    # -- loop -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current step (thread- and signal-safe)."""
        self._stop.set()

    def _on_verdict(self, verdict: WatchdogVerdict) -> None:
        """Watchdog thread: drained stops the loop (status 0); anything else ends the
        process at once with the verdict's status (crash-only: nothing is committed
        past an unwritten shard, so a restart redoes the open blocks)."""
        if verdict.state == DRAINED:
            self.drained = verdict.message
            self.stop()
            return
        log.error("replay worker stops: %s", verdict.message)
        print(verdict.message, flush=True)
        logging.shutdown()
        os._exit(verdict.exit_code or 1)

    def _epoch_done(self) -> bool:
        epoch = self.config.stop_after_epoch
        if epoch is None or len(self.plan.boundaries) <= epoch or not self.logs:
            return False
        boundary = self.plan.boundaries[epoch]
        return all(p.base >= boundary.end_of(t, n) for (t, n), p in self.logs.items())

    def run(self) -> Counters:
        """Consume until stopped (``stop()``, drained with ``watchdog.drain``, or
        ``stop_after_epoch``); the watchdog ends a stalled or broker-less process."""
        self.consumer.subscribe(list(self.splits), on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_lost)
        last_stats = time.monotonic()
        self.monitor.start()
        clean = False
        try:
            while not self._stop.is_set():
                if time.monotonic() - self._last_sync >= self.config.control_sync_s:
                    self._sync_control()
                msg = self.consumer.poll(self.config.poll_timeout_s)
                if msg is not None and self._is_data(msg):
                    self._handle(msg)
                    self._consumed[(str(msg.topic()), int(msg.partition() or 0))] = \
                        int(msg.offset() or 0) + 1
                if not self._paused:
                    self._close_ready()
                now = time.monotonic()
                if now - last_stats > self.config.stats_interval_s:
                    last_stats = now
                    log.info("replay worker stats %s", self.stats.report())
                if self._epoch_done():
                    break
            clean = True
        finally:
            self.close(clean=clean)
        return self.stats

    def _is_data(self, msg: Any) -> bool:
        """True for a record; retriable errors are counted and retried (librdkafka keeps
        fetching), any other error ends the worker."""
        try:
            kind = self._messages.check(msg)
        except kafka.KafkaIOError as exc:
            raise WorkerError(f"{exc}; restart the worker") from exc
        if kind == "retry":
            self.stats.inc("kafka", "errors")
        return kind == "data"

    def close(self, *, clean: bool = False) -> None:
        """Release the clients; a clean stop also deletes the health file (a crash or a
        watchdog exit leaves it for ``flywheel replay status``)."""
        if not (clean and self.monitor.remove_health()):
            self.monitor.stop()
        self._write_on_revoke = clean
        self.consumer.close()  # revokes: a clean stop writes and commits complete blocks
        self.producer.close(30)
        self.control.close()
        log.info("replay worker stopped: %s", self.stats.report())
