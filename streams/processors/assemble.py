"""Assemble stage: each thread generation's canonical token history, from interleaved records.

State is kept in one mapping under keys from :mod:`streams.processors.common`:

* ``h|<iid>``: the thread generation's *header* (a few KB, written with every batch of
  the generation's records): status, identity, the highest offset applied per capture
  topic (the redelivery watermark), received turn indices, token ranges, generated
  ranges, observed ordinals, last ordinal per sequence, the end marker, tags and the
  thread start time;
* the header's ``turn_values`` (``{turn index: turn}``): each TranscriptTurn's tokens,
  segments and lineage, held in the header (written anyway) rather than under keys of
  their own: a turn key cost a changelog record when it was written and a tombstone
  when it was dropped, a third of the table's changelog, and a standby replica applies
  every one of them through faust's per-message path. It holds
  :data:`HELD_TOKENS_MAX` tokens at most (with the runs below); once the generation's
  content is dropped (:func:`drop_content`) its values become None;
* ``t|<iid>|<turn>``: a turn the header does not hold (past the budget, or in a
  generation an older worker began, whose header has no ``turn_values``);
* ``o|<iid>|<ordinal>``: one decoded token's captured routes, packed;
* ``o|<iid>|r<first>``: a chunk's run of consecutive tokens' routes, packed, stored as
  one value (:func:`apply_run`; the header's ``runs`` lists them as ``[first, count]``).
  A generation that keeps no route payloads (below) holds its runs, a few hundred bytes
  each without them, in the header's ``run_values`` (``{first: run}``) instead, for the
  reason turns are held there and within the same budget.

A route's payload (expert ids and weights) is stored only when the header's
``routes_kept`` says so: the capture stage sets it from the split's runtime draw
(:func:`streams.processors.split.may_hold_out_runtime`), since only ``runtime_holdout``
windows carry captured routes. Otherwise a route keeps its token id, turn and stages
(what completion, route consistency and the summary read) and empty ids and weights.

A generation is *complete* once its end marker arrived, its turns cover
``0..end-turn`` and its token ranges cover ``[0, end)`` contiguously, and (with
``require_routes``) every generated token has its observation. After
``idle_timeout_ms`` without records a contiguous generation completes with what it
has, and one with a gap is refused (``incomplete_thread``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.common import (
    Ranges,
    header_key,
    iter_ranges,
    obs_key,
    ranges_add,
    ranges_contains,
    ranges_count,
    ranges_covers,
    ranges_minus,
    ranges_overlap,
    run_key,
    turn_key,
)
from hebrus_flywheel.streams.processors.dedup import DedupConfig, content_digest, signature
from hebrus_flywheel.streams.processors.thread_routes import ThreadRoutes
from hebrus_flywheel.streams.processors.validate import PackedRoutes, Rejection, reject

TURN_VALUES = "turn_values"
"""The header field holding the generation's turns (absent in generations begun before it)."""
RUN_VALUES = "run_values"
"""The header field holding the runs of a generation that keeps no route payloads (absent
in the others, and in generations begun before it)."""
HELD_TOKENS_MAX = 4096
"""Most tokens (turn and run tokens together) a header holds. The header is rewritten with
every batch of its generation's records, so what it holds is written again each time: a
long generation's further turns and runs go under keys of their own (written once), and
a header stays within tens of KB whatever the length of its thread."""


