"""Band-partitioned dedup decides exactly as the one-partition stage, in any interleaving."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.decision_order import order_key
from hebrus_flywheel.streams.processors.dedup import (
    DedupConfig,
    DedupStage,
    content_digest,
    signature,
)
from hebrus_flywheel.streams.processors.dedup_bands import BandPartition, BandRouter
from hebrus_flywheel.streams.processors.dedup_bands_local import InProcessBands
from hebrus_flywheel.streams.processors.split import SplitConfig

CONFIG = DedupConfig()
SPLITS = SplitConfig(runtime_holdout_fraction=0.0, stress_rate=0.0, validation_fraction=0.4)


def tokens(seed: int, n: int = 200) -> list[int]:
    return np.random.default_rng(seed).integers(10, 30_000, n).tolist()


def near_copy(base: list[int], changes: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    out = list(base)
    for i in rng.choice(len(out), changes, replace=False):
        out[int(i)] = 5
    return out


def summary(iid: str, owner: str, thread: str, toks: list[int], end_ms: int,
            identity: str | None = None) -> dict[str, Any]:
    return {
        "iid": iid, "owner": owner, "thread": thread, "generation": 0, "partition": 0,
        "identity_id": identity, "start_ms": end_ms - 10, "end_ms": end_ms, "tags": [],
        "tool_turns": 0, "token_count": len(toks), "generated_count": 1,
        "routes_complete": False, "digest": content_digest(toks),
        "minhash": signature(toks, CONFIG),
    }


def traffic(seed: int, n: int = 80) -> list[dict[str, Any]]:
    """Threads with exact copies, near copies (some chained), later generations of one
    thread, two teacher identities and end-time ties."""
    rng = np.random.default_rng(seed)
    made: list[list[int]] = []
    out = []
    for i in range(n):
        draw = rng.random()
        if made and draw < 0.15:
            toks = list(made[int(rng.integers(len(made)))])  # exact copy
        elif made and draw < 0.45:
            toks = near_copy(made[int(rng.integers(len(made)))], int(rng.integers(1, 12)), i)
        else:
            toks = tokens(seed * 1000 + i)
        made.append(toks)
        owner = f"o{int(rng.integers(12))}"
        thread = f"t{int(rng.integers(3))}"  # an owner's threads recur: later generations
        identity = "teacher-b" if rng.random() < 0.2 else None
        end = int(rng.integers(1_000, 1_060))  # ties on purpose
        out.append(summary(f"g{i}", owner, thread, toks, end, identity))
    return out


def sequential(summaries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    stage = DedupStage(split_config=SPLITS, dedup_config=CONFIG, store={})
    return {s["iid"]: stage.process(s) for s in sorted(summaries, key=order_key)}


def partitioned(summaries: list[dict[str, Any]], *, captures: int, bands: int, homes: int,
                rng: np.random.Generator | None,
                home_capture_marks: bool = True) -> dict[str, dict[str, Any]]:
    stage = InProcessBands(split_config=SPLITS, dedup_config=CONFIG,
                           capture_partitions=captures, band_partitions=bands,
                           home_partitions=homes, rng=rng,
                           home_capture_marks=home_capture_marks)
    by_capture: dict[int, list[dict[str, Any]]] = {c: [] for c in range(captures)}
    for i, s in enumerate(summaries):
        by_capture[i % captures].append(s)
    for c, own in by_capture.items():
        for s in sorted(own, key=order_key):  # a capture partition completes in order
            stage.summary(c, s)
            stage.mark(c, int(s["end_ms"]))  # nothing of c still to come ends earlier
        stage.mark(c, None)
    decisions = stage.run()
    assert len(decisions) == len({d["iid"] for d in decisions}), "a generation decided twice"
    return {d["iid"]: d for d in decisions}


@pytest.mark.parametrize("seed", range(6))
def test_same_decisions_as_one_partition_in_any_interleaving(seed: int) -> None:
    summaries = traffic(seed)
    want = sequential(summaries)
    dropped = sum(not d["keep"] for d in want.values())
    assert dropped >= 10, "the traffic must hold duplicates to test anything"
    assert {d["reason"] for d in want.values()} >= {"exact_duplicate", "near_duplicate"}
    rng = np.random.default_rng(seed)
    for captures, bands, homes in [(1, 1, 1), (3, 4, 2), (4, 12, 5), (2, 7, 7)]:
        got = partitioned(summaries, captures=captures, bands=bands, homes=homes, rng=rng)
        assert got == want, (captures, bands, homes)
        # as the worker runs it: summaries on their homes before the marks go out
        got = partitioned(summaries, captures=captures, bands=bands, homes=homes, rng=rng,
                          home_capture_marks=False)
        assert got == want, (captures, bands, homes, "no capture marks at homes")


def test_the_keep_or_drop_chain_spans_homes() -> None:
    """A ~ B and B ~ C but not A ~ C: A kept, B dropped, so C is kept, though C's home
    only learns that from B's home."""
    shared = tokens(7, 360)  # B is the shared middle; A adds a prefix, C a suffix
    a = summary("a", "oa", "t", tokens(8, 40) + shared, 1_000)
    b = summary("b", "ob", "t", shared, 1_001)
    c = summary("c", "oc", "t", shared + tokens(9, 40), 1_002)
    ms = {k: np.asarray(s["minhash"]) for k, s in zip("abc", (a, b, c), strict=True)}
    assert np.mean(ms["a"] == ms["b"]) >= 0.8 and np.mean(ms["b"] == ms["c"]) >= 0.8
    assert np.mean(ms["a"] == ms["c"]) < 0.8
    want = sequential([a, b, c])
    assert [want[k]["keep"] for k in "abc"] == [True, False, True]
    for seed in range(20):
        got = partitioned([a, b, c], captures=2, bands=5, homes=3,
                          rng=np.random.default_rng(seed))
        assert got == want


