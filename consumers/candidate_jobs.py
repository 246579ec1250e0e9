"""The candidate product's own topics: block work items and the candidate control log.

``flywheel.candidates.blocks.v1`` (keyed ``<job>/<topic>/<partition>/<first>``, as many
partitions as the keyed topics): one work item per block of a sealed clean epoch, the
unit a candidate worker replays. An item names its job (the clean snapshot's id and
location, the candidate root, the drafters and W, B and anchors per window) and its block
(epoch, split, window topic, partition, ``[first, end)``, the accepted offsets and their
window ids). It holds references only, never tokens: the worker reads the windows from
the window topic, where they are sealed under their owners' data keys, so erasing an
owner leaves nothing readable here.

``flywheel.control.candidates.v1`` (one partition, one order for every reader):

* ``candidate_plan`` {epoch, job, blocks}: every block key of the job, written after its
  work items were delivered;
* ``candidate_shard`` {epoch, job_id, block, relpath, rows, replayed, seconds,
  accepted_tokens, worker}: a worker wrote (or found) the block's shard; published
  before the work item's offset is committed, so a crash in between republishes it;
* ``candidate_refused`` {epoch, job_id, block, reason, worker}: a worker cannot serve
  the job at all (its snapshot cannot be opened, the teacher is not the snapshot's, a
  planned window is gone); the planner stops waiting and says why;
* ``candidate_sealed`` {epoch, job_id, snapshot_id}.

Records are canonical JSON with ``format`` :data:`CANDIDATE_FORMAT`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hebrus_flywheel.consumers.control import LogChannel, decode_record, encode_record
from hebrus_flywheel.consumers.epochs import Block
from hebrus_flywheel.consumers.exceptions import ControlError
from hebrus_flywheel.consumers.intake import Accepted
from hebrus_flywheel.core import kafka
from hebrus_flywheel.streams.topics import CANDIDATE_BLOCKS_TOPIC, CANDIDATE_CONTROL_TOPIC

CANDIDATE_FORMAT = "hebrus-flywheel-candidates/v1"
CONTENT_TYPE = "application/json"
CANDIDATE_GROUP = "flywheel-replay-candidates"
"""The candidate workers' consumer group (under the replay role's ``flywheel-replay*``)."""
_KINDS = ("candidate_plan", "candidate_shard", "candidate_refused", "candidate_sealed")
_LOG = "consumers.librdkafka"


def encode(record: Mapping[str, Any]) -> bytes:
    return encode_record(CANDIDATE_FORMAT, record)


@dataclass(frozen=True, kw_only=True)
class CandidateJob:
    """What a worker needs, besides its teacher, to replay any block of one job."""

    clean_snapshot_id: str
    snapshot: str
    """The sealed clean epoch (directory or manifest) as the workers can open it."""
    out: str
    """The candidate dataset root the shards go under."""
    epoch: int
    drafters: tuple[str, ...]
    width: int
    depth: int
    anchors_per_window: int
    job_id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafters", tuple(self.drafters))
        digest = hashlib.sha256(encode({**asdict(self), "job_id": ""})).hexdigest()[:16]
        if self.job_id and self.job_id != digest:
            raise ControlError(f"candidate job {self.job_id} does not match its contents "
                               f"(digest {digest}); the work item was altered")
        object.__setattr__(self, "job_id", digest)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "drafters": list(self.drafters)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CandidateJob:
        try:
            return cls(**{**data, "drafters": tuple(data["drafters"])})
        except (KeyError, TypeError) as exc:
            raise ControlError(f"malformed candidate job {dict(data)}: {exc}") from exc


def block_key(topic: str, partition: int, first: int) -> str:
    return f"{topic}/{partition}/{first}"


@dataclass(frozen=True, kw_only=True)
class WorkItem:
    """One block of one job: where its accepted windows are on the window topic."""

    job: CandidateJob
    split: str
    topic: str
    partition: int
    first: int
    end: int
    offsets: tuple[int, ...]
    window_ids: tuple[str, ...]

    @property
    def key(self) -> str:
        return block_key(self.topic, self.partition, self.first)

    @property
    def block(self) -> Block:
        return Block(topic=self.topic, partition=self.partition, epoch=self.job.epoch,
                     first=self.first, end=self.end, final=True)

    def to_record(self) -> dict[str, Any]:
        return {"kind": "candidate_block", "epoch": self.job.epoch, "job": self.job.to_dict(),
                "split": self.split, "topic": self.topic, "partition": self.partition,
                "first": self.first, "end": self.end, "offsets": list(self.offsets),
                "window_ids": list(self.window_ids)}

    @classmethod
    def of(cls, job: CandidateJob, block: Block, split: str,
           items: Sequence[Accepted]) -> WorkItem:
        return cls(job=job, split=split, topic=block.topic, partition=block.partition,
                   first=block.first, end=block.end,
                   offsets=tuple(a.source.offset for a in items),
                   window_ids=tuple(str(a.window["window_id"]) for a in items))


def decode_item(value: bytes | None, where: str) -> WorkItem:
    """The work item in ``value``; ControlError naming ``where`` when it is not one."""
    try:
        record = json.loads(value or b"")
        if record.get("format") != CANDIDATE_FORMAT or record.get("kind") != "candidate_block":
            raise ValueError(f"not a {CANDIDATE_FORMAT} candidate_block record")
        return WorkItem(job=CandidateJob.from_dict(record["job"]), split=str(record["split"]),
                        topic=str(record["topic"]), partition=int(record["partition"]),
                        first=int(record["first"]), end=int(record["end"]),
                        offsets=tuple(int(o) for o in record["offsets"]),
                        window_ids=tuple(str(w) for w in record["window_ids"]))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ControlError(f"{where} is not a candidate work item ({exc})") from exc


@dataclass
class CandidateState:
    """Everything read from the candidate control topic, folded in topic order."""

    plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    shards: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    sealed: dict[str, dict[str, Any]] = field(default_factory=dict)
    refused: dict[str, dict[str, Any]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def apply(self, offset: int, value: bytes | None) -> None:
        record = decode_record(offset, value, CANDIDATE_FORMAT, self.ignored)
        if record is None:
            return
        if record.get("kind") not in _KINDS:
            self.ignored.append(f"offset {offset}: not a {CANDIDATE_FORMAT} record")
            return
        kind = record["kind"]
        job_id = str(record.get("job_id") or (record.get("job") or {}).get("job_id"))
        if kind == "candidate_plan":
            self.plans.setdefault(job_id, record)
        elif kind == "candidate_sealed":
            self.sealed.setdefault(job_id, record)
        elif kind == "candidate_refused":
            self.refused.setdefault(job_id, record)
        else:
            done = self.shards.setdefault(job_id, {})
            first = done.get(record["block"])
            # the first record of a block stands, unless it only found a shard that an
            # earlier, replaying record had measured (its cost is the one to keep)
            if first is None or (record.get("replayed") and not first.get("replayed")):
                done[record["block"]] = record

    def missing(self, job_id: str) -> list[str]:
        """Planned blocks of ``job_id`` no worker has reported; every block when unplanned."""
        plan = self.plans.get(job_id)
        if plan is None:
            return ["<plan>"]
        done = self.shards.get(job_id, {})
        return [key for key in plan["blocks"] if key not in done]

    def reports(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.shards.get(job_id, {}).values())


def control_channel(bootstrap: kafka.KafkaTarget, prefix: str, *,
                    timeout_s: float = 15.0) -> LogChannel[CandidateState]:
    return LogChannel(bootstrap, prefix + CANDIDATE_CONTROL_TOPIC, CandidateState(),
                      encode=encode, timeout_s=timeout_s)


def publish_items(bootstrap: kafka.KafkaTarget, prefix: str, items: Iterable[WorkItem], *,
                  timeout_s: float = 30.0) -> int:
    """Produce every work item to the blocks topic and wait until the broker has them all."""
    producer = kafka.CheckedProducer(kafka.client_config(bootstrap), log_name=_LOG)
    topic, count = prefix + CANDIDATE_BLOCKS_TOPIC, 0
    try:
        for item in items:
            producer.produce(topic, key=f"{item.job.job_id}/{item.key}".encode(),
                             value=encode(item.to_record()),
                             headers=[("content-type", CONTENT_TYPE.encode())])
            count += 1
        producer.flush(timeout_s, what=f"{count} candidate work items")
    except kafka.KafkaIOError as exc:
        raise ControlError(f"could not publish candidate work items to {topic}: {exc}; is "
                           "the topic created (`flywheel topics create`)?") from exc
    finally:
        producer.close(timeout_s)
    return count