@dataclass(frozen=True, kw_only=True)
class AssembleConfig:
    """When a thread generation counts as complete.

    Fields:
        idle_timeout_ms: processing-time milliseconds without a record after which an
            open generation is completed (or refused if it has gaps).
        require_routes: wait (up to the idle timeout) for an observation of every
            generated token before completing on the end marker.
        max_remembered_failures: refused offsets remembered per generation so a
            redelivered record gets its original verdict again.
        finished_ttl_ms: processing-time milliseconds a finished generation's header
            (emitted, dropped or quarantined; its content is gone already) is kept after
            its last record, so a redelivered record is recognised; then it is deleted
            (a changelog tombstone). A record of that generation redelivered later than
            this is assembled again (its windows repeat byte-identically, or it is
            quarantined as incomplete).
        counter_ttl_ms: processing-time milliseconds a producer's counter state (per
            producer, topic and partition) is kept after its last record; a producer
            silent for longer starts afresh (its next counter is not compared).
        expiry_bucket_ms: width of the time buckets expiry is scheduled in
            (:mod:`streams.processors.expiry`); state expires up to one bucket late.
    """

    idle_timeout_ms: int = 300_000
    require_routes: bool = True
    max_remembered_failures: int = 64
    finished_ttl_ms: int = 3_600_000
    counter_ttl_ms: int = 86_400_000
    expiry_bucket_ms: int = 1_000

    def __post_init__(self) -> None:
        for name in ("idle_timeout_ms", "max_remembered_failures", "finished_ttl_ms",
                     "counter_ttl_ms", "expiry_bucket_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"AssembleConfig.{name} must be a positive integer, got {value!r}"
                )


def new_header(record: Mapping[str, Any], partition: int, *,
               routes_kept: bool = True) -> dict[str, Any]:
    return {
        "owner": record["owner"],
        "thread": record["thread"],
        "generation": record["generation"],
        "identity_id": record["identity_id"],
        "partition": partition,
        "status": "open",
        "wm": {},
        "failed": [],
        "turns": [],
        "tokens": [],
        "gen": [],
        "obs": [],
        "seq": {},
        "close": None,
        "end": None,
        "start_ms": None,
        "tags": [],
        "tool_turns": 0,
        "tool_call_segments": 0,
        "last_ms": 0,
        "outbox": [],
        "routes_kept": routes_kept,
        TURN_VALUES: {},
        **({} if routes_kept else {RUN_VALUES: {}}),
    }


def redelivered_verdict(
    header: Mapping[str, Any], kind: str, offset: int
) -> tuple[bool, Rejection | None]:
    """``(redelivered, original verdict)``: a record at or below the generation's watermark
    for its topic was handled before; its Rejection is remembered, None means applied."""
    if offset > header["wm"].get(kind, -1):
        return False, None
    for f_kind, f_offset, reason, detail in header["failed"]:
        if f_kind == kind and f_offset == offset:
            return True, Rejection(reason, detail)
    return True, None


def mark_handled(
    header: dict[str, Any],
    kind: str,
    offset: int,
    verdict: Rejection | None,
    config: AssembleConfig,
) -> None:
    header["wm"] = {**header["wm"], kind: max(offset, header["wm"].get(kind, -1))}
    if verdict is not None:
        entry = [kind, offset, verdict.reason, verdict.detail]
        header["failed"] = [*header["failed"], entry][-config.max_remembered_failures :]


def _check_common(header: Mapping[str, Any], record: Mapping[str, Any]) -> Rejection | None:
    if record["identity_id"] != header["identity_id"]:
        return reject(
            "identity_mismatch",
            f"record identity {record['identity_id']} differs from identity "
            f"{header['identity_id']} of its thread generation; a generation has one runtime "
            "identity",
        )
    if header["status"] != "open":
        return reject(
            "thread_closed",
            f"thread generation already {header['status']}; records after completion are refused",
        )
    return None


def apply_turn(
    store: MutableMapping[str, Any], header: dict[str, Any], iid: str, record: Mapping[str, Any]
) -> Rejection | None:
    """Check a TranscriptTurn against its generation's history and store it."""
    problem = _check_common(header, record) or _check_turn_position(header, record)
    if problem is not None:
        return problem
    index, offset, n = record["turn_index"], record["token_offset"], len(record["token_ids"])
    segments = [(s["kind"], s["start"], s["end"], s["generated"]) for s in record["segments"]]
    turn = {
        "turn_index": index,
        "role": record["role"],
        "token_offset": offset,
        "token_ids": list(record["token_ids"]),
        "segments": segments,
        "sequence_id": record["sequence_id"],
        "sampling_mode": record["sampling"]["mode"],
    }
    if _holds(header, TURN_VALUES, n):  # a copy: the read header shares it with the store
        header[TURN_VALUES] = {**header[TURN_VALUES], index: turn}
    else:
        store[turn_key(iid, index)] = turn
    header["turns"] = ranges_add(header["turns"], index, index + 1)
    header["tokens"] = ranges_add(header["tokens"], offset, offset + n)
    for kind, start, end, generated in segments:
        if generated:
            header["gen"] = ranges_add(header["gen"], offset + start, offset + end)
        header["tool_call_segments"] += kind == "tool_call"
    header["tool_turns"] += record["role"] == "tool"
    if record["closes_thread"]:
        header["close"], header["end"] = index, offset + n
    start_ms = record["wall_time_ms"]
    header["start_ms"] = (
        start_ms if header["start_ms"] is None else min(header["start_ms"], start_ms)
    )
    header["tags"] = sorted(set(header["tags"]) | set(record["domain_tags"]))
    return None