def test_nothing_is_decided_before_every_partition_has_marked() -> None:
    stage = InProcessBands(split_config=SPLITS, dedup_config=CONFIG, capture_partitions=2,
                           band_partitions=3, home_partitions=2)
    stage.summary(0, summary("x", "o", "t", tokens(1), 1_000))
    stage.mark(0, None)
    assert stage.run() == []  # capture partition 1 has not said where it is
    stage.mark(1, 1_000)
    assert stage.run() == []  # it may still complete a generation ending before 1,000
    stage.mark(1, 1_001)
    assert [d["iid"] for d in stage.run()] == ["x"]


def test_probes_spread_over_band_partitions() -> None:
    router = BandRouter(CONFIG, band_partitions=12, home_partitions=4)
    probes = router.probes(summary("x", "o", "t", tokens(3), 1_000))
    keys = sum(len(p.keys) for p in probes.values())
    assert len(probes) > 1 and keys == len(router.keys(
        summary("x", "o", "t", tokens(3), 1_000), np.asarray(probes[min(probes)].hashvalues)))
    band = BandPartition(CONFIG, band=0, capture_partitions=1)
    one = next(iter(probes.values()))
    assert band.probe(one) == [] and band.probe(one) == [] and len(band) == 1


def test_router_refuses_bad_partition_counts() -> None:
    with pytest.raises(ConfigError, match="band_partitions"):
        BandRouter(CONFIG, band_partitions=0, home_partitions=1)


