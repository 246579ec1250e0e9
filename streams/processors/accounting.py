"""``flywheel streams accounting``: did every consumed capture record reach an output?

For each capture topic partition (transcripts, observations, identities) the records
from the low watermark up to the group's committed offset are read back and each is
put in exactly one class, first match wins:

* ``quarantined``: a quarantine record names its source coordinates (topic,
  partition, offset), reference-only records included;
* ``generation_quarantined``: its thread generation (owner, thread, generation, from
  the decoded record) was quarantined as a whole: a quarantine record of the assemble
  stage without a value (``incomplete_thread``, a route inconsistency) names it;
* ``windowed``: a window of its generation contains it: an observation whose
  ``token_ordinal`` is one of the window's anchors, a turn listed in its ``turns``;
* ``in_windowed_generation``: its generation has windows, but no window holds this
  record itself (a token that is no anchor, a turn after the last anchor);
* ``duplicate``: its generation was dropped by the dedup stage (by the decision's
  reason: ``exact_duplicate``, ``near_duplicate``, ``near_duplicate_of_train``,
  ``near_duplicate_of_evaluation``);
* ``kept_without_window``: its generation was kept but had no eligible anchor;
* ``pending``: its generation is still open (or complete and awaiting its decision)
  in the latest ``capture-state`` changelog header: an open window;
* ``identity``: a RuntimeIdentity record on the identities topic (kept in the
  identity book, which is read from that topic);
* ``unaccounted``: none of the above: the record was consumed (its offset is below
  the committed one) yet it is in no output and in no open state. A healthy worker
  has none.

``by_reason`` splits ``quarantined``, ``generation_quarantined`` and ``duplicate`` by the
quarantine or dedup reason; the report's top-level ``unaccounted`` is the total. State
expiry (:mod:`streams.processors.expiry`) never loses a record's class: a generation's
header is deleted only after it finished, and its outputs (windows, decisions,
quarantine records) are on their topics; an open generation is never expired, it is
closed on idle (windowed, or quarantined ``incomplete_thread``).

What this does *not* prove: a record counted through its generation (every class but
``quarantined`` and ``windowed``) is accounted for at thread-generation level only, and
a duplicate record of an applied one counts with its generation. The committed offsets
are read first and the outputs after them; the worker commits only after every output
of a record was acknowledged, so every output of a counted record is already readable.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hebrus_flywheel.core import kafka
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.owner_seal import SealOpenError
from hebrus_flywheel.streams.processors.common import SEP
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.state_codec import SealedState, StateDecodeError, loads
from hebrus_flywheel.streams.processors.state_seal import StateSealer
from hebrus_flywheel.streams.processors.topology import DEFAULT_APP_ID, StreamTopics
from hebrus_flywheel.streams.processors.window_seal import default_sealer

CLASSES = ("quarantined", "generation_quarantined", "windowed", "in_windowed_generation",
           "duplicate", "kept_without_window", "pending", "identity", "unaccounted")
BY_REASON = ("quarantined", "generation_quarantined", "duplicate")
"""The classes counted by reason as well."""
OPEN_STATES = ("open", "ready")
Generation = tuple[str, str, int]
Coordinates = tuple[str, int, int]
SHOWN_OFFSETS = 20


@dataclass
class Outputs:
    """What the worker's outputs say, gathered from the output topics."""

    quarantined: dict[Coordinates, str] = field(default_factory=dict)
    """Source coordinates -> quarantine reason."""
    quarantined_generations: dict[Generation, str] = field(default_factory=dict)
    anchors: dict[Generation, set[int]] = field(default_factory=dict)
    turns: dict[Generation, set[int]] = field(default_factory=dict)
    decided: dict[Generation, tuple[bool, str]] = field(default_factory=dict)
    """Generation -> (kept, dedup reason) of its decision."""
    in_state: set[Generation] = field(default_factory=set)
    refused_state: list[list[Any]] = field(default_factory=list)
    """``[topic, partition, offset]`` of state headers that are no state-codec record."""

    def add_quarantine(self, record: Mapping[str, Any]) -> None:
        reason = str(record.get("reason") or "unknown")
        self.quarantined[(str(record["source_topic"]), int(record["source_partition"]),
                          int(record["source_offset"]))] = reason
        whole = record.get("stage") == "assemble" and not record.get("value_size")
        if whole and record.get("owner") and record.get("thread") \
                and record.get("generation") is not None:
            self.quarantined_generations[
                (str(record["owner"]), str(record["thread"]), int(record["generation"]))] = reason

    def add_decision(self, decision: Mapping[str, Any]) -> None:
        gen = (str(decision["owner"]), str(decision["thread"]), int(decision["generation"]))
        kept = bool(decision.get("keep", True))
        if gen in self.decided and self.decided[gen][0] and not kept:
            return  # one teacher kept it, another dropped it: the records have windows
        self.decided[gen] = (kept, str(decision.get("reason") or "unknown"))

    def add_window(self, window: Mapping[str, Any]) -> None:
        gen = (str(window["owner"]), str(window["thread"]), int(window["generation"]))
        first = int(window["first_token_ordinal"])
        self.anchors.setdefault(gen, set()).update(first + int(p)
                                                   for p in window["anchor_positions"])
        self.turns.setdefault(gen, set()).update(int(t["turn_index"]) for t in window["turns"])