def _check_turn_position(header: Mapping[str, Any], record: Mapping[str, Any]) -> Rejection | None:
    index, offset, n = record["turn_index"], record["token_offset"], len(record["token_ids"])
    if ranges_contains(header["turns"], index):
        return reject("duplicate_ordinal", f"turn {index} was already recorded for this generation")
    if header["close"] is not None and index > header["close"]:
        return reject(
            "thread_closed",
            f"turn {index} comes after the end marker at turn {header['close']}; a thread "
            "continues in a new generation or a new thread",
        )
    last_turn = header["turns"][-1][1] - 1 if header["turns"] else -1
    if record["closes_thread"] and last_turn > index:
        return reject("thread_closed", f"end marker at turn {index} but turn {last_turn} exists")
    if n and ranges_overlap(header["tokens"], offset, offset + n):
        return reject(
            "duplicate_ordinal",
            f"turn {index} covers ordinals [{offset},{offset + n}) that another turn already "
            "covers",
        )
    return None


def apply_observation(
    store: MutableMapping[str, Any],
    header: dict[str, Any],
    iid: str,
    record: Mapping[str, Any],
    routes: PackedRoutes,
) -> Rejection | None:
    """Check a RouteObservation's ordinal against its sequence and store its routes."""
    problem = _check_common(header, record)
    if problem is not None:
        return problem
    ordinal, seq = record["token_ordinal"], record["sequence_id"]
    last = header["seq"].get(seq)
    if ranges_contains(header["obs"], ordinal):
        return reject("duplicate_ordinal", f"token ordinal {ordinal} already has a route")
    if last is not None and ordinal < last:
        return reject(
            "ordinal_not_increasing",
            f"token ordinal {ordinal} follows {last} in sequence {seq}; decode ordinals only grow",
        )
    if ranges_contains(header["tokens"], ordinal) and not ranges_contains(header["gen"], ordinal):
        return reject("token_mismatch", f"ordinal {ordinal} is not an assistant-generated token")
    ids, weights = _payload(header, lambda: (routes.expert_ids, routes.weights))
    store[obs_key(iid, ordinal)] = {
        "token_id": record["token_id"],
        "turn_index": record["turn_index"],
        "ids": ids,
        "weights": weights,
        "stages": routes.stages,
    }
    header["obs"] = ranges_add(header["obs"], ordinal, ordinal + 1)
    header["seq"] = {**header["seq"], seq: ordinal}
    return None


def apply_run(
    store: MutableMapping[str, Any],
    header: dict[str, Any],
    iid: str,
    chunk: Mapping[str, Any],
    opened: Any,
) -> bool:
    """A chunk's tokens (its header fields and :class:`streams.chunks.ChunkTokens`) applied
    at once, as one stored value: True when :func:`apply_observation` would accept every
    token in order. False changes nothing: then apply them token by token for the verdict.
    """
    first, n = int(chunk["first_ordinal"]), int(chunk["token_count"])
    end, seq = first + n, chunk["sequence_id"]
    last = header["seq"].get(seq)
    if (_check_common(header, chunk) is not None or ranges_overlap(header["obs"], first, end)
            or (last is not None and first < last) or _ungenerated(header, first, end)):
        return False
    ids, weights = _payload(header, lambda: (opened.ids.tobytes(), opened.weights.tobytes()))
    run = {
        "token_ids": opened.tokens.tolist(),
        "turn_index": chunk["turn_index"],
        "ids": ids,
        "weights": weights,
        "stages": tuple(chunk["stages"]),
    }
    if _holds(header, RUN_VALUES, n):  # a copy: the read header shares it with the store
        header[RUN_VALUES] = {**header[RUN_VALUES], first: run}
    else:
        store[run_key(iid, first)] = run
    header["runs"] = [*header.get("runs", []), [first, n]]
    header["obs"] = ranges_add(header["obs"], first, end)
    header["seq"] = {**header["seq"], seq: end - 1}
    return True


