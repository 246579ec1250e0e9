"""Dedup stage: exact duplicates by content digest, near duplicates by MinHash/LSH.

A completed thread generation arrives with its content digest (SHA-256 of the canonical
token ids) and a MinHash signature over token shingles (datasketch ``MinHash``,
``affine32`` scheme, ``MinHashLSH`` index). Decisions, in arrival order at this stage:

* an exact duplicate of a kept thread is dropped (``exact_duplicate``);
* an evaluation-split thread whose estimated Jaccard similarity with a kept *train*
  thread reaches ``threshold`` is dropped (``near_duplicate_of_train``): the
  evaluation split loses it, never the training split;
* with ``drop_near_within_split``, a near duplicate of a kept thread of the same split
  is dropped (``near_duplicate``); other generations of the same owner/thread are
  exempt (they share the split by construction);
* a *train* thread that arrives after a kept evaluation thread it near-duplicates (or
  duplicates exactly) is dropped (``near_duplicate_of_evaluation``): that evaluation
  thread's windows are already published and cannot be taken back, so the only way to
  leave no near-identical content across train and evaluation is to give up the later
  train thread. Which one of a cross-split pair survives thus follows the order of
  decisions, but no pair ever survives in both splits. The worker decides in event-time
  order (:mod:`streams.processors.decision_order`), so that order does not depend on
  how many workers run or on their timing.

The decision of a thread generation is recorded with it, so a repeated summary
(redelivery) gets the same decision back.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from datasketch import MinHash, MinHashLSH

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors import expiry
from hebrus_flywheel.streams.processors.common import SEP, thread_key
from hebrus_flywheel.streams.processors.split import SplitConfig, assign_split

_SCHEME = "affine32"
_MIX = np.uint64(0x9E3779B97F4A7C15)
_PRIME = np.uint64(0x100000001B3)


@dataclass(frozen=True, kw_only=True)
class DedupConfig:
    """Near-duplicate detection parameters.

    Fields:
        shingle_size: tokens per shingle (contiguous token n-grams).
        num_perm: MinHash permutations (signature length).
        threshold: Jaccard similarity at or above which two threads are near duplicates.
        seed: MinHash permutation seed; every worker must use the same one.
        drop_near_within_split: also drop near duplicates within one split.
        horizon_ms: how far back, in event time, the dedup index remembers kept threads.
            Each decision is filed in the time bucket of its thread's start
            (``start_ms``); once the newest start seen is more than ``horizon_ms`` past a
            bucket's end, the bucket's decisions, index entries and sticky splits are
            deleted (changelog tombstones). **A duplicate of a thread that started more
            than the horizon before it is no longer caught** (it is kept as unique), and
            a later generation of a thread silent for longer than the horizon is split
            afresh (by the same rules; only the time-dependent ones can differ).
        bucket_ms: width of the dedup index's time buckets; state is kept up to one
            bucket longer than the horizon.
        order_lateness_ms: how far, in event time (``wall_time_ms``), a capture record
            may trail the latest record before it in its topic partition. The worker
            decides thread generations in event-time order (:mod:`streams.processors.
            decision_order`), and a generation can only be decided once every capture
            partition has read this far past its end. Larger: more disorder tolerated,
            decisions wait longer (until a partition is caught up, at most this much
            event time). A generation that completes later than that (idle closure,
            records later than this) is decided on arrival (``dedup/late_summaries``).
        band_partitioned: decide band-partitioned (:mod:`streams.processors.dedup_bands`
            in the worker's ``--dedup-bands``), so the stage's work spreads over
            workers, rather than on one partition. Part of the configuration a group's
            workers share, so they all run one layout.
    """

    shingle_size: int = 5
    num_perm: int = 128
    threshold: float = 0.8
    seed: int = 1
    drop_near_within_split: bool = True
    horizon_ms: int = 7 * 86_400_000
    bucket_ms: int = 3_600_000
    order_lateness_ms: int = 60_000
    band_partitioned: bool = False

    def __post_init__(self) -> None:
        for name in ("shingle_size", "num_perm", "horizon_ms", "bucket_ms", "order_lateness_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"DedupConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.threshold, int | float) or not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"DedupConfig.threshold must be in (0, 1], got {self.threshold!r}")
        if not isinstance(self.seed, int):
            raise ConfigError("DedupConfig.seed must be an integer")
        if not isinstance(self.band_partitioned, bool):
            raise ConfigError("DedupConfig.band_partitioned must be true or false")


def content_digest(tokens: Sequence[int] | np.ndarray) -> str:
    """Hex SHA-256 of the canonical token ids (int32 little-endian)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def shingle_hashes(tokens: Sequence[int] | np.ndarray, size: int) -> np.ndarray:
    """32-bit hashes of every ``size``-token shingle (one shingle if the thread is shorter)."""
    arr = np.asarray(tokens, dtype=np.uint64)
    if arr.size == 0:
        return np.zeros(1, dtype=np.uint64)
    width = min(size, arr.size)
    count = arr.size - width + 1
    acc = np.full(count, np.uint64(width), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(width):
            acc = (acc ^ arr[j : j + count]) * _PRIME
        acc ^= acc >> np.uint64(29)
        acc *= _MIX
        acc ^= acc >> np.uint64(32)
    return np.unique(acc & np.uint64(0xFFFFFFFF))


def _identity(value: Any) -> Any:
    return value


@functools.cache
def _permutations(num_perm: int, seed: int) -> Any:
    """The permutation parameters MinHash derives from ``seed`` (computed once, not per
    sketch: they are the same for every sketch of one configuration)."""
    permutations = MinHash(num_perm=num_perm, seed=seed, hashfunc=_identity,
                           scheme=_SCHEME).permutations
    permutations.flags.writeable = False  # shared by every sketch
    return permutations


def minhash_of(tokens: Sequence[int] | np.ndarray, config: DedupConfig) -> MinHash:
    m = MinHash(num_perm=config.num_perm, seed=config.seed, hashfunc=_identity, scheme=_SCHEME,
                permutations=_permutations(config.num_perm, config.seed))
    m.update_batch(shingle_hashes(tokens, config.shingle_size))
    return m


def signature(tokens: Sequence[int] | np.ndarray, config: DedupConfig) -> list[int]:
    """The MinHash signature of a token sequence, as plain ints (storable, JSON-able)."""
    return [int(v) for v in minhash_of(tokens, config).hashvalues]


@functools.cache
def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """The ``(bands, rows)`` MinHashLSH picks for ``threshold`` (an optimisation that takes
    tens of milliseconds; done once per configuration, not per index)."""
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    return lsh.b, lsh.r


def duplicated(sequences: Sequence[Sequence[int] | np.ndarray], config: DedupConfig) -> set[int]:
    """Indices of the sequences this stage may drop: every member of an exact or near
    duplicate pair (which member survives follows arrival order, so neither is sure).
    Threads of one owner and thread id are not told apart here; callers pass one
    generation per thread."""
    hashes = [minhash_of(seq, config) for seq in sequences]
    digests = [content_digest(seq) for seq in sequences]
    lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm,
                     params=lsh_params(config.threshold, config.num_perm))
    for i, m in enumerate(hashes):
        lsh.insert(i, m)
    copies = Counter(digests)
    found = {i for i, d in enumerate(digests) if copies[d] > 1}
    for i, m in enumerate(hashes):
        near = {j for j in lsh.query(m) if j != i and m.jaccard(hashes[j]) >= config.threshold}
        if near:
            found |= near | {i}
    return found


def _restore(hashvalues: Sequence[int], config: DedupConfig) -> MinHash:
    return MinHash(
        seed=config.seed,
        hashvalues=np.asarray(hashvalues, dtype=np.uint32),
        permutations=_permutations(len(hashvalues), config.seed),
        scheme=_SCHEME,
        hashfunc=_identity,
    )


@dataclass(frozen=True, kw_only=True)
class DedupVerdict:
    keep: bool
    reason: str
    match: str | None = None


class DedupIndex:
    """Kept threads: digest map + MinHash LSH, with each thread's split."""

    def __init__(self, config: DedupConfig) -> None:
        self.config = config
        self._lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm,
                               params=lsh_params(config.threshold, config.num_perm))
        self._hashes: dict[str, MinHash] = {}
        self._splits: dict[str, str] = {}
        self._threads: dict[str, str] = {}
        self._digests: dict[str, str] = {}
        self._digest_of: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._splits)

    def add(
        self, iid: str, *, split: str, digest: str, thread: str, hashvalues: Sequence[int]
    ) -> None:
        if iid in self._splits:
            return
        m = _restore(hashvalues, self.config)
        self._lsh.insert(iid, m)
        self._hashes[iid] = m
        self._splits[iid] = split
        self._threads[iid] = thread
        self._digests.setdefault(digest, iid)
        self._digest_of[iid] = digest

    def remove(self, iid: str) -> None:
        """Forget a kept thread (it left the dedup horizon)."""
        if iid not in self._splits:
            return
        self._lsh.remove(iid)
        del self._hashes[iid], self._splits[iid], self._threads[iid]
        digest = self._digest_of.pop(iid)
        if self._digests.get(digest) == iid:
            del self._digests[digest]

    def _near(self, m: MinHash, thread: str) -> list[str]:
        found = [
            other
            for other in self._lsh.query(m)
            if self._threads[other] != thread
            and m.jaccard(self._hashes[other]) >= self.config.threshold
        ]
        return sorted(found)

    def decide(
        self, *, split: str, digest: str, thread: str, hashvalues: Sequence[int]
    ) -> DedupVerdict:
        """Keep or drop a new thread generation (see the module docstring for the rules)."""
        near = self._near(_restore(hashvalues, self.config), thread)
        return verdict_of(split=split, exact=self._digests.get(digest), near=near,
                          splits=self._splits,
                          drop_near_within_split=self.config.drop_near_within_split)


