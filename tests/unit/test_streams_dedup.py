"""Dedup stage: exact and near duplicates; of a cross-split pair the first to finish stays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.dedup import (
    DedupConfig,
    DedupIndex,
    DedupStage,
    content_digest,
    duplicated,
    minhash_of,
    signature,
)
from hebrus_flywheel.streams.processors.split import SplitConfig

CONFIG = DedupConfig()


def tokens(seed: int, n: int = 400) -> list[int]:
    return np.random.default_rng(seed).integers(10, 30_000, n).tolist()


def near_copy(base: list[int], changes: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    out = list(base)
    for i in rng.choice(len(out), changes, replace=False):
        out[int(i)] = 5
    return out


def summary(iid: str, owner: str, toks: list[int], thread: str | None = None) -> dict[str, Any]:
    return {
        "iid": iid,
        "owner": owner,
        "thread": thread or iid,
        "generation": 0,
        "partition": 0,
        "start_ms": 0,
        "tags": [],
        "tool_turns": 0,
        "token_count": len(toks),
        "generated_count": 1,
        "routes_complete": False,
        "digest": content_digest(toks),
        "minhash": signature(toks, CONFIG),
    }


def stage(owner_splits: dict[str, str]) -> DedupStage:
    """A stage whose owners land where the test says (validation_fraction 0 or 1 per salt)."""
    s = DedupStage(
        split_config=SplitConfig(runtime_holdout_fraction=0.0, stress_rate=0.0),
        dedup_config=CONFIG,
        store={},
    )
    for owner, split in owner_splits.items():
        s.store[f"s\x1f{owner}/{owner}-t"] = {"split": split, "rule": "test"}
    return s


def decide(s: DedupStage, owner: str, toks: list[int], n: int = 0) -> dict[str, Any]:
    return s.process(summary(f"{owner}-{n}", owner, toks, thread=f"{owner}-t" if n == 0 else None))


def test_signature_is_deterministic_and_estimates_jaccard() -> None:
    a = tokens(1)
    assert signature(a, CONFIG) == signature(list(a), CONFIG)
    b = near_copy(a, 3)
    assert minhash_of(a, CONFIG).jaccard(minhash_of(b, CONFIG)) > 0.8
    assert minhash_of(a, CONFIG).jaccard(minhash_of(tokens(2), CONFIG)) < 0.1
    assert content_digest(a) != content_digest(b)


def test_exact_duplicate_is_dropped() -> None:
    s = stage({"a": "train", "b": "train"})
    assert decide(s, "a", tokens(1))["keep"]
    d = decide(s, "b", tokens(1))
    assert not d["keep"] and d["reason"] == "exact_duplicate" and d["match"] == "a-0"


def test_near_duplicate_of_train_is_removed_from_evaluation() -> None:
    s = stage({"a": "train", "v": "validation"})
    assert decide(s, "a", tokens(1))["keep"]
    d = decide(s, "v", near_copy(tokens(1), 3))
    assert not d["keep"] and d["reason"] == "near_duplicate_of_train"
    assert s.counters.get("dedup", "near_duplicate_of_train") == 1


def test_train_thread_after_a_published_evaluation_near_duplicate_is_dropped() -> None:
    """The evaluation thread's windows are out; the later train copy must not leak."""
    s = stage({"a": "train", "v": "validation"})
    assert decide(s, "v", tokens(1))["keep"]
    d = decide(s, "a", near_copy(tokens(1), 3))
    assert not d["keep"] and d["reason"] == "near_duplicate_of_evaluation"
    assert d["match"] == "v-0" and d["threshold"] == CONFIG.threshold
    assert s.counters.get("dedup", "near_duplicate_of_evaluation") == 1


def test_either_arrival_order_leaves_one_split_with_the_content() -> None:
    for first, second in (("a", "v"), ("v", "a")):
        s = stage({"a": "train", "v": "validation"})
        text = tokens(1)
        kept = [decide(s, o, text if o == first else near_copy(text, 3))["keep"]
                for o in (first, second)]
        assert kept == [True, False]


def test_unrelated_threads_are_kept() -> None:
    s = stage({"a": "train", "v": "validation"})
    assert decide(s, "a", tokens(1))["keep"]
    assert decide(s, "v", tokens(2))["keep"]


def test_decisions_are_recorded_and_repeated() -> None:
    s = stage({"a": "train", "b": "train"})
    first = decide(s, "a", tokens(1))
    assert decide(s, "a", tokens(1)) == first
    assert s.counters.get("dedup", "repeated_summaries") == 1


def test_decision_lost_after_its_split_was_stored_is_made_again_identically() -> None:
    """A crash may keep the sticky split but lose the decision record written after it."""
    config = SplitConfig(runtime_holdout_fraction=0.0, stress_rate=0.0)
    first = DedupStage(split_config=config, dedup_config=CONFIG, store={})
    s = summary("a-0", "a", tokens(1))
    decision = first.process(s)
    kept = {k: v for k, v in first.store.items() if k.startswith("s\x1f")}
    again = DedupStage(split_config=config, dedup_config=CONFIG, store=kept).process(s)
    assert again == decision and again["split_rule"] != "sticky_thread"
    later = first.process(summary("a-1", "a", tokens(2), thread="a-0"))
    assert later["split"] == decision["split"] and later["split_rule"] == "sticky_thread"


def test_index_is_rebuilt_from_the_store() -> None:
    s = stage({"a": "train", "v": "validation"})
    decide(s, "a", tokens(1))
    s.reset()
    d = decide(s, "v", near_copy(tokens(1), 3))
    assert d["reason"] == "near_duplicate_of_train"


def test_other_generations_of_a_thread_are_not_near_duplicates() -> None:
    index = DedupIndex(CONFIG)
    base = tokens(1)
    index.add(
        "x-0",
        split="train",
        digest=content_digest(base),
        thread="o/x",
        hashvalues=signature(base, CONFIG),
    )
    same_thread = index.decide(
        split="train",
        digest=content_digest(near_copy(base, 3)),
        thread="o/x",
        hashvalues=signature(near_copy(base, 3), CONFIG),
    )
    assert same_thread.keep


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="threshold"):
        DedupConfig(threshold=0.0)
    with pytest.raises(ConfigError, match="num_perm"):
        DedupConfig(num_perm=0)
    with pytest.raises(ConfigError, match="band_partitioned"):
        DedupConfig(band_partitioned="yes")  # type: ignore[arg-type]


def test_duplicated_names_every_member_of_exact_and_near_pairs() -> None:
    rng = np.random.default_rng(7)
    base, other, third = (rng.integers(0, 50_000, 400).tolist() for _ in range(3))
    near = list(base)
    near[200] += 1  # one token differs: Jaccard of the 5-shingles stays far above 0.8
    sequences = [base, other, near, third, list(other)]
    assert duplicated(sequences, DedupConfig()) == {0, 1, 2, 4}
    assert duplicated([base, other, third], DedupConfig()) == set()
