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
* a *train* thread is never dropped in favour of an evaluation thread. When it arrives
  after an evaluation thread it duplicates, whose windows are already published, it is
  kept and the conflict is counted as ``late_eval_conflict`` (reported by inspect).

The decision of a thread generation is recorded with it, so a repeated summary
(redelivery) gets the same decision back.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from datasketch import MinHash, MinHashLSH

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
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
    """

    shingle_size: int = 5
    num_perm: int = 128
    threshold: float = 0.8
    seed: int = 1
    drop_near_within_split: bool = True

    def __post_init__(self) -> None:
        for name in ("shingle_size", "num_perm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"DedupConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.threshold, int | float) or not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"DedupConfig.threshold must be in (0, 1], got {self.threshold!r}")
        if not isinstance(self.seed, int):
            raise ConfigError("DedupConfig.seed must be an integer")


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
    late_conflicts: tuple[str, ...] = ()


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
        exact = self._digests.get(digest)
        m = _restore(hashvalues, self.config)
        near = self._near(m, thread)
        if exact is not None and exact not in near:
            near.insert(0, exact)
        train = [o for o in near if self._splits[o] == "train"]
        evals = tuple(o for o in near if self._splits[o] != "train")
        if split == "train":
            if exact is not None and self._splits[exact] == "train":
                return DedupVerdict(keep=False, reason="exact_duplicate", match=exact)
            if train and self.config.drop_near_within_split:
                return DedupVerdict(keep=False, reason="near_duplicate", match=train[0])
            return DedupVerdict(keep=True, reason="unique", late_conflicts=evals)
        if exact is not None:
            return DedupVerdict(keep=False, reason="exact_duplicate", match=exact)
        if train:
            return DedupVerdict(keep=False, reason="near_duplicate_of_train", match=train[0])
        same = [o for o in evals if self._splits[o] == split]
        if same and self.config.drop_near_within_split:
            return DedupVerdict(keep=False, reason="near_duplicate", match=same[0])
        return DedupVerdict(keep=True, reason="unique")


DECISION_PREFIX = f"d{SEP}"
SPLIT_PREFIX = f"s{SEP}"


class DedupStage:
    """Split + dedup over a state mapping; one instance owns the single dedup partition."""

    def __init__(
        self,
        *,
        split_config: SplitConfig,
        dedup_config: DedupConfig,
        store: MutableMapping[str, Any],
        counters: Counters | None = None,
    ) -> None:
        self.split_config = split_config
        self.dedup_config = dedup_config
        self.store = store
        self.counters = counters or Counters()
        self._index: DedupIndex | None = None
        lsh_params(dedup_config.threshold, dedup_config.num_perm)  # once, at start-up

    def reset(self) -> None:
        """Forget the in-memory index (after a rebalance); it is rebuilt from the store."""
        self._index = None

    def index(self) -> DedupIndex:
        if self._index is None:
            index = DedupIndex(self.dedup_config)
            kept = [v for k, v in self.store.items() if k.startswith(DECISION_PREFIX) and v["hv"]]
            for value in sorted(kept, key=lambda v: v["seq"]):
                d = value["decision"]
                index.add(
                    d["iid"],
                    split=d["split"],
                    digest=d["digest"],
                    thread=thread_key(d["owner"], d["thread"]),
                    hashvalues=value["hv"],
                )
            self._index = index
        return self._index

    def process(self, summary: Mapping[str, Any]) -> dict[str, Any]:
        """The decision for one thread summary (recorded; a repeat gets the same one)."""
        recorded = self.store.get(DECISION_PREFIX + summary["iid"])
        if recorded is not None:
            self.counters.inc("dedup", "repeated_summaries")
            return dict(recorded["decision"])
        split, rule = self._split(summary)
        tkey = thread_key(summary["owner"], summary["thread"])
        verdict = self.index().decide(
            split=split, digest=summary["digest"], thread=tkey, hashvalues=summary["minhash"]
        )
        decision = _decision(summary, split, rule, verdict)
        self._record(summary, decision, verdict)
        return decision

    def _split(self, summary: Mapping[str, Any]) -> tuple[str, str]:
        skey = SPLIT_PREFIX + thread_key(summary["owner"], summary["thread"])
        sticky = self.store.get(skey)
        if sticky is not None:
            if sticky.get("iid") == summary["iid"]:
                # this generation chose the split itself and its decision record was lost
                # (a crash between the two state writes): decide as the first time, so a
                # repeated window keeps its split_rule and content digest
                return sticky["split"], sticky["rule"]
            return sticky["split"], "sticky_thread"
        chosen = assign_split(summary, self.split_config)
        self.store[skey] = {"split": chosen.split, "rule": chosen.rule, "iid": summary["iid"]}
        return chosen.split, chosen.rule

    def _record(
        self, summary: Mapping[str, Any], decision: dict[str, Any], verdict: DedupVerdict
    ) -> None:
        seq = int(self.store.get(f"n{SEP}seq", 0)) + 1
        self.store[f"n{SEP}seq"] = seq
        hv = list(summary["minhash"]) if verdict.keep else None
        self.store[DECISION_PREFIX + summary["iid"]] = {"decision": decision, "hv": hv, "seq": seq}
        if verdict.keep:
            self.index().add(
                summary["iid"],
                split=decision["split"],
                digest=summary["digest"],
                thread=thread_key(summary["owner"], summary["thread"]),
                hashvalues=summary["minhash"],
            )
        self.counters.inc("split", decision["split"])
        self.counters.inc("dedup", verdict.reason)
        if verdict.late_conflicts:
            self.counters.inc("dedup", "late_eval_conflict", len(verdict.late_conflicts))


def _decision(
    summary: Mapping[str, Any], split: str, rule: str, verdict: DedupVerdict
) -> dict[str, Any]:
    return {
        "iid": summary["iid"],
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
        "late_conflicts": list(verdict.late_conflicts),
    }