def verdict_of(
    *, split: str, exact: str | None, near: Sequence[str], splits: Mapping[str, str],
    drop_near_within_split: bool,
) -> DedupVerdict:
    """The module's rules, given what a new generation matches among the *kept* threads:
    ``exact``, the kept thread with its content digest (if any); ``near``, the kept
    threads of other owner/threads at or above the threshold, sorted; ``splits``, each
    kept thread's split. Shared by the one-partition index and the band-partitioned
    stage (:mod:`streams.processors.dedup_bands`), so both apply the same rules."""
    near = list(near)
    if exact is not None and exact not in near:
        near.insert(0, exact)
    train = [o for o in near if splits[o] == "train"]
    evals = tuple(o for o in near if splits[o] != "train")
    if split == "train":
        if exact is not None and splits[exact] == "train":
            return DedupVerdict(keep=False, reason="exact_duplicate", match=exact)
        if evals:
            return DedupVerdict(keep=False, reason="near_duplicate_of_evaluation",
                                match=evals[0])
        if train and drop_near_within_split:
            return DedupVerdict(keep=False, reason="near_duplicate", match=train[0])
        return DedupVerdict(keep=True, reason="unique")
    if exact is not None:
        return DedupVerdict(keep=False, reason="exact_duplicate", match=exact)
    if train:
        return DedupVerdict(keep=False, reason="near_duplicate_of_train", match=train[0])
    same = [o for o in evals if splits[o] == split]
    if same and drop_near_within_split:
        return DedupVerdict(keep=False, reason="near_duplicate", match=same[0])
    return DedupVerdict(keep=True, reason="unique")


