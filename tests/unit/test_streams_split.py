"""Split stage: sticky owners, temporal cut, stress tags, runtime holdout, no leakage."""

from __future__ import annotations

from typing import Any

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from hebrus_flywheel.streams.processors.split import (
    SplitConfig,
    assign_split,
    owner_split,
    thread_tags,
)
from tests.support.streams_synthetic import Scenario, ThreadSpec, random_specs

T0 = 1_767_225_600_000


def summary(**kw: Any) -> dict[str, Any]:
    base = {
        "owner": "owner-1",
        "thread": "t-1",
        "start_ms": T0,
        "tags": [],
        "tool_turns": 0,
        "token_count": 100,
        "generated_count": 10,
        "routes_complete": False,
    }
    base.update(kw)
    return base


def test_owner_split_is_sticky_and_near_the_ratio() -> None:
    config = SplitConfig(validation_fraction=0.25, runtime_holdout_fraction=0.0, stress_rate=0.0)
    owners = [f"owner-{i}" for i in range(2000)]
    splits = {o: owner_split(o, config) for o in owners}
    share = sum(s == "validation" for s in splits.values()) / len(owners)
    assert 0.21 < share < 0.29
    for o in owners[:50]:
        for t in range(5):
            assert assign_split(summary(owner=o, thread=f"t{t}"), config).split == splits[o]


def test_temporal_cut() -> None:
    config = SplitConfig(temporal_cut_ms=T0 + 1000, runtime_holdout_fraction=0.0)
    assert assign_split(summary(start_ms=T0 + 1000), config).split == "temporal_holdout"
    assert assign_split(summary(start_ms=T0 + 999), config).split in ("train", "validation")


def test_stress_tags_and_derived_tags() -> None:
    config = SplitConfig(stress_rate=1.0, runtime_holdout_fraction=0.0, short_thread_tokens=8)
    assert thread_tags(summary(tool_turns=1), config) == ("tool_calls",)
    assert thread_tags(summary(token_count=3), config) == ("unusual_length",)
    decision = assign_split(summary(tags=["code"]), config)
    assert decision.split == "stress_holdout" and decision.rule == "stress:code"
    assert assign_split(summary(tags=["chat"]), config).split != "stress_holdout"
    none = SplitConfig(stress_rate=0.0, runtime_holdout_fraction=0.0)
    assert assign_split(summary(tags=["code"]), none).split != "stress_holdout"


def test_runtime_holdout_only_for_complete_decode_captures() -> None:
    config = SplitConfig(runtime_holdout_fraction=1.0)
    assert assign_split(summary(routes_complete=True), config).split == "runtime_holdout"
    assert assign_split(summary(routes_complete=False), config).split != "runtime_holdout"
    half = SplitConfig(runtime_holdout_fraction=0.5)
    picked = [
        assign_split(summary(thread=f"t{i}", routes_complete=True), half).split for i in range(1000)
    ]
    assert 400 < picked.count("runtime_holdout") < 600


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="validation_fraction"):
        SplitConfig(validation_fraction=1.5)
    with pytest.raises(ConfigError, match="salt"):
        SplitConfig(salt="")


def test_no_owner_or_thread_in_two_splits_end_to_end() -> None:
    config = ProcessorConfig(
        split=SplitConfig(
            validation_fraction=0.3,
            temporal_cut_ms=T0 + 60_000 * 30,
            stress_rate=0.5,
            runtime_holdout_fraction=0.2,
        )
    )
    sc = Scenario(LocalPipeline(config))
    sc.publish_identity()
    specs = random_specs(40, n_owners=7, seed=11)
    for i, s in enumerate(specs):
        tags = ("code",) if i % 3 == 0 else ()
        sc.send_thread(ThreadSpec(**{**s.__dict__, "tags": tags}))
        if i % 4 == 0:  # a second generation of the same thread
            sc.send_thread(ThreadSpec(**{**s.__dict__, "generation": 1, "seed": s.seed + 99}))
    thread_splits: dict[str, set[str]] = {}
    owner_splits: dict[str, set[str]] = {}
    for w in sc.pipeline.windows:
        thread_splits.setdefault(f"{w['owner']}/{w['thread']}", set()).add(w["split"])
        owner_splits.setdefault(w["owner"], set()).add(w["split"])
    assert all(len(s) == 1 for s in thread_splits.values())
    assert not any({"train", "validation"} <= s for s in owner_splits.values())
    assert {"train", "temporal_holdout", "runtime_holdout"} <= set().union(*thread_splits.values())


def test_search_salt_fills_every_required_split_or_says_none() -> None:
    from hebrus_flywheel.streams.processors.split import draw_splits, search_salt

    ids = [(f"o{owner:032x}", f"t{owner:02d}{n:030x}") for owner in range(9) for n in range(3)]
    config = SplitConfig(salt="s", validation_fraction=0.25, runtime_holdout_fraction=0.15)
    minimum = {"train": 6, "validation": 3, "runtime_holdout": 2}
    salt = search_salt(ids, config, minimum=minimum)
    assert salt is not None and salt == search_salt(ids, config, minimum=minimum)
    counts = draw_splits(ids, SplitConfig(salt=salt, validation_fraction=0.25,
                                          runtime_holdout_fraction=0.15))
    assert all(counts[split] >= n for split, n in minimum.items())
    assert sum(counts.values()) == len(ids)
    # one owner cannot be both train and validation
    assert search_salt(ids[:3], config, minimum={"train": 1, "validation": 1},
                       attempts=50) is None