def classify(kind: str, coordinates: Coordinates, record: Mapping[str, Any] | None,
             outputs: Outputs) -> str:
    """The class of one consumed capture record (``record`` is None when undecodable)."""
    if coordinates in outputs.quarantined:
        return "quarantined"
    if record is None:
        return "unaccounted"
    if kind == "identities":
        return "identity" if "identity_id" in record and "owner" not in record else "unaccounted"
    try:
        gen = (str(record["owner"]), str(record["thread"]), int(record["generation"]))
    except (KeyError, TypeError, ValueError):
        return "unaccounted"
    return _generation_class(kind, gen, record, outputs)


def _generation_class(kind: str, gen: Generation, record: Mapping[str, Any],
                      outputs: Outputs) -> str:
    if gen in outputs.quarantined_generations:
        return "generation_quarantined"
    if gen in outputs.anchors:
        if kind == "observations":
            mine = record.get("token_ordinal") in outputs.anchors[gen]
        else:
            mine = record.get("turn_index") in outputs.turns.get(gen, set())
        return "windowed" if mine else "in_windowed_generation"
    if gen in outputs.decided:
        return "kept_without_window" if outputs.decided[gen][0] else "duplicate"
    if gen in outputs.in_state:
        return "pending"
    return "unaccounted"


def reason_of(cls: str, coordinates: Coordinates, record: Mapping[str, Any] | None,
              outputs: Outputs) -> str | None:
    """The quarantine or dedup reason of a record in a :data:`BY_REASON` class."""
    if cls == "quarantined":
        return outputs.quarantined[coordinates]
    if record is None or cls not in BY_REASON:
        return None
    gen = (str(record["owner"]), str(record["thread"]), int(record["generation"]))
    if cls == "generation_quarantined":
        return outputs.quarantined_generations[gen]
    return outputs.decided[gen][1]


class PartitionTally:
    """Counts per class of one capture partition, fed one record at a time."""

    def __init__(self, kind: str, topic: str, partition: int, committed: int) -> None:
        self.kind, self.topic, self.partition, self.committed = kind, topic, partition, committed
        self.counts: Counter[str] = Counter()
        self.reasons: dict[str, Counter[str]] = {c: Counter() for c in BY_REASON}
        self.missing: list[int] = []

    def add(self, offset: int, record: Mapping[str, Any] | None, outputs: Outputs) -> None:
        where = (self.topic, self.partition, offset)
        cls = classify(self.kind, where, record, outputs)
        self.counts[cls] += 1
        reason = reason_of(cls, where, record, outputs)
        if reason is not None:
            self.reasons[cls][reason] += 1
        if cls == "unaccounted" and len(self.missing) < SHOWN_OFFSETS:
            self.missing.append(offset)

    def row(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "committed": self.committed,
                "records": sum(self.counts.values()), **{c: self.counts[c] for c in CLASSES},
                "by_reason": {c: dict(sorted(r.items())) for c, r in self.reasons.items()},
                "unaccounted_offsets": self.missing}


def tally(kind: str, topic: str, partition: int, committed: int,
          records: Iterable[tuple[int, Mapping[str, Any] | None]],
          outputs: Outputs) -> dict[str, Any]:
    """One partition's accounting: counts per class over ``(offset, decoded record)``."""
    counter = PartitionTally(kind, topic, partition, committed)
    for offset, record in records:
        counter.add(offset, record, outputs)
    return counter.row()


CAPTURE_STATE = "capture-state"
"""The capture table's name (``streams.processors.app.CAPTURE_TABLE``)."""