DECISION_PREFIX = f"d{SEP}"
SPLIT_PREFIX = f"s{SEP}"
SEQ_KEY = f"n{SEP}seq"
WATERMARK_KEY = f"n{SEP}wm"
"""The newest thread start (event time, ms) the stage has seen: the dedup clock."""
DEDUP_PARTITION = 0
"""The dedup table has one partition (its expiry buckets live there)."""


class DedupStage:
    """Split + dedup over a state mapping; one instance owns the single dedup partition.

    The index is partitioned by teacher identity (``identity_id`` of the summary): two
    teachers publishing the same conversations to the same topics are deduplicated each
    against its own threads, never against the other's. Sticky splits stay per thread,
    so one conversation lands in the same split for every teacher.
    """

    def __init__(
        self,
        *,
        split_config: SplitConfig,
        dedup_config: DedupConfig,
        store: MutableMapping[str, Any],
        counters: Counters | None = None,
        partition: int = DEDUP_PARTITION,
    ) -> None:
        self.partition = partition  # of the table: where its expiry buckets live
        self.split_config = split_config
        self.dedup_config = dedup_config
        self.store = store
        self.counters = counters or Counters()
        self._indexes: dict[str, DedupIndex] | None = None
        lsh_params(dedup_config.threshold, dedup_config.num_perm)  # once, at start-up

    def reset(self) -> None:
        """Forget the in-memory index (after a rebalance); it is rebuilt from the store."""
        self._indexes = None

    def index(self, identity_id: str | None = None) -> DedupIndex:
        """The index of one teacher identity's kept threads."""
        indexes = self._all_indexes()
        key = identity_id or ""
        if key not in indexes:
            indexes[key] = DedupIndex(self.dedup_config)
        return indexes[key]

    def _all_indexes(self) -> dict[str, DedupIndex]:
        if self._indexes is None:
            self._indexes = {}
            kept = [v for k, v in self.store.items() if k.startswith(DECISION_PREFIX) and v["hv"]]
            for value in sorted(kept, key=lambda v: v["seq"]):
                d = value["decision"]
                index = self._indexes.setdefault(d.get("identity_id") or "",
                                                 DedupIndex(self.dedup_config))
                index.add(
                    d["iid"],
                    split=d["split"],
                    digest=d["digest"],
                    thread=thread_key(d["owner"], d["thread"]),
                    hashvalues=value["hv"],
                )
        return self._indexes

    def process(self, summary: Mapping[str, Any]) -> dict[str, Any]:
        """The decision for one thread summary (recorded; a repeat gets the same one)."""
        recorded = self.store.get(DECISION_PREFIX + summary["iid"])
        if recorded is not None:
            self.counters.inc("dedup", "repeated_summaries")
            return dict(recorded["decision"])
        self._advance(summary)
        split, rule = self.split_for(summary)
        tkey = thread_key(summary["owner"], summary["thread"])
        verdict = self.index(summary.get("identity_id")).decide(
            split=split, digest=summary["digest"], thread=tkey, hashvalues=summary["minhash"]
        )
        decision = decision_record(summary, split, rule, verdict, self.dedup_config.threshold)
        self._record(summary, decision, verdict)
        return decision

    # -- the horizon ----------------------------------------------------------------

    def _advance(self, summary: Mapping[str, Any]) -> None:
        """Move the dedup clock to this thread's start and expire what left the horizon."""
        start = start_ms(summary)
        clock = max(int(self.store.get(WATERMARK_KEY, 0)), start)
        if clock != self.store.get(WATERMARK_KEY):
            self.store[WATERMARK_KEY] = clock
        expiry.sweep(self.store, partition=self.partition,
                     now_ms=clock - self.dedup_config.horizon_ms,
                     bucket_ms=self.dedup_config.bucket_ms, decide=self.expire_key)

    def expire_key(self, key: str, horizon_ms: int) -> int | None:
        """Delete one scheduled decision or sticky split that started before the horizon
        (its bucket is due); a sticky split used by a later generation moves on."""
        value = self.store.get(key)
        if value is None:
            return None
        last = int(value.get("at", 0))
        if last > horizon_ms:  # used again since it was scheduled: keep it for longer
            return last
        del self.store[key]
        if key.startswith(DECISION_PREFIX):
            d = value["decision"]
            if self._indexes is not None and value["hv"]:
                self.index(d.get("identity_id")).remove(d["iid"])
            self.counters.inc("expiry", "dedup_decisions")
        else:
            self.counters.inc("expiry", "sticky_splits")
        return None

    def _schedule(self, key: str, start_ms: int) -> None:
        expiry.schedule(self.store, key, partition=self.partition, due_ms=start_ms,
                        bucket_ms=self.dedup_config.bucket_ms)

    # -- split and record -----------------------------------------------------------

    def split_for(self, summary: Mapping[str, Any]) -> tuple[str, str]:
        """``(split, rule)`` of a generation: its thread's sticky split, or the split rules'
        choice for a thread's first generation (recorded as the thread's sticky split)."""
        skey = SPLIT_PREFIX + thread_key(summary["owner"], summary["thread"])
        sticky = self.store.get(skey)
        start = start_ms(summary)
        if sticky is not None:
            if int(sticky.get("at", 0)) < start:
                self.store[skey] = {**sticky, "at": start}
            if sticky.get("iid") == summary["iid"]:
                # this generation chose the split itself and its decision record was lost
                # (a crash between the two state writes): decide as the first time, so a
                # repeated window keeps its split_rule and content digest
                return sticky["split"], sticky["rule"]
            return sticky["split"], "sticky_thread"
        chosen = assign_split(summary, self.split_config)
        self.store[skey] = {"split": chosen.split, "rule": chosen.rule, "iid": summary["iid"],
                            "at": start}
        self._schedule(skey, start)
        return chosen.split, chosen.rule

    def _record(
        self, summary: Mapping[str, Any], decision: dict[str, Any], verdict: DedupVerdict
    ) -> None:
        seq = int(self.store.get(SEQ_KEY, 0)) + 1
        self.store[SEQ_KEY] = seq
        hv = list(summary["minhash"]) if verdict.keep else None
        dkey = DECISION_PREFIX + summary["iid"]
        start = start_ms(summary)
        self.store[dkey] = {"decision": decision, "hv": hv, "seq": seq, "at": start}
        self._schedule(dkey, start)
        if verdict.keep:
            self.index(summary.get("identity_id")).add(
                summary["iid"],
                split=decision["split"],
                digest=summary["digest"],
                thread=thread_key(summary["owner"], summary["thread"]),
                hashvalues=summary["minhash"],
            )
        self.counters.inc("split", decision["split"])
        self.counters.inc("dedup", verdict.reason)


def start_ms(summary: Mapping[str, Any]) -> int:
    """A thread's event time for the dedup horizon: its start (0 when unknown)."""
    start = summary.get("start_ms")
    return int(start) if isinstance(start, int) and not isinstance(start, bool) else 0


def decision_record(
    summary: Mapping[str, Any], split: str, rule: str, verdict: DedupVerdict, threshold: float
) -> dict[str, Any]:
    return {
        "iid": summary["iid"],
        "identity_id": summary.get("identity_id"),
        "owner": summary["owner"],
        "thread": summary["thread"],
        "generation": summary["generation"],
        "partition": summary["partition"],
        "digest": summary["digest"],
        "split": split,
        "split_rule": rule,
        "keep": verdict.keep,
        "reason": verdict.reason,
        "match": verdict.match,
        "threshold": threshold,
    }
