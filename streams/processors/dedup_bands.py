"""Dedup spread over partitions: LSH band partitions find pairs, thread homes decide.

The one-partition stage (:mod:`streams.processors.dedup`) holds every kept thread in one
index and decides in event-time order (:mod:`streams.processors.decision_order`), so its
work does not spread over workers. Its decisions form a chain: whether a generation is
dropped depends on whether the earlier ones it matches were *kept*. Here the same
decisions come from two kinds of partitions, each working from its own inputs only:

* A **band partition** holds the *probes* routed to it. A generation's probe carries its
  bucket keys: one per LSH band (the band's rows of its MinHash signature, as
  ``MinHashLSH`` bands them) and one for its content digest, each scoped to its teacher
  identity; each key goes to the band partition its hash picks. A band partition pairs a
  probe with every probe already in one of its buckets and verifies the pair (*exact*:
  the same digest; *near*: another owner/thread and an estimated Jaccard similarity at or
  above the threshold), oriented by decision order. Pairs are found whichever member
  arrives first, so probes need no order. Every capture partition sends its marks to
  every band partition after the probes they cover; a band partition's *watermark* is
  its lowest mark, and it sends that to the homes after the pairs it found.
* A **home partition**, keyed by owner/thread, holds the summaries of its threads. It
  learns, for each generation, its *candidates* (the earlier members of its pairs) and
  its *subscribers* (the later members, on their homes). It assigns splits in decision
  order once the watermark (every capture partition's mark at the home, and every band
  partition's watermark) is past a generation's end, and decides the generation once the
  decision of each of its candidates is known. Each decision goes to the homes of the
  generation's subscribers.

Why the decisions are the one-partition stage's: a generation is decided against the
kept threads it matches, and those are exactly its kept candidates: a band partition's
watermark passes a generation's end only after it has read the probes of every
generation that ends no later (each capture partition's probes precede its mark), so
every pair with an earlier generation reached the home before the watermark did. The
rules themselves are :func:`streams.processors.dedup.verdict_of`, shared by both.

Why nothing waits forever: a generation waits only for candidates earlier in decision
order, and the earliest undecided generation past the watermark has every candidate
decided.

A worker sends probes batched (one record per band partition and batch); the cost per
generation is one probe per band partition its keys reach (at most ``bands + 1``).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors import expiry
from hebrus_flywheel.streams.processors.common import SEP, thread_key
from hebrus_flywheel.streams.processors.decision_order import OrderKey, order_key, watermark_of
from hebrus_flywheel.streams.processors.dedup import (
    SPLIT_PREFIX,
    DedupConfig,
    DedupStage,
    decision_record,
    lsh_params,
    start_ms,
    verdict_of,
)
from hebrus_flywheel.streams.processors.split import SplitConfig

Mark = int | None
"""A capture partition's mark: no generation of it still to come ends below this
(``None``: none at all)."""


def stable_partition(key: bytes, partitions: int) -> int:
    """The partition a key goes to (the same in every process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % partitions


def home_of(summary: Mapping[str, Any], partitions: int) -> int:
    """The home partition of a generation: its owner/thread's."""
    return stable_partition(thread_key(summary["owner"], summary["thread"]).encode(), partitions)


@dataclass(frozen=True, slots=True, eq=False)
class Probe:
    """What a band partition knows of one generation."""

    iid: str
    thread: str
    home: int
    order: OrderKey
    start: int  # start_ms: its place in the horizon
    digest: str
    hashvalues: np.ndarray  # (num_perm,) uint32
    keys: tuple[bytes, ...]  # the bucket keys routed to this band partition


@dataclass(frozen=True, slots=True)
class Pair:
    """Two generations that match; ``earlier`` comes first in decision order."""

    earlier: str
    earlier_home: int
    earlier_order: OrderKey
    earlier_start: int
    later: str
    later_home: int
    exact: bool
    near: bool


@dataclass(frozen=True, slots=True)
class Notice:
    """A decision sent to the home of a later generation that matches it."""

    home: int
    iid: str
    start: int
    keep: bool
    split: str  # "" with keep False: forgotten (past the horizon where it was decided)


class BandRouter:
    """Probes of a summary, by band partition (the capture stage's side)."""

    def __init__(self, config: DedupConfig, *, band_partitions: int,
                 home_partitions: int) -> None:
        for name, value in (("band_partitions", band_partitions),
                            ("home_partitions", home_partitions)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"BandRouter {name} must be a positive integer, got {value!r}")
        self.config = config
        self.band_partitions, self.home_partitions = band_partitions, home_partitions
        bands, rows = lsh_params(config.threshold, config.num_perm)
        self._ranges = [(i * rows, (i + 1) * rows) for i in range(bands)]

    def keys(self, summary: Mapping[str, Any], hashvalues: np.ndarray) -> list[bytes]:
        """Bucket keys: one per band, one for the digest, scoped to the teacher identity."""
        scope = (summary.get("identity_id") or "").encode() + b"\x1f"
        keys = [scope + b"b%d\x1f" % i + hashvalues[lo:hi].tobytes()
                for i, (lo, hi) in enumerate(self._ranges)]
        keys.append(scope + b"d\x1f" + str(summary["digest"]).encode())
        return keys

    def keys_by_partition(self, summary: Mapping[str, Any],
                          hashvalues: np.ndarray) -> dict[int, list[bytes]]:
        """The bucket keys of a summary, by the band partition each goes to."""
        by_partition: dict[int, list[bytes]] = {}
        for key in self.keys(summary, hashvalues):
            by_partition.setdefault(stable_partition(key, self.band_partitions), []).append(key)
        return by_partition

    def probes(self, summary: Mapping[str, Any]) -> dict[int, Probe]:
        hashvalues = np.asarray(summary["minhash"], dtype=np.uint32)
        by_partition = self.keys_by_partition(summary, hashvalues)
        iid, home = str(summary["iid"]), home_of(summary, self.home_partitions)
        thread = thread_key(summary["owner"], summary["thread"])
        order, digest = order_key(summary), str(summary["digest"])
        start = start_ms(summary)
        return {p: Probe(iid=iid, thread=thread, home=home, order=order, start=start, digest=digest,
                         hashvalues=hashvalues, keys=tuple(keys))
                for p, keys in sorted(by_partition.items())}


def _marks(store: Mapping[str, Any], prefix: str) -> dict[int, Any]:
    # keys first: a faust table iterates every partition a worker holds but reads from
    # the current event's partition only
    return {int(k[len(prefix):]): store[k]["at"] for k in list(store) if k.startswith(prefix)}


class BandPartition:
    """One band partition: buckets of probes, verified pairs, a watermark.

    State in ``store`` (a table shared by every band partition a worker holds, so every
    key names its partition): each probe under ``q<SEP><iid><SEP><band>`` (an owner's
    data: sealed in the changelog), each capture partition's mark, and the expiry buckets
    of the probes. The buckets themselves are an in-memory index rebuilt from the probes
    (their keys are signature bands: never written in the clear). A probe is forgotten
    once the newest start this partition has seen is ``horizon_ms`` (and up to one bucket)
    past its own start."""

    def __init__(self, config: DedupConfig, *, band: int, capture_partitions: int,
                 store: MutableMapping[str, Any] | None = None) -> None:
        self.config, self.band, self.capture_partitions = config, band, capture_partitions
        self.store: MutableMapping[str, Any] = {} if store is None else store
        self._suffix = f"{SEP}{band}"
        self._mark_prefix = f"m{SEP}b{band}c"
        self._clock_key = f"n{SEP}b{band}{SEP}clock"
        self._buckets: dict[bytes, list[str]] | None = None
        self._probes: dict[str, Probe] = {}
        self._marks: dict[int, Mark] | None = None

    def __len__(self) -> int:
        return len(self._index()[1])

    def reset(self) -> None:
        """Forget the in-memory index and marks (after a rebalance): read from the store."""
        self._buckets, self._marks = None, None

    def _index(self) -> tuple[dict[bytes, list[str]], dict[str, Probe]]:
        if self._buckets is None:
            self._buckets, self._probes = {}, {}
            for key in list(self.store):
                if key.startswith(PROBE_PREFIX) and key.endswith(self._suffix):
                    self._insert(_probe_of(self.store[key]))
        return self._buckets, self._probes

    def _insert(self, probe: Probe) -> None:
        assert self._buckets is not None
        self._probes[probe.iid] = probe
        for key in probe.keys:
            self._buckets.setdefault(key, []).append(probe.iid)

    def probe(self, probe: Probe) -> list[Pair]:
        """The pairs of a probe with those already here (a repeated probe finds them
        again: homes take a pair twice as once)."""
        buckets, probes = self._index()
        others: set[str] = set()
        for key in probe.keys:
            others.update(buckets.get(key, ()))
        others.discard(probe.iid)
        pairs = [p for o in sorted(others) if (p := self._pair(probe, probes[o]))]
        if probe.iid not in probes:
            skey = PROBE_PREFIX + probe.iid + self._suffix
            self.store[skey] = _probe_value(probe)
            self._insert(probe)
            expiry.schedule(self.store, skey, partition=self.band, due_ms=probe.start,
                            bucket_ms=self.config.bucket_ms)
            self._advance(probe.start)
        return pairs

    def _pair(self, a: Probe, b: Probe) -> Pair | None:
        exact = a.digest == b.digest
        near = a.thread != b.thread and float(np.count_nonzero(
            a.hashvalues == b.hashvalues)) / a.hashvalues.size >= self.config.threshold
        if not (exact or near):
            return None
        first, second = (a, b) if a.order < b.order else (b, a)
        return Pair(earlier=first.iid, earlier_home=first.home, earlier_order=first.order,
                    earlier_start=first.start, later=second.iid, later_home=second.home,
                    exact=exact, near=near)

    def _advance(self, start_ms: int) -> None:
        clock = max(int(self.store.get(self._clock_key, 0)), start_ms)
        if clock != self.store.get(self._clock_key):
            self.store[self._clock_key] = clock
        expiry.sweep(self.store, partition=self.band, now_ms=clock - self.config.horizon_ms,
                     bucket_ms=self.config.bucket_ms, decide=self._expire)

    def _expire(self, key: str, horizon_ms: int) -> int | None:
        value = self.store.get(key)
        if value is None:
            return None
        del self.store[key]
        if self._buckets is not None:
            probe = self._probes.pop(_probe_of(value).iid)
            for bucket in probe.keys:
                self._buckets[bucket].remove(probe.iid)
                if not self._buckets[bucket]:
                    del self._buckets[bucket]
        return None

    def mark(self, capture_partition: int, at: Mark) -> None:
        marks = self._all_marks()
        if capture_partition not in marks or marks[capture_partition] != at:
            marks[capture_partition] = at
            self.store[f"{self._mark_prefix}{capture_partition}"] = {"at": at}

    def _all_marks(self) -> dict[int, Mark]:
        if self._marks is None:
            self._marks = _marks(self.store, self._mark_prefix)
        return self._marks

    def watermark(self) -> float:
        return watermark_of(self._all_marks(), self.capture_partitions)


PROBE_PREFIX = f"q{SEP}"
"""A band partition's probes (an owner's data: sealed in the changelog)."""
PENDING_PREFIX = f"p{SEP}"
"""A home's generations not decided yet (``p<SEP><iid><SEP>@<home>``: ``{"summary",
"split"}``; sealed)."""
DECIDED_PREFIX = f"d{SEP}"
"""A home's decisions (sealed; a repeated summary gets its decision again)."""
CANDIDATES_PREFIX = f"g{SEP}"
"""A generation's candidates: ``{earlier iid: [exact, near, order, start, home]}``
(sealed)."""
SUBSCRIBERS_PREFIX = f"u{SEP}"
"""A generation's subscribers on other homes: ``{"order", "start", "home", "subs":
[[later iid, home], ...]}`` (sealed)."""
KNOWN_PREFIX = f"k{SEP}"
"""``[keep, split, start]`` of a generation decided here or told by its home (sealed)."""


def _probe_value(probe: Probe) -> dict[str, Any]:
    return {"iid": probe.iid, "thread": probe.thread, "home": probe.home,
            "order": list(probe.order), "digest": probe.digest, "start": probe.start,
            "hv": probe.hashvalues.tobytes(), "keys": list(probe.keys)}


def _probe_of(value: Mapping[str, Any]) -> Probe:
    end, iid = value["order"]
    return Probe(iid=value["iid"], thread=value["thread"], home=value["home"],
                 order=(int(end), str(iid)), digest=value["digest"], start=value["start"],
                 hashvalues=np.frombuffer(value["hv"], dtype=np.uint32),
                 keys=tuple(value["keys"]))


class HomePartition:
    """One home partition: its threads' splits and decisions, in decision order.

    State in ``store`` (shared by the home partitions a worker holds; every key names
    its generation or its partition): generations waiting (``p``), decisions (``d``),
    candidates (``g``), subscribers (``u``), decisions known here (``k``, each home its
    own), the sticky splits of :class:`~streams.processors.dedup.DedupStage`, marks and
    expiry buckets. What is kept of a generation goes ``horizon_ms`` after its start."""

    def __init__(self, *, home: int, split_config: SplitConfig, dedup_config: DedupConfig,
                 capture_partitions: int, band_partitions: int,
                 store: MutableMapping[str, Any] | None = None,
                 counters: Counters | None = None) -> None:
        self.home, self.config = home, dedup_config
        self.capture_partitions, self.band_partitions = capture_partitions, band_partitions
        self.store: MutableMapping[str, Any] = {} if store is None else store
        self.counters = counters or Counters()
        # the split rules and their sticky per-thread state are the one-partition stage's
        self._splitter = DedupStage(split_config=split_config, dedup_config=dedup_config,
                                    store=self.store, counters=self.counters, partition=home)
        self._capture_prefix, self._band_prefix = f"m{SEP}h{home}c", f"m{SEP}h{home}b"
        self._clock_key = f"n{SEP}h{home}{SEP}clock"
        self._known_suffix = f"{SEP}{home}"
        self._pending_suffix = f"{SEP}@{home}"
        self._loaded = False
        self._unsplit: list[tuple[OrderKey, str]] = []  # heap
        self._undecided: list[tuple[OrderKey, str]] = []  # split, in order
        self._capture_marks: dict[int, Mark] = {}
        self._band_marks: dict[int, float] = {}
        self._out: list[dict[str, Any]] = []  # decisions made again (repeated summaries)
        self._changed = False  # since the last step: what waits may be decidable now
        # earlier generations homed here that a pair named, not known yet: each becomes
        # known when decided, or absent once the watermark passes it without its summary
        # (its owner erased before it was read here): then nothing waits for it forever
        self._awaited: dict[str, tuple[OrderKey, int]] = {}
        self._notices: list[Notice] = []

    def reset(self) -> None:
        """Forget what is in memory (after a rebalance): read from the store."""
        self._loaded = False

    def _await(self, iid: str, order: OrderKey, start: int) -> None:
        if KNOWN_PREFIX + iid + self._known_suffix not in self.store:
            self._awaited[iid] = (order, start)

    def _pkey(self, iid: str) -> str:
        return PENDING_PREFIX + iid + self._pending_suffix

    def _load(self) -> None:
        if self._loaded:
            return
        self._unsplit, self._undecided, self._awaited = [], [], {}
        for key in list(self.store):
            if key.startswith(SUBSCRIBERS_PREFIX):
                value = self.store.get(key)  # None: another partition's key
                if value is not None and value["home"] == self.home:
                    end, first = value["order"]
                    self._await(key[len(SUBSCRIBERS_PREFIX):], (int(end), str(first)),
                                int(value["start"]))
            elif key.startswith(CANDIDATES_PREFIX):
                for earlier, (_, _, (end, first), start, home) in (
                        self.store.get(key) or {}).items():
                    if home == self.home:
                        self._await(earlier, (int(end), str(first)), int(start))
            if key.startswith(PENDING_PREFIX) and key.endswith(self._pending_suffix):
                value = self.store[key]
                entry = (order_key(value["summary"]), str(value["summary"]["iid"]))
                (self._undecided if value["split"] else self._unsplit).append(entry)
        heapq.heapify(self._unsplit)
        self._undecided.sort()
        self._capture_marks = _marks(self.store, self._capture_prefix)
        self._band_marks = {b: float(at) for b, at in _marks(self.store, self._band_prefix).items()}
        self._loaded = self._changed = True

    # -- inputs -------------------------------------------------------------------

    def summary(self, summary: Mapping[str, Any]) -> None:
        """A completed generation of a thread homed here (a repeat changes nothing; one
        already decided gets its decision again from the next :meth:`step`)."""
        self._load()
        iid = str(summary["iid"])
        decided = self.store.get(DECIDED_PREFIX + iid)
        if decided is not None:
            self.counters.inc("dedup", "repeated_summaries")
            self._out.append(dict(decided))
            self._notify_subscribers(iid)
            return
        if self._pkey(iid) in self.store:
            return
        key = order_key(summary)
        if key[0] < self.watermark():
            self.counters.inc("dedup", "late_summaries")  # its pairs may come after it
        self.counters.inc("dedup", "summaries_waited")
        self._changed = True
        self.store[self._pkey(iid)] = {"summary": dict(summary), "split": None}
        heapq.heappush(self._unsplit, (key, iid))
        if (start := start_ms(summary)) > self._clock():
            self.store[self._clock_key] = start

    def pair(self, pair: Pair) -> None:
        self._load()
        self._changed = True
        if pair.later_home == self.home and DECIDED_PREFIX + pair.later not in self.store:
            key = CANDIDATES_PREFIX + pair.later
            candidates = self.store.get(key) or {}
            if pair.earlier not in candidates:
                self.store[key] = {**candidates, pair.earlier: [
                    pair.exact, pair.near, list(pair.earlier_order), pair.earlier_start,
                    pair.earlier_home]}
        if pair.earlier_home != self.home:
            return
        known = self._known(pair.earlier, pair.earlier_start)
        if known is None:
            self._awaited[pair.earlier] = (pair.earlier_order, pair.earlier_start)
        if pair.later_home != self.home:
            key = SUBSCRIBERS_PREFIX + pair.earlier
            value = self.store.get(key) or {"order": list(pair.earlier_order), "home": self.home,
                                            "start": pair.earlier_start, "subs": []}
            if [pair.later, pair.later_home] not in value["subs"]:
                self.store[key] = {**value, "subs": [*value["subs"],
                                                     [pair.later, pair.later_home]]}
                self._schedule(key, pair.earlier_start + self.config.horizon_ms)
            if known is not None:  # decided (or forgotten) before the pair came
                self._notify(pair.earlier, pair.later_home, known)

    def notice(self, notice: Notice) -> None:
        self._load()
        self._changed = True
        key = KNOWN_PREFIX + notice.iid + self._known_suffix
        if key not in self.store:
            self.store[key] = [notice.keep, notice.split, notice.start]
            self._schedule(key, notice.start + self.config.horizon_ms)

    def capture_mark(self, capture_partition: int, at: Mark) -> None:
        self._load()
        if self._capture_marks.get(capture_partition, math.nan) != at:
            self._capture_marks[capture_partition] = at
            self.store[f"{self._capture_prefix}{capture_partition}"] = {"at": at}

    def band_mark(self, band_partition: int, watermark: float) -> None:
        self._load()
        if self._band_marks.get(band_partition) != watermark:
            self._band_marks[band_partition] = watermark
            self.store[f"{self._band_prefix}{band_partition}"] = {"at": watermark}

    # -- decisions ----------------------------------------------------------------

    def watermark(self) -> float:
        self._load()
        return min(watermark_of(self._capture_marks, self.capture_partitions),
                   watermark_of(self._band_marks, self.band_partitions))

    @property
    def held(self) -> int:
        """Generations waiting for the watermark or for a candidate's decision."""
        return len(self._unsplit) + len(self._undecided)

    def step(self) -> tuple[list[dict[str, Any]], list[Notice]]:
        """Decide what can be decided: ``(decisions, notices for other homes)``."""
        watermark = self.watermark()
        while self._unsplit and self._unsplit[0][0][0] < watermark:
            key, iid = heapq.heappop(self._unsplit)
            pending = self.store[self._pkey(iid)]
            split = list(self._splitter.split_for(pending["summary"]))
            self.store[self._pkey(iid)] = {**pending, "split": split}
            self._undecided.append((key, iid))
            self._changed = True
        self._settle_absent(watermark)
        decisions, self._out = self._out, []
        if not self._changed:  # nothing new to decide on
            notices, self._notices = self._notices, []
            return decisions, notices
        self._changed = False
        waiting = []
        for key, iid in self._undecided:
            candidates = self.store.get(CANDIDATES_PREFIX + iid) or {}
            if all(self._known(c, v[3]) is not None for c, v in candidates.items()):
                decisions.append(self._decide(iid, candidates))
            else:
                waiting.append((key, iid))
        self._undecided = waiting
        if decisions:
            expiry.sweep(self.store, partition=self.home,
                         now_ms=self._clock() - self.config.horizon_ms,
                         bucket_ms=self.config.bucket_ms, decide=self._expire)
        notices, self._notices = self._notices, []
        return decisions, notices

    def _settle_absent(self, watermark: float) -> None:
        """Generations named by pairs whose summary never came although the watermark
        passed them are known as not kept (``dedup/absent_candidates``)."""
        for iid, (order, start) in list(self._awaited.items()):
            key = KNOWN_PREFIX + iid + self._known_suffix
            if key in self.store:
                del self._awaited[iid]
            elif order[0] < watermark and self._pkey(iid) not in self.store:
                del self._awaited[iid]
                self.store[key] = [False, "", start]
                self._schedule(key, start + self.config.horizon_ms)
                self.counters.inc("dedup", "absent_candidates")
                self._notify_subscribers(iid)
                self._changed = True

    def _decide(self, iid: str, candidates: Mapping[str, list[Any]]) -> dict[str, Any]:
        pending = self.store.pop(self._pkey(iid))
        summary, (split, rule) = pending["summary"], pending["split"]
        if candidates:
            del self.store[CANDIDATES_PREFIX + iid]
        start = start_ms(summary)
        kept = {}
        for c, (_, _, _, c_start, _) in candidates.items():
            known = self._known(c, c_start)
            # a candidate that started more than the horizon before this one is forgotten
            if known is not None and known[0] and c_start >= start - self.config.horizon_ms:
                kept[c] = known[1]
        exact = [c for c in kept if candidates[c][0]]
        verdict = verdict_of(  # the first kept with its digest, as the one index keeps it
            split=split, exact=min(exact, key=lambda c: tuple(candidates[c][2])) if exact
            else None, near=sorted(c for c in kept if candidates[c][1]), splits=kept,
            drop_near_within_split=self.config.drop_near_within_split)
        decision = decision_record(summary, split, rule, verdict, self.config.threshold)
        for key, value in ((DECIDED_PREFIX + iid, decision),
                           (KNOWN_PREFIX + iid + self._known_suffix, [verdict.keep, split, start])):
            self.store[key] = value
            self._schedule(key, start + self.config.horizon_ms)
        self.counters.inc("split", split)
        self.counters.inc("dedup", verdict.reason)
        self._notify_subscribers(iid)
        return decision

    def _known(self, iid: str, start: int) -> list[Any] | None:
        """``[keep, split, start]`` of a generation; ``[False, "", start]`` once it is
        forgotten here (what is known of a generation stays until the clock is twice the
        horizon past its start; one neither known nor waiting by then never comes)."""
        known = self.store.get(KNOWN_PREFIX + iid + self._known_suffix)
        if known is None and start + 2 * self.config.horizon_ms < self._clock() \
                and self._pkey(iid) not in self.store:
            self.counters.inc("dedup", "forgotten_candidates")
            return [False, "", start]
        return known

    def _notify_subscribers(self, iid: str) -> None:
        known = self.store[KNOWN_PREFIX + iid + self._known_suffix]
        for _, home in (self.store.get(SUBSCRIBERS_PREFIX + iid) or {}).get("subs", ()):
            self._notify(iid, home, known)

    def _notify(self, iid: str, home: int, known: list[Any]) -> None:
        self._notices.append(Notice(home=home, iid=iid, keep=known[0], split=known[1],
                                    start=known[2]))

    # -- the horizon --------------------------------------------------------------

    def _clock(self) -> int:
        return int(self.store.get(self._clock_key, 0))

    def _schedule(self, key: str, due_ms: int) -> None:
        expiry.schedule(self.store, key, partition=self.home, due_ms=due_ms,
                        bucket_ms=self.config.bucket_ms)

    def _expire(self, key: str, horizon_ms: int) -> int | None:
        if key.startswith(SPLIT_PREFIX):
            return self._splitter.expire_key(key, horizon_ms)
        if key in self.store:
            del self.store[key]
            self.counters.inc("expiry", "dedup_decisions" if key.startswith(DECIDED_PREFIX)
                              else "dedup_band_state")
        return None
