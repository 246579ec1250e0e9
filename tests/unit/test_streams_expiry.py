"""Bounded state: every processor table key expires, through the time-bucketed schedule.

The capture stage closes idle generations and deletes finished headers and idle
producer counters from its scheduled buckets only (never a scan of the table); the
dedup index forgets decisions older than its horizon (a duplicate older than that is no
longer caught); teachers sharing topics are assembled and deduplicated apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors import expiry
from hebrus_flywheel.streams.processors.assemble import AssembleConfig
from hebrus_flywheel.streams.processors.dedup import DedupConfig
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from hebrus_flywheel.streams.processors.split import SplitConfig
from tests.support.streams_synthetic import Scenario, ThreadSpec, make_identity

HOUR = 3_600_000


class NoScan(dict[str, Any]):
    """A store that fails a test which iterates over it (a full-table scan)."""

    def items(self) -> Any:
        raise AssertionError("the whole table was scanned")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("the whole table was scanned")


def test_schedule_and_sweep_delete_due_keys_and_move_touched_ones() -> None:
    store: dict[str, Any] = {"a": 1, "b": 2}
    for key, due in (("a", 1_500), ("b", 2_500)):
        expiry.schedule(store, key, partition=3, due_ms=due, bucket_ms=1_000)
    expiry.schedule(store, "a", partition=3, due_ms=1_500, bucket_ms=1_000)  # once
    assert store[expiry.bucket_key(3, 1)] == ["a"]
    seen: list[str] = []

    def decide(key: str, now_ms: int) -> int | None:
        seen.append(key)
        if key == "b":
            return 5_000  # touched since: falls due later
        del store[key]
        return None

    assert expiry.sweep(store, partition=3, now_ms=1_999, bucket_ms=1_000, decide=decide) == 0
    assert expiry.sweep(store, partition=3, now_ms=3_000, bucket_ms=1_000, decide=decide) == 2
    assert seen == ["a", "b"] and "a" not in store and store["b"] == 2
    assert store[expiry.bucket_key(3, 5)] == ["b"]
    assert expiry.bucket_key(3, 1) not in store and expiry.bucket_key(3, 2) not in store
    assert expiry.sweep(store, partition=3, now_ms=5_500, bucket_ms=1_000, decide=decide) == 0
    assert expiry.sweep(store, partition=3, now_ms=6_000, bucket_ms=1_000, decide=decide) == 1


def _sweep_all(store: dict[str, Any], partition: int, now_ms: int) -> list[str]:
    seen: list[str] = []

    def decide(key: str, _: int) -> int | None:
        seen.append(key)
        return None

    expiry.sweep(store, partition=partition, now_ms=now_ms, bucket_ms=1_000, decide=decide)
    return seen


def test_a_crowded_bucket_moves_its_keys_to_chunks_and_no_value_outgrows_one() -> None:
    store: dict[str, Any] = {}
    keys = [f"d|{i:05d}" for i in range(3 * expiry.CHUNK_KEYS + 10)]
    for key in keys:
        expiry.schedule(store, key, partition=0, due_ms=1_200, bucket_ms=1_000)
    expiry.schedule(store, keys[-1], partition=0, due_ms=1_700, bucket_ms=1_000)  # once
    assert store[expiry.chunk_count_key(0, 1)] == 3
    lists = [v for v in store.values() if isinstance(v, list)]
    assert max(len(v) for v in lists) == expiry.CHUNK_KEYS
    assert sorted(k for v in lists for k in v) == keys
    assert _sweep_all(store, 0, now_ms=2_000) == keys  # each once, in one order
    assert store == {expiry.cursor_key(0): 2}  # every bucket and chunk key tombstoned


def test_a_bucket_written_as_one_long_list_is_read_and_chunked_as_is() -> None:
    legacy = [f"s|{i:05d}" for i in range(expiry.CHUNK_KEYS + 40)]  # before chunking
    store: dict[str, Any] = {expiry.bucket_key(2, 7): list(legacy), expiry.cursor_key(2): 7}
    expiry.schedule(store, "s|new", partition=2, due_ms=7_100, bucket_ms=1_000)
    assert store[expiry.chunk_key(2, 7, 0)] == legacy
    assert store[expiry.bucket_key(2, 7)] == ["s|new"]
    assert _sweep_all(store, 2, now_ms=8_000) == sorted([*legacy, "s|new"])
    legacy_only: dict[str, Any] = {expiry.bucket_key(2, 7): list(legacy),
                                   expiry.cursor_key(2): 7}
    assert _sweep_all(legacy_only, 2, now_ms=8_000) == legacy


def _assembly(**fields: Any) -> AssembleConfig:
    return AssembleConfig(idle_timeout_ms=1_000, finished_ttl_ms=10_000, counter_ttl_ms=20_000,
                          expiry_bucket_ms=500, **fields)


def _pipeline(assemble: AssembleConfig, dedup: DedupConfig | None = None) -> LocalPipeline:
    pipeline = LocalPipeline(ProcessorConfig(assemble=assemble, dedup=dedup or DedupConfig()))
    pipeline.capture_store = NoScan()
    pipeline.reconfigure(pipeline.config)
    return pipeline


def _expired(pipeline: LocalPipeline) -> dict[str, int]:
    return {k.split("/", 1)[1]: v for k, v in pipeline.counters.as_dict().items()
            if k.startswith("expiry/")}


def _kinds(store: dict[str, Any]) -> set[str]:
    return {key[0] for key in store.keys()}  # noqa: SIM118 - NoScan forbids iteration


def test_finished_headers_and_idle_counters_expire_without_a_table_scan() -> None:
    sc = Scenario(_pipeline(_assembly()))
    sc.publish_identity()
    sc.send_thread(ThreadSpec(owner="o", thread="t"), now_ms=1_000)
    pipeline = sc.pipeline
    assert len(pipeline.windows) == 1 and pipeline.quarantined == []
    store = pipeline.capture_store
    assert _kinds(store) == {"h", "c", "x"}  # the finished header, counters, schedule
    partitions = range(4)
    for now in (2_000, 5_000, 10_000):
        for p in partitions:
            pipeline.tick(p, now)
    assert "h" in _kinds(store)  # kept for redelivery for finished_ttl_ms
    for p in partitions:
        pipeline.tick(p, 12_000)
    assert _kinds(store) == {"c", "x"}
    assert _expired(pipeline) == {"headers_emitted": 1}
    for p in partitions:
        pipeline.tick(p, 22_000)
    assert _kinds(store) <= {"x"}  # the counters went; what is left is the cursors
    assert all(key.endswith("cursor") for key in store.keys())  # noqa: SIM118
    assert _expired(pipeline) == {"headers_emitted": 1, "producer_counters": 2}


def test_an_idle_generation_closes_on_the_tick_that_finds_it_due() -> None:
    sc = Scenario(_pipeline(_assembly()))
    sc.publish_identity()
    messages = sc.messages(ThreadSpec(owner="o", thread="t", closes=False))
    for m in messages:
        sc.send(*m, now_ms=1_000)
    partition = sc.feeder.place("transcripts", messages[0][1])[0]
    sc.pipeline.tick(partition, 1_900)  # idle for 900 ms of 1000
    assert sc.pipeline.decisions == []
    sc.pipeline.tick((partition + 1) % 4, 2_600)  # another partition's schedule
    assert sc.pipeline.decisions == []
    sc.pipeline.tick(partition, 2_600)
    assert len(sc.pipeline.decisions) == 1 and len(sc.pipeline.windows) == 1


def _same_thread_later(sc: Scenario, start_ms: int) -> None:
    sc.send_thread(ThreadSpec(owner="o", thread=f"t{start_ms}", seed=7, start_ms=start_ms))


def test_a_duplicate_within_the_horizon_is_dropped_and_one_beyond_it_is_kept() -> None:
    dedup = DedupConfig(horizon_ms=2 * HOUR, bucket_ms=HOUR // 4)
    # One split for every thread: owner and thread ids are pseudonyms under the session's
    # key store, so with the default draws the two copies could land in different splits
    # (about one session in ten), and a cross-split pair gets its cross-split reason.
    one_split = SplitConfig(validation_fraction=0.0, stress_rate=0.0,
                            runtime_holdout_fraction=0.0)
    sc = Scenario(LocalPipeline(ProcessorConfig(dedup=dedup, split=one_split)))
    sc.publish_identity()
    base = 1_767_225_600_000
    _same_thread_later(sc, base)
    _same_thread_later(sc, base + HOUR)
    _same_thread_later(sc, base + 4 * HOUR)
    reasons = [d["reason"] for d in sc.pipeline.decisions]
    assert reasons == ["unique", "exact_duplicate", "unique"]
    decisions = [k for k in sc.pipeline.dedup_store if k.startswith("d")]
    assert len(decisions) == 1  # the first two left the horizon (tombstoned)
    assert _expired(sc.pipeline)["dedup_decisions"] == 2


def test_dedup_state_stays_bounded_over_many_threads() -> None:
    dedup = DedupConfig(horizon_ms=HOUR, bucket_ms=HOUR // 6)
    sc = Scenario(LocalPipeline(ProcessorConfig(dedup=dedup)))
    sc.publish_identity()
    base = 1_767_225_600_000
    sizes = []
    for i in range(40):
        sc.send_thread(ThreadSpec(owner=f"o{i}", thread="t", seed=i,
                                  start_ms=base + i * HOUR // 4))
        sizes.append(len(sc.pipeline.dedup_store))
    assert len(sc.pipeline.decisions) == 40
    assert max(sizes[20:]) == max(sizes[10:20])  # flat once the horizon is full
    assert sc.pipeline.dedup.index(sc.identity["identity_id"]).__len__() <= 6


def test_two_teachers_on_the_same_topics_are_assembled_and_deduplicated_apart() -> None:
    pipeline = LocalPipeline()
    first = Scenario(pipeline)
    second = Scenario(pipeline, identity=make_identity(layers=4, experts=32, top_k=2))
    second.feeder, second.clock = first.feeder, first.clock  # one set of topics
    assert first.identity["identity_id"] != second.identity["identity_id"]
    first.publish_identity()
    second.publish_identity()
    spec = ThreadSpec(owner="o", thread="t", seed=3)
    first.send_thread(spec)
    second.send_thread(spec)
    assert pipeline.quarantined == []
    assert [(d["keep"], d["reason"]) for d in pipeline.decisions] == [(True, "unique")] * 2
    assert {w["identity_id"] for w in pipeline.windows} == {
        first.identity["identity_id"], second.identity["identity_id"]}
    assert len({d["split"] for d in pipeline.decisions}) == 1  # one thread, one split
    first.send_thread(ThreadSpec(owner="o2", thread="t2", seed=3))
    copy, original = pipeline.decisions[-1], pipeline.decisions[0]
    # The session's pseudonym key decides the splits: a train copy of an evaluation
    # thread is dropped as a leak, any other copy as an exact duplicate.
    leak = copy["split"] == "train" and original["split"] != "train"
    expected = "near_duplicate_of_evaluation" if leak else "exact_duplicate"
    assert (copy["keep"], copy["reason"]) == (False, expected)  # within one teacher


@pytest.mark.parametrize("field", ["finished_ttl_ms", "counter_ttl_ms", "expiry_bucket_ms"])
def test_assemble_expiry_fields_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        AssembleConfig(**{field: 0})


@pytest.mark.parametrize("field", ["horizon_ms", "bucket_ms"])
def test_dedup_horizon_fields_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DedupConfig(**{field: 0})
