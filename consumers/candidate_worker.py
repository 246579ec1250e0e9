"""``flywheel replay candidate-worker``: candidate work items in, candidate shards out.

A worker consumes ``<P>flywheel.candidates.blocks.v1`` in the group
``<P>flywheel-replay-candidates`` (cooperative-sticky, manual commits), so any number of
workers share the blocks of every job and a worker that dies hands its partitions on.
Per work item (:mod:`consumers.candidate_jobs`):

1. the job's clean manifest is opened and the teacher loaded as it sealed that epoch
   (identity, dtype, kernel path, feature projection), once per job;
2. the block's shard already on disk is kept (shards are written atomically and their
   bytes depend only on the windows and the job); otherwise the listed offsets are read
   from the window topic, classified with the replay worker's checks, checked against
   the planned window ids and the consent ledger again, and every drafter (built once
   per job, on first need) drafts W paths of depth B at an evenly spaced subset of each
   window's anchors, replayed by :class:`replay.candidates.replay.CandidateReplayer`;
3. the shard is written, a ``candidate_shard`` record is published to the candidate
   control topic and only then is the item's offset committed. A crash before the
   commit redelivers the item; the rerun finds the shard and reports it again.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import KafkaException, TopicPartition

from hebrus_flywheel.consumers.candidate_jobs import (
    CANDIDATE_GROUP,
    CandidateJob,
    WorkItem,
    control_channel,
    decode_item,
)
from hebrus_flywheel.consumers.candidates import CandidateBlock, write_candidate_shard
from hebrus_flywheel.consumers.dataset import config_digest
from hebrus_flywheel.consumers.engine import window_check
from hebrus_flywheel.consumers.exceptions import ControlError, JobRefused, WorkerError
from hebrus_flywheel.consumers.intake import classify
from hebrus_flywheel.consumers.kafka_io import read_ranges
from hebrus_flywheel.consumers.labels import SourceRef
from hebrus_flywheel.consumers.rebuild import load_for_snapshot
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError, FlywheelError
from hebrus_flywheel.core.snapshot import load_manifest
from hebrus_flywheel.streams.consent import CONSENT_TOPIC, now_ms, scope_for_split
from hebrus_flywheel.streams.consent_book import ConsentBook
from hebrus_flywheel.streams.topics import CANDIDATE_BLOCKS_TOPIC

log = logging.getLogger(__name__)
_LOG = "consumers.librdkafka"


@dataclass(frozen=True, kw_only=True)
class CandidateWorkerConfig:
    """One candidate worker.

    Fields:
        teacher: teacher checkpoint directory; its identity must be each job's snapshot's.
        bootstrap: Kafka bootstrap servers.
        prefix: topic prefix (the teacher's namespace by default, as for replay workers).
        group_id: consumer group, under ``prefix``.
        max_idle_s: stop after this long without a work item (None: run until stopped).
        timeout_s: give up reading a block's windows after this long without progress.
    """

    teacher: Path
    bootstrap: str
    prefix: str = ""
    group_id: str = CANDIDATE_GROUP
    max_idle_s: float | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_idle_s is not None and self.max_idle_s <= 0:
            raise ConfigError("CandidateWorkerConfig.max_idle_s must be > 0 or None")
        if self.timeout_s <= 0:
            raise ConfigError("CandidateWorkerConfig.timeout_s must be > 0")


def thin_anchors(window: Mapping[str, Any], keep: int) -> dict[str, Any]:
    """``window`` with at most ``keep`` of its anchors, evenly spaced, first and last kept."""
    anchors = [int(a) for a in window["anchor_positions"]]
    if len(anchors) > keep:
        picks = np.unique(np.linspace(0, len(anchors) - 1, keep).round().astype(int))
        anchors = [anchors[i] for i in picks.tolist()]
    return {**window, "anchor_positions": anchors}


def job_determinism(job: CandidateJob) -> dict[str, Any]:
    """What, besides the windows and the teacher, decides a job's candidate rows."""
    return {"drafters": list(job.drafters), "width": job.width, "depth": job.depth,
            "anchors_per_window": job.anchors_per_window}


@dataclass
class JobRuntime:
    """One job's teacher bundle, and its replayers once a block needs them."""

    job: CandidateJob
    manifest: dict[str, Any]
    bundle: Any
    consent: ConsentBook
    _replayers: list[Any] | None = None

    @property
    def replayers(self) -> list[Any]:
        if self._replayers is None:
            from hebrus_flywheel.consumers.candidate_drafters import build_replayers

            self._replayers = build_replayers(self.job, self.manifest, self.bundle)
        return self._replayers

    @property
    def digest(self) -> str:
        return config_digest({**self.manifest["determinism"],
                              "candidates": job_determinism(self.job)})

    @property
    def shard(self) -> ShardConfig:
        return ShardConfig(**self.manifest["determinism"]["shard"])


@dataclass
class JobCache:
    """Loaded jobs by id (a worker serves every job on its topic); the ``keep`` most
    recently used stay loaded (each holds a teacher bundle and its drafters)."""

    teacher_dir: Path
    bootstrap: str
    prefix: str
    teacher: Any = None
    keep: int = 2
    jobs: dict[str, JobRuntime] = field(default_factory=dict)

    def get(self, job: CandidateJob) -> JobRuntime:
        """The job's runtime; JobRefused when this worker cannot serve it."""
        if job.job_id not in self.jobs:
            try:
                self.jobs[job.job_id] = self._load(job)
            except JobRefused:
                raise
            except (FlywheelError, OSError, KeyError) as exc:
                raise JobRefused(f"cannot open {job.snapshot} with the teacher in "
                                 f"{self.teacher_dir}: {exc}") from exc
        self.jobs[job.job_id] = self.jobs.pop(job.job_id)  # most recently used last
        while len(self.jobs) > self.keep:
            self.jobs.pop(next(iter(self.jobs)))
        return self.jobs[job.job_id]

    def _load(self, job: CandidateJob) -> JobRuntime:
        manifest = load_manifest(Path(job.snapshot)).to_dict()
        if manifest["snapshot_id"] != job.clean_snapshot_id:
            raise JobRefused(f"{job.snapshot} holds snapshot {manifest['snapshot_id']}, the "
                             f"candidate job {job.job_id} was planned on "
                             f"{job.clean_snapshot_id}; plan it again")
        bundle = load_for_snapshot(manifest, self.teacher_dir, teacher=self.teacher)
        consent = ConsentBook(bootstrap=self.bootstrap, topic=self.prefix + CONSENT_TOPIC)
        return JobRuntime(job=job, manifest=manifest, bundle=bundle, consent=consent)


def replay_block(runtime: JobRuntime, item: WorkItem, windows: Sequence[tuple[dict[str, Any],
                 SourceRef]]) -> tuple[list[tuple[Any, SourceRef]], float, int]:
    """Every drafter's candidate anchors of ``windows``: (labelled anchors, replay seconds,
    accepted tokens)."""
    thinned = [thin_anchors(w, runtime.job.anchors_per_window) for w, _ in windows]
    labelled: list[tuple[Any, SourceRef]] = []
    seconds, accepted = 0.0, 0
    for replayer in runtime.replayers:
        before = replayer.stats.accepted_tokens
        started = time.perf_counter()
        per_window = replayer.replay(thinned)
        seconds += time.perf_counter() - started
        accepted += replayer.stats.accepted_tokens - before
        for (_, source), anchors in zip(windows, per_window, strict=True):
            labelled += [(anchor, source) for anchor in anchors]
    return labelled, seconds, accepted


class CandidateWorker:
    """Runs the consume → read windows → replay → shard → report → commit loop."""

    def __init__(self, config: CandidateWorkerConfig, *, teacher: Any = None,
                 jobs: JobCache | None = None) -> None:
        self.config = config
        self.kafka = kafka.client_config(config.bootstrap)
        self.jobs = jobs or JobCache(teacher_dir=config.teacher, bootstrap=config.bootstrap,
                                     prefix=config.prefix, teacher=teacher)
        self.stats = Counters()
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.control = control_channel(config.bootstrap, config.prefix)
        self._stopping = False
        self._messages = kafka.MessageCheck(self.kafka.retry, "candidate worker consume")
        self.consumer = kafka.make_consumer(
            self.kafka, group_id=config.prefix + config.group_id, log_name=_LOG, settings={
                "auto.offset.reset": "earliest",
                "partition.assignment.strategy": "cooperative-sticky",
                # one block replays every drafter over its windows: minutes on a CPU
                "max.poll.interval.ms": 1_800_000})
        self.consumer.subscribe([config.prefix + CANDIDATE_BLOCKS_TOPIC])

    def stop(self) -> None:
        self._stopping = True

    def run(self, until: Callable[[], bool] | None = None) -> Counters:
        """Serve work items until stopped, idle for ``max_idle_s`` or ``until()`` holds."""
        idle_since = time.monotonic()
        try:
            while not self._stopping and not (until is not None and until()):
                msg = self.consumer.poll(1.0)
                if msg is None:
                    limit = self.config.max_idle_s
                    if limit is not None and time.monotonic() - idle_since > limit:
                        break
                    continue
                if self._is_data(msg):
                    self.handle(msg)
                idle_since = time.monotonic()
        finally:
            self.close()
        return self.stats

    def _is_data(self, msg: Any) -> bool:
        try:
            return self._messages.check(msg) == "data"
        except kafka.KafkaIOError as exc:
            raise WorkerError(f"{exc}; restart the candidate worker") from exc

    def handle(self, msg: Any) -> None:
        where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
        try:
            item = decode_item(msg.value(), where)
        except ControlError as exc:  # nothing to replay; never blocks the partition
            log.error("%s; skipped", exc)
            self.stats.inc("items", "malformed")
        else:
            try:
                record = self.process(item)
            except JobRefused as exc:
                log.error("candidate job %s refused: %s", item.job.job_id, exc)
                self.stats.inc("items", "refused")
                record = {"kind": "candidate_refused", "epoch": item.job.epoch,
                          "job_id": item.job.job_id, "block": item.key, "reason": str(exc),
                          "worker": self.name}
            self.control.publish(record)
        where_next = TopicPartition(msg.topic(), msg.partition(), msg.offset() + 1)
        try:
            self.kafka.retry.call(
                lambda: self.consumer.commit(offsets=[where_next], asynchronous=False),
                what=f"commit of {where}")
        except (kafka.KafkaIOError, KafkaException) as exc:  # the next owner finds the shard
            log.warning("commit of %s failed (%s); its next owner reports the shard again",
                        where, exc)
            return
        self.stats.inc("commit", "items")

    def process(self, item: WorkItem) -> dict[str, Any]:
        """Write (or find) the item's shard; its ``candidate_shard`` record."""
        runtime = self.jobs.get(item.job)
        block = CandidateBlock(epoch=item.job.epoch, split=item.split, topic=item.topic,
                               partition=item.partition, first_offset=item.first,
                               last_offset=item.end - 1, windows=len(item.offsets))
        record = {"kind": "candidate_shard", "epoch": item.job.epoch,
                  "job_id": item.job.job_id, "block": item.key, "relpath": block.relpath,
                  "worker": self.name, "replayed": False, "seconds": 0.0,
                  "accepted_tokens": 0, "rows": None}
        if (Path(item.job.out) / block.relpath).is_file():
            self.stats.inc("items", "kept")
            return record
        windows = self.read_windows(runtime, item)
        labelled, seconds, accepted = replay_block(runtime, item, windows)
        record.update(replayed=True, seconds=round(seconds, 6), accepted_tokens=accepted)
        if not labelled:
            self.stats.inc("items", "empty")
            return {**record, "relpath": None, "rows": 0}
        block = CandidateBlock(**{**block.__dict__, "windows": len(windows)})
        info = write_candidate_shard(
            Path(item.job.out), block, labelled, runtime_layout(runtime),
            identity_id=runtime.bundle.identity["identity_id"], config_digest=runtime.digest,
            shard=runtime.shard)
        self.stats.inc("items", "replayed")
        log.info("candidate shard %s: %d windows, %d rows", info.relpath, len(windows),
                 info.rows)
        return {**record, "rows": info.rows}

    def read_windows(self, runtime: JobRuntime, item: WorkItem
                     ) -> list[tuple[dict[str, Any], SourceRef]]:
        """The item's planned windows, read from the window topic and checked again."""
        wanted = dict(zip(item.offsets, item.window_ids, strict=True))
        check, bundle = window_check(runtime.bundle), runtime.bundle
        runtime.consent.load()
        out: list[tuple[dict[str, Any], SourceRef]] = []
        ranges = {(item.topic, item.partition): (item.first, item.end)}
        for msg in read_ranges(self.kafka, ranges, timeout_s=self.config.timeout_s,
                               error=WorkerError):
            if msg.offset() not in wanted:
                continue
            verdict = classify(msg.value(), msg.headers(), msg.key(), split=item.split,
                               identity_id=bundle.identity["identity_id"],
                               vocab_size=bundle.vocab_size, check=check)
            window = verdict.window or {}
            if not verdict.accepted or window.get("window_id") != wanted[msg.offset()]:
                raise JobRefused(
                    f"{item.topic}[{item.partition}]@{msg.offset()} no longer holds the planned "
                    f"window {wanted[msg.offset()]} ({verdict.reason or 'another window'}); "
                    "the window topic changed under the job — plan it again")
            if not runtime.consent.allows(str(window.get("owner")), scope_for_split(item.split),
                                          now_ms()):
                self.stats.inc("quarantine", "no_consent")
                continue
            out.append((window, SourceRef(topic=item.topic, partition=item.partition,
                                          offset=int(msg.offset()))))
        return out

    def close(self) -> None:
        self.consumer.close()
        self.control.close()


def runtime_layout(runtime: JobRuntime) -> Any:
    """The candidate shard layout of the job's replayers (feature width, dtype, projection)."""
    from hebrus_flywheel.consumers.candidates import candidate_layout

    first = runtime.replayers[0]
    return candidate_layout(runtime.bundle.teacher.geometry,
                            feature_dim=first.config.feature_dim,
                            feature_dtype=first.config.feature_dtype,
                            projection=first.projection.contract(first.config.feature_dtype))