def test_a_restart_resumes_from_the_stores_and_a_redelivery_changes_nothing() -> None:
    summaries = traffic(11)
    want = sequential(summaries)
    stores: dict[str, dict[str, Any]] = {"band": {}, "home": {}}
    by_capture = {c: sorted(summaries[c::3], key=order_key) for c in range(3)}
    got: dict[str, dict[str, Any]] = {}

    def deliver(stage: InProcessBands, part: dict[int, list[dict[str, Any]]]) -> None:
        for c, own in part.items():
            for s in own:
                stage.summary(c, s)
                stage.mark(c, int(s["end_ms"]))
        for d in stage.run():
            assert got.setdefault(d["iid"], d) == d, "a repeated decision differs"

    first = InProcessBands(split_config=SPLITS, dedup_config=CONFIG, capture_partitions=3,
                           band_partitions=5, home_partitions=3, stores=stores,
                           rng=np.random.default_rng(1))
    deliver(first, {c: own[: len(own) // 2] for c, own in by_capture.items()})
    assert 0 < len(got) < len(summaries)
    again = InProcessBands(split_config=SPLITS, dedup_config=CONFIG, capture_partitions=3,
                           band_partitions=5, home_partitions=3, stores=stores,
                           rng=np.random.default_rng(2))  # a new worker: nothing in memory
    # the last few records before the restart are read again (offsets not committed)
    deliver(again, {c: own[len(own) // 2 - 3:] for c, own in by_capture.items()})
    for c in range(3):
        again.mark(c, None)
    for d in again.run():
        assert got.setdefault(d["iid"], d) == d
    assert got == want


def test_state_past_the_horizon_is_forgotten() -> None:
    config = DedupConfig(horizon_ms=1_000, bucket_ms=100)
    stage = InProcessBands(split_config=SPLITS, dedup_config=config, capture_partitions=1,
                           band_partitions=3, home_partitions=2)
    base = tokens(5)
    for i in range(40):  # one near copy every 200 ms: each only matches recent ones
        s = summary(f"g{i}", f"o{i}", "t", near_copy(base, 2, i), 200 * i + 20)
        stage.summary(0, s)
        stage.mark(0, int(s["end_ms"]))
    stage.mark(0, None)
    decisions = stage.run()
    assert len(decisions) == 40
    band_probes = sum(len(b) for b in stage.bands)
    assert band_probes <= 3 * 8, band_probes  # about horizon / spacing, not 40 per band
    home = stage.homes[0].store
    assert sum(k.startswith(("d\x1f", "k\x1f")) for k in home) <= 2 * 2 * 8
    # forgotten threads no longer drop a copy: more than one of the copies is kept
    assert sum(d["keep"] for d in decisions) > 1


def test_band_and_home_state_is_an_owners_sealed_data() -> None:
    from hebrus_flywheel.streams.processors.state_seal import owner_of_key
    stage = InProcessBands(split_config=SPLITS, dedup_config=CONFIG, capture_partitions=1,
                           band_partitions=2, home_partitions=2)
    for i, toks in enumerate([tokens(1), tokens(1), tokens(2)]):
        stage.summary(0, summary(f"own{i}\x1fthr\x1f0", f"own{i}", "thr", toks, 1_000 + i))
    stage.mark(0, None)
    stage.run()
    keys = [k for b in stage.bands for k in b.store] + list(stage.homes[0].store)
    owned = [k for k in keys if k[0] in "pdqguk"]
    assert owned and all(owner_of_key(k) in {"own0", "own1", "own2"} for k in owned)
    assert all(owner_of_key(k) is None for k in keys if k[0] in "mnx")


def test_a_band_partitioned_worker_reads_the_band_and_home_topics() -> None:
    from hebrus_flywheel.streams.processors.liveness import input_topics
    from hebrus_flywheel.streams.processors.topology import StreamTopics, internal_specs
    topics = StreamTopics.from_prefix("t.")
    banded = input_topics(topics, dedup_bands=True)
    assert topics.homes in banded and topics.bands in banded and topics.threads not in banded
    assert topics.threads in input_topics(topics) and topics.homes not in input_topics(topics)
    specs = {s.name: s.partitions for s in internal_specs(topics, 6, dedup_bands=True)}
    assert specs[topics.homes] == specs[topics.bands] == 6
    assert topics.homes not in {s.name for s in internal_specs(topics, 6)}


@pytest.mark.parametrize("homes", [1, 3])
def test_a_match_whose_summary_never_reaches_its_home_holds_nothing_back(homes: int) -> None:
    """Y's probes reached the band partitions, but its summary did not reach its home
    (its owner was erased first): X, a copy of Y, is decided as if Y had never been."""
    toks = tokens(4)
    y = summary("y", "oy", "t", toks, 1_000)
    x = summary("x", "ox", "t", toks, 1_001)
    stage = InProcessBands(split_config=SPLITS, dedup_config=CONFIG, capture_partitions=1,
                           band_partitions=3, home_partitions=homes)
    for band, probe in stage.router.probes(y).items():
        stage._send(("capture", 0), ("band", band), "probe", probe)
    stage.mark(0, 1_000)
    stage.summary(0, x)
    stage.mark(0, None)
    decisions = stage.run()
    assert [(d["iid"], d["keep"], d["reason"]) for d in decisions] == [("x", True, "unique")]
    assert sum(h.counters.get("dedup", "absent_candidates") for h in stage.homes) == 1
    assert sequential([x])["x"] == decisions[0]
