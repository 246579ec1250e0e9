"""What happens to each window record before replay: a pure function of the record.

:func:`classify` decodes one message of a window topic and accepts it, or refuses it
with a stable reason code (the codes of :data:`streams.processors.validate.REASONS`):
undecodable bytes, a record that is not a Window, a wrong key or split, token ids
outside the teacher's vocabulary, bad anchor positions, and ``identity_mismatch`` for a
window whose identity id is not the loaded teacher's. Refused records become
QuarantineRecords (:func:`quarantine_record`); nothing refused reaches a shard.

:class:`PartitionLog` holds one partition's accepted windows until their block closes,
and drops a window whose id was already accepted at an earlier offset of the same
partition (the stream processors deliver at least once; a window's key, hence its
partition, is fixed, so "first occurrence in offset order" is deterministic).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hebrus_flywheel.consumers.epochs import Block, EpochPlan
from hebrus_flywheel.consumers.exceptions import WorkerError
from hebrus_flywheel.consumers.labels import SourceRef
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.exceptions import SchemaError
from hebrus_flywheel.streams import quarantine
from hebrus_flywheel.streams.processors.window_seal import (
    Erased,
    OwnerSealer,
    SealedBytesError,
    SealOpenError,
    default_sealer,
    readable_window,
)

WINDOW_SCHEMA = "hebrus.flywheel.v1.Window"
QUARANTINE_STAGE = "replay"


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The outcome of :func:`classify`: a decoded window, or a refusal with a reason."""

    window: dict[str, Any] | None
    reason: str | None = None
    detail: str = ""
    schema: str | None = None

    @property
    def accepted(self) -> bool:
        return self.reason is None


def _refuse(reason: str, detail: str, window: Mapping[str, Any] | None = None,
            schema: str | None = None) -> Verdict:
    return Verdict(window=None if window is None else dict(window), reason=reason,
                   detail=detail, schema=schema)


def _check_window(window: Mapping[str, Any], key: bytes | None, split: str,
                  vocab_size: int) -> tuple[str, str] | None:
    expected_key = f"{window['owner']}/{window['thread']}".encode()
    if key != expected_key:
        return "invalid_key", (f"message key {key!r} is not owner/thread {expected_key!r}; "
                               "the producer must key windows by owner/thread")
    if window["split"] != split:
        return "value_out_of_range", (f"window split {window['split']!r} arrived on the "
                                      f"{split!r} topic; the producer routed it wrongly")
    tokens, anchors = window["token_ids"], window["anchor_positions"]
    if not tokens or not anchors:
        return "missing_field", "window has no tokens or no anchors; nothing to replay"
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        return "token_id_out_of_range", (f"token id {bad} is outside the teacher vocabulary "
                                         f"[0, {vocab_size}); wrong tokenizer upstream")
    ordered = all(a < b for a, b in itertools.pairwise(anchors))
    if not ordered or anchors[0] < 0 or anchors[-1] >= len(tokens):
        return "value_out_of_range", (f"anchor positions must ascend strictly inside the "
                                      f"{len(tokens)} tokens; got {anchors[:5]}...")
    return None


WindowCheck = Callable[[Mapping[str, Any]], "tuple[str, str] | None"]
"""The engine's own refusal test (``consumers.engine.window_check``): reason and detail."""


def _open(version: int, record: dict[str, Any], opener: OwnerSealer | None
          ) -> dict[str, Any] | Verdict:
    """A sealed (``Window.v2``) record opened with the owner's key; ``owner_erased`` when
    an erasure destroyed the key, ``undecodable`` when its bytes do not open under it.
    A key store that is missing or another one stops the worker (fail closed)."""
    try:
        window = readable_window(version, record, opener or default_sealer())
    except SealedBytesError as exc:
        return _refuse("undecodable", str(exc), None, f"{WINDOW_SCHEMA}.v{version}")
    except SealOpenError as exc:
        raise WorkerError(f"{exc}; point $FLYWHEEL_OWNER_KEYS at the key store the capture "
                          "was sealed with, then restart the replay worker") from exc
    if isinstance(window, Erased):
        return _refuse("owner_erased", f"window sealed under {window.owner}/"
                       f"{window.generation}, a key destroyed by an erasure; metadata only",
                       None, f"{WINDOW_SCHEMA}.v{version}")
    return window


