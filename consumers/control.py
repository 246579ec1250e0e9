"""The epoch control topic: seal intents, epoch boundaries and sealed snapshots.

Records are canonical JSON (``content-type: application/json``, key ``epoch-<N>``) on
the single partition of ``flywheel.control.epochs.v1``, so every reader sees them in
one order. Kinds:

* ``seal_intent`` {epoch, intent_id, expires_at_ms}: a seal is about to read the end
  offsets. Workers stop closing open-epoch blocks until the boundary arrives (or the
  intent expires).
* ``epoch_boundary`` {epoch, intent_id, start, end, capture_end}: the per-partition
  offset range of the epoch over the window topics, and the capture topics' end
  offsets read just after. The FIRST boundary of an epoch wins; later ones are ignored
  (and reported).
* ``epoch_sealed`` {epoch, snapshot_id, manifest}: the manifest was written.

Why the intent. ``seal`` reads the end offsets W at some instant and publishes them
later. A worker that closed a full open-epoch block in between would have written a
shard spanning W. With the intent protocol a worker closes an open-epoch block only
after re-reading this topic (to its high watermark) and finding no live intent; the
seal publishes its intent, and only then reads W. Every offset the worker had consumed
existed before the intent was written, hence before W was read, so W lies at or after
the end of every block already closed: no shard ever spans a boundary.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

from hebrus_flywheel.consumers.epochs import EpochBoundary, freeze_offsets, offsets_json
from hebrus_flywheel.consumers.exceptions import ControlError
from hebrus_flywheel.core import kafka

log = logging.getLogger(__name__)
_LOG = "consumers.librdkafka"

CONTROL_FORMAT = "hebrus-flywheel-control/v1"
CONTENT_TYPE = "application/json"
KINDS = ("seal_intent", "epoch_boundary", "epoch_sealed")


def now_ms() -> int:
    return int(time.time() * 1000)


def encode_record(fmt: str, record: Mapping[str, Any]) -> bytes:
    """Canonical JSON of ``record`` tagged with ``format`` ``fmt``."""
    return json.dumps({"format": fmt, **record}, sort_keys=True, separators=(",", ":")).encode()


def _encode(record: Mapping[str, Any]) -> bytes:
    return encode_record(CONTROL_FORMAT, record)


def decode_record(offset: int, value: bytes | None, fmt: str,
                  ignored: list[str]) -> dict[str, Any] | None:
    """The ``fmt`` record at ``offset``; None (noted in ``ignored``) for anything else."""
    try:
        record = json.loads(value or b"")
    except (json.JSONDecodeError, UnicodeDecodeError):
        ignored.append(f"offset {offset}: not JSON")
        return None
    if not isinstance(record, dict) or record.get("format") != fmt:
        ignored.append(f"offset {offset}: not a {fmt} record")
        return None
    return record


def intent_record(epoch: int, ttl_s: float) -> dict[str, Any]:
    return {"kind": "seal_intent", "epoch": epoch, "intent_id": uuid.uuid4().hex,
            "expires_at_ms": now_ms() + int(ttl_s * 1000)}


def boundary_record(boundary: EpochBoundary, intent_id: str) -> dict[str, Any]:
    return {"kind": "epoch_boundary", "epoch": boundary.epoch, "intent_id": intent_id,
            "start": offsets_json(boundary.start), "end": offsets_json(boundary.end),
            "capture_end": offsets_json(boundary.capture_end)}


def sealed_record(epoch: int, snapshot_id: str, manifest: str) -> dict[str, Any]:
    return {"kind": "epoch_sealed", "epoch": epoch, "snapshot_id": snapshot_id,
            "manifest": manifest, "sealed_at_ms": now_ms()}


@dataclass
class ControlState:
    """Everything read from the control topic so far, folded in topic order."""

    boundaries: dict[int, EpochBoundary] = field(default_factory=dict)
    intents: dict[int, dict[str, Any]] = field(default_factory=dict)
    sealed: dict[int, dict[str, Any]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def apply(self, offset: int, value: bytes | None) -> None:
        record = decode_record(offset, value, CONTROL_FORMAT, self.ignored)
        if record is None:
            return
        kind, epoch = record.get("kind"), record.get("epoch")
        if kind not in KINDS or isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ControlError(
                f"control record at offset {offset} has kind {kind!r} / epoch {epoch!r}; the "
                "control topic is corrupt — fix or recreate it before running workers"
            )
        if kind == "seal_intent":
            self.intents[epoch] = record
        elif kind == "epoch_sealed":
            self.sealed.setdefault(epoch, record)
        elif epoch in self.boundaries:
            self.ignored.append(f"offset {offset}: second boundary for epoch {epoch} ignored")
        else:
            self.boundaries[epoch] = _boundary(offset, record)

    def ordered(self) -> list[EpochBoundary]:
        """Boundaries of epochs 0, 1, ... up to the first gap."""
        out: list[EpochBoundary] = []
        while len(out) in self.boundaries:
            out.append(self.boundaries[len(out)])
        return out

    @property
    def next_epoch(self) -> int:
        return len(self.ordered())

    def pending_intent(self, at_ms: int | None = None) -> dict[str, Any] | None:
        """A live intent to seal the open epoch whose boundary is not recorded yet."""
        intent = self.intents.get(self.next_epoch)
        if intent is None or intent.get("expires_at_ms", 0) <= (at_ms or now_ms()):
            return None
        return intent


def _boundary(offset: int, record: Mapping[str, Any]) -> EpochBoundary:
    try:
        return EpochBoundary(epoch=record["epoch"], start=freeze_offsets(record["start"]),
                             end=freeze_offsets(record["end"]),
                             capture_end=freeze_offsets(record.get("capture_end", {})))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ControlError(
            f"epoch boundary at control offset {offset} is malformed ({exc}); the control "
            "topic is corrupt — fix it before running workers or seals"
        ) from exc


class FoldedState(Protocol):
    def apply(self, offset: int, value: bytes | None) -> None: ...


S = TypeVar("S", bound=FoldedState)


class LogChannel(Generic[S]):
    """Reads a single-partition control topic to its end on demand, folding every record
    into ``state``, and publishes records (``encode``d, keyed ``epoch-<N>``)."""

    def __init__(self, bootstrap: kafka.KafkaTarget, topic: str, state: S, *,
                 encode: Callable[[Mapping[str, Any]], bytes], timeout_s: float = 15.0) -> None:
        self.kafka = kafka.client_config(bootstrap)
        self.bootstrap, self.topic, self.timeout_s = self.kafka.bootstrap_servers, topic, timeout_s
        self.state = state
        self._encode = encode
        self._tp = TopicPartition(topic, 0)
        self._next = 0
        self._producer: kafka.CheckedProducer | None = None
        self._consumer = kafka.make_consumer(self.kafka, log_name=_LOG)
        self._consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])

    def sync(self) -> S:
        """Read every record up to the topic's current high watermark; the folded state."""
        try:
            _, high = self.kafka.retry.call(
                lambda: self._consumer.get_watermark_offsets(self._tp, timeout=self.timeout_s),
                what=f"end offset of {self.topic}")
            if self._next < high:
                for msg in kafka.drain(self._consumer, {(self.topic, 0): high},
                                       retry=self.kafka.retry, timeout_s=self.timeout_s,
                                       what=f"reading the control topic {self.topic}"):
                    offset = int(msg.offset() or 0)
                    self.state.apply(offset, msg.value())
                    self._next = offset + 1
        except kafka.KafkaIOError as exc:
            raise ControlError(f"{exc}; is the broker up and the topic created "
                               "(`flywheel topics create`)?") from exc
        except KafkaException as exc:
            raise ControlError(
                f"cannot read the control topic {self.topic} on {self.bootstrap}: {exc}; is the "
                "broker up and the topic created (`flywheel topics create`)?"
            ) from exc
        return self.state

    def publish(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` and wait until the broker has it (acks=all)."""
        if self._producer is None:
            self._producer = kafka.CheckedProducer(self.kafka, log_name=_LOG)
        try:
            self._producer.produce(
                self.topic, key=f"epoch-{record['epoch']}".encode(),
                value=self._encode(record),
                headers=[("content-type", CONTENT_TYPE.encode()),
                         ("kind", record["kind"].encode())])
            self._producer.flush(self.timeout_s, what=f"the {record['kind']} record")
        except kafka.KafkaIOError as exc:
            raise ControlError(f"could not publish a {record['kind']} record to {self.topic}: "
                               f"{exc}") from exc

    def close(self) -> None:
        self._consumer.close()
        if self._producer is not None:
            self._producer.close(self.timeout_s)


class ControlChannel(LogChannel[ControlState]):
    """The epoch control topic (seal intents, boundaries, sealed epochs)."""

    def __init__(self, bootstrap: kafka.KafkaTarget, topic: str, *,
                 timeout_s: float = 15.0) -> None:
        super().__init__(bootstrap, topic, ControlState(), encode=_encode, timeout_s=timeout_s)