def _payload(header: Mapping[str, Any], packed: Callable[[], tuple[bytes, bytes]]
             ) -> tuple[bytes, bytes]:
    """A route's stored expert ids and weights: ``packed()`` where the generation keeps
    route payloads (its ``routes_kept``), empty otherwise (never packed then)."""
    return packed() if header.get("routes_kept", True) else (b"", b"")


def _ungenerated(header: Mapping[str, Any], start: int, end: int) -> bool:
    """Whether an ordinal of ``[start, end)`` is a transcript token not generated."""
    for lo, hi in header["tokens"]:
        a, b = max(lo, start), min(hi, end)
        if a < b and not ranges_covers(header["gen"], [[a, b]]):
            return True
    return False


def _single_ordinals(header: Mapping[str, Any]) -> list[int]:
    """Observed ordinals stored one per key (not in a run)."""
    runs = header.get("runs", [])
    if not runs:
        return list(iter_ranges(header["obs"]))
    in_runs: Ranges = []
    for first, n in runs:
        in_runs = ranges_add(in_runs, first, first + n)
    return list(iter_ranges(ranges_minus(header["obs"], in_runs)))


def completion(header: Mapping[str, Any], config: AssembleConfig, *, idle: bool) -> str:
    """``wait``, ``complete`` or ``incomplete`` (a gap that will not be filled)."""
    turns, tokens = header["turns"], header["tokens"]
    contiguous = len(turns) == 1 and turns[0][0] == 0 and len(tokens) == 1 and tokens[0][0] == 0
    if header["close"] is not None and contiguous:
        closed = turns[0][1] == header["close"] + 1 and tokens[0][1] == header["end"]
        routed = not config.require_routes or ranges_covers(header["obs"], header["gen"])
        if closed and (routed or idle):
            return "complete"
    if not idle:
        return "wait"
    return "complete" if contiguous else "incomplete"


@dataclass(frozen=True, kw_only=True)
class AssembledThread:
    """A completed generation, read back from the store for windowing."""

    owner: str
    thread: str
    generation: int
    identity_id: str
    tokens: np.ndarray
    turns: tuple[dict[str, Any], ...]
    generated: np.ndarray
    routes: ThreadRoutes
    tags: tuple[str, ...]


def load_thread(store: Mapping[str, Any], iid: str, header: Mapping[str, Any]) -> AssembledThread:
    held = header.get(TURN_VALUES) or {}
    turns = tuple(held[i] if i in held else store[turn_key(iid, i)]
                  for i in iter_ranges(header["turns"]))
    tokens = np.fromiter(
        (t for turn in turns for t in turn["token_ids"]),
        dtype=np.int64,
        count=sum(len(turn["token_ids"]) for turn in turns),
    )
    generated = np.fromiter(
        iter_ranges(header["gen"]), dtype=np.int64, count=ranges_count(header["gen"])
    )
    parts = [(o, store[obs_key(iid, o)]) for o in _single_ordinals(header)]
    held_runs = header.get(RUN_VALUES) or {}
    for first, _ in header.get("runs", []):
        parts.append((first, held_runs[first] if first in held_runs
                      else store[run_key(iid, first)]))
    routes = ThreadRoutes(parts)
    return AssembledThread(
        owner=header["owner"],
        thread=header["thread"],
        generation=header["generation"],
        identity_id=header["identity_id"],
        tokens=tokens,
        turns=turns,
        generated=generated,
        routes=routes,
        tags=tuple(header["tags"]),
    )