def classify(value: bytes | None, headers: Sequence[tuple[str, Any]] | None, key: bytes | None,
             *, split: str, identity_id: str, vocab_size: int,
             check: WindowCheck | None = None, opener: OwnerSealer | None = None) -> Verdict:
    """Accept a window message for replay, or say why it must be quarantined.

    ``Window.v2`` records are opened with ``opener`` (default: this process's reader of
    the local owner key store); a window of an erased owner is refused as
    ``owner_erased`` and quarantined as metadata only.

    ``check`` (the replay engine's ``check_window``) runs last, so a window the engine
    would refuse is quarantined here instead of failing a whole block's replay.
    """
    try:
        schema_key, record = codec.decode_message(value, headers or [])  # type: ignore[arg-type]
    except SchemaError as exc:
        return _refuse(getattr(exc, "reason", "undecodable"), f"{type(exc).__name__}: {exc}")
    schema = str(schema_key)
    if schema_key.name != WINDOW_SCHEMA:
        return _refuse("unexpected_schema", f"{schema} does not belong on a window topic",
                       record, schema)
    opened = _open(schema_key.version, record, opener)
    if isinstance(opened, Verdict):
        return opened
    record = opened
    if record["identity_id"] != identity_id:
        return _refuse("identity_mismatch", (
            f"window identity {record['identity_id']} is not the loaded teacher's {identity_id}; "
            "replay it with the teacher, tokenizer and dtype it was captured with"), record, schema)
    problem = _check_window(record, key, split, vocab_size)
    if problem is None and check is not None:
        problem = check(record)
    if problem is not None:
        return _refuse(problem[0], problem[1], record, schema)
    return Verdict(window=record, schema=schema)


def quarantine_record(verdict: Verdict, source: SourceRef, *, value: bytes | None,
                      key: bytes | None, headers: Iterable[tuple[str, Any]] | None,
                      max_value_bytes: int) -> dict[str, Any]:
    """A QuarantineRecord, every copied field cut to its bound
    (:func:`streams.quarantine.bound`), whose id depends only on stage, reason, source
    and thread."""
    raw = bytes(value or b"")
    rec = verdict.window or {}
    thread = f"{rec.get('owner')}/{rec.get('thread')}/{rec.get('generation')}"
    ident = "|".join((QUARANTINE_STAGE, str(verdict.reason), source.topic,
                      str(source.partition), str(source.offset), thread))
    generation = rec.get("generation")
    record = quarantine.bound({
        "quarantine_id": hashlib.sha256(ident.encode()).hexdigest(),
        "reason": verdict.reason, "detail": verdict.detail, "stage": QUARANTINE_STAGE,
        "source_topic": source.topic, "source_partition": source.partition,
        "source_offset": source.offset, "source_key": key,
        "source_headers": [{"key": str(k), "value": v.encode() if isinstance(v, str) else v}
                           for k, v in headers or ()],
        "value": raw, "value_size": len(raw),
        "value_sha256": hashlib.sha256(raw).hexdigest(),
        "value_truncated": False, "schema": verdict.schema,
        "owner": rec.get("owner"), "thread": rec.get("thread"),
        "generation": generation if isinstance(generation, int) else None,
        "producer_id": None,
    }, max_value_bytes=max_value_bytes)
    if verdict.reason == "owner_erased":  # nothing of an erased owner's record is copied
        return quarantine.reference(record, "owner erased")
    return record


@dataclass(frozen=True, kw_only=True)
class Accepted:
    """One window waiting for its block to close."""

    source: SourceRef
    window: dict[str, Any]


@dataclass
class PartitionLog:
    """One partition's progress: accepted windows of open blocks and ids already written.

    ``base`` is the first offset not yet in a closed block (a block start);
    ``consumed`` is one past the last offset seen. ``written_ids`` holds the ids of
    every window accepted at an offset before ``base``.
    """

    topic: str
    partition: int
    split: str
    base: int
    written_ids: set[str] = field(default_factory=set)
    consumed: int = -1
    pending: list[Accepted] = field(default_factory=list)
    pending_ids: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.consumed = max(self.consumed, self.base)

    def seen(self, offset: int) -> bool:
        """True for an offset before ``consumed`` (a redelivery after a seek or rebalance)."""
        return offset < self.consumed

    def skip(self, offset: int) -> None:
        """A refused record: only progress moves."""
        self.consumed = max(self.consumed, offset + 1)

    def admit(self, offset: int, window: dict[str, Any]) -> bool:
        """Queue an accepted window; False (and dropped) when its id was accepted earlier."""
        self.consumed = max(self.consumed, offset + 1)
        wid = window["window_id"]
        if wid in self.written_ids or wid in self.pending_ids:
            return False
        self.pending_ids.add(wid)
        source = SourceRef(topic=self.topic, partition=self.partition, offset=offset)
        self.pending.append(Accepted(source=source, window=window))
        return True

    def next_block(self, plan: EpochPlan) -> Block | None:
        """The block starting at ``base`` if every one of its offsets was consumed."""
        block = plan.block(self.topic, self.partition, self.base)
        return block if self.consumed >= block.end else None

    def take(self, block: Block) -> list[Accepted]:
        """Remove and return the block's windows; ``base`` moves to the block's end."""
        if block.first != self.base:
            raise WorkerError(
                f"block {block} does not start at base {self.base}; this is a bug in the "
                "worker's offset bookkeeping — restart the worker"
            )
        inside = [a for a in self.pending if a.source.offset < block.end]
        self.pending = [a for a in self.pending if a.source.offset >= block.end]
        for item in inside:
            self.pending_ids.discard(item.window["window_id"])
            self.written_ids.add(item.window["window_id"])
        self.base = block.end
        return inside
