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

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.common import thread_key
from hebrus_flywheel.streams.processors.decision_order import OrderKey, order_key
from hebrus_flywheel.streams.processors.dedup import (
    DedupConfig,
    DedupStage,
    decision_record,
    lsh_params,
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
    digest: str
    hashvalues: np.ndarray  # (num_perm,) uint32
    keys: tuple[bytes, ...]  # the bucket keys routed to this band partition


@dataclass(frozen=True, slots=True)
class Pair:
    """Two generations that match; ``earlier`` comes first in decision order."""

    earlier: str
    earlier_home: int
    earlier_order: OrderKey
    later: str
    later_home: int
    exact: bool
    near: bool


@dataclass(frozen=True, slots=True)
class Notice:
    """A decision sent to the home of a later generation that matches it."""

    home: int
    iid: str
    keep: bool
    split: str


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

    def probes(self, summary: Mapping[str, Any]) -> dict[int, Probe]:
        hashvalues = np.asarray(summary["minhash"], dtype=np.uint32)
        by_partition: dict[int, list[bytes]] = {}
        for key in self.keys(summary, hashvalues):
            by_partition.setdefault(stable_partition(key, self.band_partitions), []).append(key)
        iid, home = str(summary["iid"]), home_of(summary, self.home_partitions)
        thread = thread_key(summary["owner"], summary["thread"])
        order, digest = order_key(summary), str(summary["digest"])
        return {p: Probe(iid=iid, thread=thread, home=home, order=order, digest=digest,
                         hashvalues=hashvalues, keys=tuple(keys))
                for p, keys in sorted(by_partition.items())}


def _watermark(marks: Mapping[int, Mark], partitions: int) -> float:
    """The lowest mark (a partition without one holds everything back)."""
    if len(marks) < partitions:
        return -math.inf
    return min(math.inf if at is None else at for at in marks.values())


class BandPartition:
    """One band partition: buckets of probes, verified pairs, a watermark."""

    def __init__(self, config: DedupConfig, *, capture_partitions: int) -> None:
        self.threshold = config.threshold
        self.capture_partitions = capture_partitions
        self._buckets: dict[bytes, list[str]] = {}
        self._probes: dict[str, Probe] = {}
        self._marks: dict[int, Mark] = {}

    def __len__(self) -> int:
        return len(self._probes)

    def probe(self, probe: Probe) -> list[Pair]:
        """The pairs of a probe with those already here (a repeated probe finds them
        again: homes take a pair twice as once)."""
        others: set[str] = set()
        for key in probe.keys:
            others.update(self._buckets.get(key, ()))
        others.discard(probe.iid)
        pairs = [p for o in sorted(others) if (p := self._pair(probe, self._probes[o]))]
        if probe.iid not in self._probes:
            self._probes[probe.iid] = probe
            for key in probe.keys:
                self._buckets.setdefault(key, []).append(probe.iid)
        return pairs

    def _pair(self, a: Probe, b: Probe) -> Pair | None:
        exact = a.digest == b.digest
        near = a.thread != b.thread and float(
            np.count_nonzero(a.hashvalues == b.hashvalues)) / a.hashvalues.size >= self.threshold
        if not (exact or near):
            return None
        first, second = (a, b) if a.order < b.order else (b, a)
        return Pair(earlier=first.iid, earlier_home=first.home, earlier_order=first.order,
                    later=second.iid,
                    later_home=second.home, exact=exact, near=near)

    def mark(self, capture_partition: int, at: Mark) -> None:
        self._marks[capture_partition] = at

    def watermark(self) -> float:
        return _watermark(self._marks, self.capture_partitions)


class HomePartition:
    """One home partition: its threads' splits and decisions, in decision order."""

    def __init__(self, *, home: int, split_config: SplitConfig, dedup_config: DedupConfig,
                 capture_partitions: int, band_partitions: int,
                 store: MutableMapping[str, Any] | None = None) -> None:
        self.home = home
        self.config = dedup_config
        self.capture_partitions, self.band_partitions = capture_partitions, band_partitions
        # the split rules and their sticky per-thread state are the one-partition stage's
        self._splitter = DedupStage(split_config=split_config, dedup_config=dedup_config,
                                    store={} if store is None else store)
        self._summaries: dict[str, Mapping[str, Any]] = {}
        self._unsplit: list[tuple[OrderKey, str]] = []  # heap
        self._split: dict[str, tuple[str, str]] = {}
        self._undecided: list[tuple[OrderKey, str]] = []  # split, in order
        # later iid -> earlier iid -> (exact, near, the earlier one's order)
        self._candidates: dict[str, dict[str, tuple[bool, bool, OrderKey]]] = {}
        self._subscribers: dict[str, set[tuple[str, int]]] = {}
        self._known: dict[str, tuple[bool, str]] = {}  # iid -> (keep, split)
        self._capture_marks: dict[int, Mark] = {}
        self._band_marks: dict[int, float] = {}
        self._notices: list[Notice] = []

    # -- inputs -------------------------------------------------------------------

    def summary(self, summary: Mapping[str, Any]) -> None:
        iid = str(summary["iid"])
        if iid in self._summaries:
            return
        self._summaries[iid] = summary
        heapq.heappush(self._unsplit, (order_key(summary), iid))

    def pair(self, pair: Pair) -> None:
        if pair.later_home == self.home:
            self._candidates.setdefault(pair.later, {})[pair.earlier] = (
                pair.exact, pair.near, pair.earlier_order)
        if pair.earlier_home == self.home and pair.later_home != self.home:
            subscribers = self._subscribers.setdefault(pair.earlier, set())
            if (pair.later, pair.later_home) not in subscribers:
                subscribers.add((pair.later, pair.later_home))
                if pair.earlier in self._known:  # decided before the pair came
                    self._notify(pair.earlier, pair.later_home)

    def notice(self, notice: Notice) -> None:
        self._known[notice.iid] = (notice.keep, notice.split)

    def capture_mark(self, capture_partition: int, at: Mark) -> None:
        self._capture_marks[capture_partition] = at

    def band_mark(self, band_partition: int, watermark: float) -> None:
        self._band_marks[band_partition] = watermark

    # -- decisions ----------------------------------------------------------------

    def watermark(self) -> float:
        bands = (min(self._band_marks.values())
                 if len(self._band_marks) == self.band_partitions else -math.inf)
        return min(_watermark(self._capture_marks, self.capture_partitions), bands)

    def step(self) -> tuple[list[dict[str, Any]], list[Notice]]:
        """Decide what can be decided: ``(decisions, notices for other homes)``."""
        watermark = self.watermark()
        while self._unsplit and self._unsplit[0][0][0] < watermark:
            key, iid = heapq.heappop(self._unsplit)
            self._split[iid] = self._splitter.split_for(self._summaries[iid])
            self._undecided.append((key, iid))
        decisions, waiting = [], []
        for key, iid in self._undecided:
            if all(c in self._known for c in self._candidates.get(iid, ())):
                decisions.append(self._decide(iid))
            else:
                waiting.append((key, iid))
        self._undecided = waiting
        notices, self._notices = self._notices, []
        return decisions, notices

    def _decide(self, iid: str) -> dict[str, Any]:
        summary = self._summaries.pop(iid)
        split, rule = self._split.pop(iid)
        candidates = self._candidates.pop(iid, {})
        kept = {c: self._known[c][1] for c in candidates if self._known[c][0]}
        exact = [c for c in kept if candidates[c][0]]
        verdict = verdict_of(  # the first kept with its digest, as the one index keeps it
            split=split, exact=min(exact, key=lambda c: candidates[c][2]) if exact else None,
            near=sorted(c for c in kept if candidates[c][1]), splits=kept,
            drop_near_within_split=self.config.drop_near_within_split)
        self._known[iid] = (verdict.keep, split)
        for _, home in self._subscribers.get(iid, ()):
            self._notify(iid, home)
        return decision_record(summary, split, rule, verdict, self.config.threshold)

    def _notify(self, iid: str, home: int) -> None:
        keep, split = self._known[iid]
        self._notices.append(Notice(home=home, iid=iid, keep=keep, split=split))


Node = tuple[str, int]  # ("capture" | "band" | "home", partition)


class InProcessBands:
    """Every partition of the stage in one process, joined by first-in-first-out channels
    like a Kafka partition's records from one producer; :meth:`run` delivers them in the
    order ``rng`` draws (round-robin without one), so tests can try many interleavings."""

    def __init__(self, *, split_config: SplitConfig, dedup_config: DedupConfig,
                 capture_partitions: int, band_partitions: int, home_partitions: int,
                 rng: np.random.Generator | None = None) -> None:
        self.router = BandRouter(dedup_config, band_partitions=band_partitions,
                                 home_partitions=home_partitions)
        self.bands = [BandPartition(dedup_config, capture_partitions=capture_partitions)
                      for _ in range(band_partitions)]
        self.homes = [HomePartition(home=h, split_config=split_config,
                                    dedup_config=dedup_config,
                                    capture_partitions=capture_partitions,
                                    band_partitions=band_partitions)
                      for h in range(home_partitions)]
        self.rng = rng
        self._channels: dict[tuple[Node, Node], list[tuple[str, Any]]] = {}
        self._band_sent: dict[int, float] = {}
        self.decisions: list[dict[str, Any]] = []

    def _send(self, src: Node, dst: Node, kind: str, payload: Any) -> None:
        self._channels.setdefault((src, dst), []).append((kind, payload))

    def summary(self, capture_partition: int, summary: Mapping[str, Any]) -> None:
        """What a capture partition sends when it completes a generation."""
        src = ("capture", capture_partition)
        self._send(src, ("home", home_of(summary, len(self.homes))), "summary", summary)
        for band, probe in self.router.probes(summary).items():
            self._send(src, ("band", band), "probe", probe)

    def mark(self, capture_partition: int, at: Mark) -> None:
        """A capture partition's mark, to every band and home partition."""
        src = ("capture", capture_partition)
        for dst in [("band", b) for b in range(len(self.bands))] + \
                   [("home", h) for h in range(len(self.homes))]:
            self._send(src, dst, "mark", (capture_partition, at))

    def run(self) -> list[dict[str, Any]]:
        """Deliver every record; the decisions made, in the order made."""
        turn = 0
        while live := [c for c, queue in self._channels.items() if queue]:
            channel = live[int(self.rng.integers(len(live))) if self.rng else turn % len(live)]
            turn += 1
            kind, payload = self._channels[channel].pop(0)
            (_, _), (role, index) = channel
            if role == "band":
                self._at_band(index, kind, payload)
            else:
                self._at_home(index, kind, payload)
        return self.decisions

    def _at_band(self, index: int, kind: str, payload: Any) -> None:
        band, src = self.bands[index], ("band", index)
        if kind == "probe":
            for pair in band.probe(payload):
                for home in {pair.earlier_home, pair.later_home}:
                    self._send(src, ("home", home), "pair", pair)
            return
        band.mark(*payload)
        watermark = band.watermark()
        if self._band_sent.get(index) != watermark:
            self._band_sent[index] = watermark
            for home in range(len(self.homes)):
                self._send(src, ("home", home), "band_mark", (index, watermark))

    def _at_home(self, index: int, kind: str, payload: Any) -> None:
        home = self.homes[index]
        if kind == "summary":
            home.summary(payload)
        elif kind == "pair":
            home.pair(payload)
        elif kind == "notice":
            home.notice(payload)
        elif kind == "mark":
            home.capture_mark(*payload)
        else:
            home.band_mark(*payload)
        decisions, notices = home.step()
        self.decisions.extend(decisions)
        for notice in notices:
            self._send(("home", index), ("home", notice.home), "notice", notice)