def route_consistency(thread: AssembledThread, gen: Ranges) -> Rejection | None:
    """Every captured route must belong to a generated token and name the same token id."""
    n = len(thread.tokens)
    ordinals, token_ids = thread.routes.ordinals, thread.routes.token_ids()
    generated = (ordinals < n) & np.isin(ordinals, thread.generated)
    ok = generated & (thread.tokens[np.where(generated, ordinals, 0)] == token_ids)
    if ok.all():
        return None
    first = int(np.flatnonzero(~ok)[0])
    ordinal = int(ordinals[first])
    if not generated[first] or not ranges_contains(gen, ordinal):
        return reject(
            "token_mismatch", f"a route exists for ordinal {ordinal}, which was not generated"
        )
    return reject(
        "token_mismatch",
        # no token ids in the detail: it goes to the quarantine topic in the clear
        f"the route at ordinal {ordinal} is for another token than the transcript has there; "
        "capture and transcript disagree",
    )


def latest_wall_ms(end_ms: int | None, records: Iterable[Mapping[str, Any]]) -> int | None:
    """A generation's event-time end after applying ``records``: the latest wall time of
    any record applied to it (a chunk's ends ``span_ms`` after its first token)."""
    for record in records:
        wall = record.get("wall_time_ms")
        if isinstance(wall, int) and not isinstance(wall, bool):
            wall += int(record.get("span_ms") or 0)
            end_ms = wall if end_ms is None else max(end_ms, wall)
    return end_ms


def summarize(
    iid: str, header: Mapping[str, Any], thread: AssembledThread, dedup: DedupConfig
) -> dict[str, Any]:
    """What the split and dedup stage needs to know about a completed generation."""
    return {
        "iid": iid,
        "owner": header["owner"],
        "thread": header["thread"],
        "generation": header["generation"],
        "identity_id": header["identity_id"],
        "partition": header["partition"],
        "start_ms": header["start_ms"],
        "end_ms": header.get("end_ms"),
        "tags": list(header["tags"]),
        "tool_turns": header["tool_turns"],
        "tool_call_segments": header["tool_call_segments"],
        "token_count": len(thread.tokens),
        "turn_count": len(thread.turns),
        "generated_count": ranges_count(header["gen"]),
        "routes_complete": ranges_covers(header["obs"], header["gen"]),
        "routes_kept": header.get("routes_kept", True),
        "closed": header["close"] is not None,
        "digest": content_digest(thread.tokens),
        "minhash": signature(thread.tokens, dedup),
    }


def content_keys(iid: str, header: Mapping[str, Any]) -> list[str]:
    """Every turn and observation key a generation holds (deleted once it is done): those
    of its turns and runs that the header does not hold."""
    turns, runs = header.get(TURN_VALUES) or {}, header.get(RUN_VALUES) or {}
    keys = [turn_key(iid, i) for i in iter_ranges(header["turns"]) if i not in turns]
    keys.extend(run_key(iid, first) for first, _ in header.get("runs", []) if first not in runs)
    keys.extend(obs_key(iid, o) for o in _single_ordinals(header))
    return keys


def drop_content(store: MutableMapping[str, Any], iid: str, header: dict[str, Any]) -> None:
    """Delete the generation's content keys and drop what ``header`` holds, keeping which
    turns and runs it held (as None: no key to delete for them later). The caller writes
    ``header`` back, or deletes it."""
    for key in content_keys(iid, header):
        if key in store:
            del store[key]
    for held in (TURN_VALUES, RUN_VALUES):
        if header.get(held):
            header[held] = dict.fromkeys(header[held])


def _holds(header: Mapping[str, Any], field: str, tokens: int) -> bool:
    """Whether ``header`` holds a turn or run of ``tokens`` more tokens in ``field`` (not in
    generations begun before it, nor past :data:`HELD_TOKENS_MAX`)."""
    if field not in header:
        return False
    held = sum(len(v["token_ids"]) for f in (TURN_VALUES, RUN_VALUES)
               for v in (header.get(f) or {}).values() if v is not None)
    return held + tokens <= HELD_TOKENS_MAX


def read_header(store: Mapping[str, Any], iid: str) -> dict[str, Any] | None:
    value = store.get(header_key(iid))
    return None if value is None else dict(value)