def apply_changelog(in_state: dict[str, Generation | None], key: bytes | None,
                    value: bytes | None) -> bool:
    """Fold one ``capture-state`` changelog message into ``iid -> open generation``
    (the latest header per thread generation wins; tombstones and closed ones remove).

    False when a header's value is no state-codec record: it is refused unread (never
    run as code) and counts as no open state."""
    text = _table_key(key)
    if not text.startswith(f"h{SEP}"):
        return True
    iid = text[2:]
    try:
        header = loads(value) if value else None
        if isinstance(header, SealedState):  # sealed under the owner's key (state_seal)
            header = _state_sealer().open(text, header)
    except (StateDecodeError, SealOpenError):
        in_state.pop(iid, None)
        return False
    if isinstance(header, Mapping) and header.get("status") in OPEN_STATES:
        in_state[iid] = (str(header["owner"]), str(header["thread"]),
                         int(header["generation"]))
    else:
        in_state.pop(iid, None)
    return True


def _state_sealer() -> StateSealer:
    """Opens ``capture-state`` headers with this process's reader of the owner key store
    (an erased owner's header opens as Erased: no open state)."""
    return StateSealer(default_sealer(), CAPTURE_STATE)


def _table_key(key: bytes | None) -> str:
    """A faust table key: JSON-encoded (the table key serializer) or raw UTF-8."""
    raw = key or b""
    if raw.startswith(b'"'):
        try:
            text = json.loads(raw)
        except ValueError:
            text = None
        if isinstance(text, str):
            return text
    return raw.decode("utf-8", "replace")


def _decode(value: bytes | None) -> dict[str, Any] | None:
    try:
        _, record = codec.decode(value or b"")
    except Exception:  # undecodable capture records are expected here
        return None
    return record if isinstance(record, dict) else None


def gather_outputs(bootstrap: str, topics: StreamTopics, group: str) -> Outputs:
    """Quarantine records, windows, decisions and open state headers, read to their end."""
    out = Outputs()
    for msg in read_topic(bootstrap, topics.quarantine):
        record = _decode(msg.value())
        if record is not None and "source_topic" in record:
            out.add_quarantine(record)
    for topic in topics.windows.values():
        for msg in read_topic(bootstrap, topic):
            window = _decode(msg.value())
            if window is not None:
                out.add_window(window)
    for msg in read_topic(bootstrap, topics.decisions):
        d = _decode_json(msg.value())
        if d is not None:
            out.add_decision(d)
    open_headers: dict[str, Generation | None] = {}
    changelog = f"{group}-{CAPTURE_STATE}-changelog"
    for msg in read_topic(bootstrap, changelog):
        if not apply_changelog(open_headers, msg.key(), msg.value()):
            out.refused_state.append([changelog, msg.partition(), msg.offset()])
    out.in_state = {g for g in open_headers.values() if g is not None}
    return out


def _decode_json(value: bytes | None) -> dict[str, Any] | None:
    try:
        d = json.loads(value or b"null")
    except ValueError:
        return None
    return d if isinstance(d, dict) and {"owner", "thread", "generation"} <= d.keys() else None


def account(bootstrap: str, *, prefix: str = "", app_id: str = DEFAULT_APP_ID,
            timeout_s: float = 60.0) -> dict[str, Any]:
    """Per capture partition: records up to the committed offset and their classes."""
    topics = StreamTopics.from_prefix(prefix, app_id)
    group, config = prefix + app_id, kafka.client_config(bootstrap)
    kinds = {name: kind for kind, name in topics.capture_kinds().items()}
    marks = kafka.end_watermarks(config, kinds, timeout_s=timeout_s, missing_ok=True)
    done = kafka.committed_offsets(config, group, list(marks), timeout_s=timeout_s)
    ranges = {tp: (low, max(low, done.get(tp, -1))) for tp, (low, _) in marks.items()}
    outputs = gather_outputs(bootstrap, topics, group)  # after the commits: see above
    per = {(t, p): PartitionTally(kinds[t], t, p, end) for (t, p), (_, end) in ranges.items()}
    for msg in kafka.read_ranges(config, ranges, timeout_s=timeout_s,
                                 what="reading consumed capture records"):
        per[(str(msg.topic()), int(msg.partition() or 0))].add(
            int(msg.offset() or 0), _decode(msg.value()), outputs)
    rows = [per[tp].row() for tp in sorted(per)]
    totals = {c: sum(r[c] for r in rows) for c in ("records", *CLASSES)}
    by_reason: dict[str, Counter[str]] = {c: Counter() for c in BY_REASON}
    for row in rows:
        for cls, reasons in row["by_reason"].items():
            by_reason[cls].update(reasons)
    return {"group": group, "partitions": rows, "totals": totals,
            "by_reason": {c: dict(sorted(r.items())) for c, r in by_reason.items()},
            "unaccounted": totals["unaccounted"],
            "refused_state_records": outputs.refused_state}
