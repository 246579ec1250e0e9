"""Event-time decision order: the same dedup decisions whatever the arrival order."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.decision_order import (
    HOLD_MS,
    MARK_PREFIX,
    PENDING_PREFIX,
    DecisionOrder,
    EventClocks,
    MarkPolicy,
    decision_sequence,
    order_key,
)
from hebrus_flywheel.streams.processors.dedup import DedupConfig, DedupStage
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline
from hebrus_flywheel.streams.processors.split import SplitConfig
from tests.support.streams_synthetic import (
    Feeder,
    ProducerClock,
    ThreadSpec,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)
from tests.unit.test_streams_dedup import near_copy, summary, tokens

SPLIT = SplitConfig(runtime_holdout_fraction=0.0, stress_rate=0.0)


def new_order(store: dict[str, Any] | None = None, partitions: int = 3) -> DecisionOrder:
    stage = DedupStage(split_config=SPLIT, dedup_config=DedupConfig(),
                       store={} if store is None else store)
    return DecisionOrder(stage, partitions=partitions)


def summaries(n: int = 24) -> list[dict[str, Any]]:
    """``n`` summaries over three partitions, ends one second apart; every third is an
    exact copy of the one before it, every fifth a near copy, each on another partition."""
    out: list[dict[str, Any]] = []
    base = [tokens(seed) for seed in range(n)]
    for i in range(n):
        toks = base[i]
        if i % 3 == 2:
            toks = list(base[i - 1])
        elif i % 5 == 4:
            toks = near_copy(base[i - 1], 3, seed=i)
        base[i] = toks
        s = summary(f"o{i:02d}\x1ft\x1f0", f"o{i:02d}", toks, thread="t")
        out.append({**s, "partition": i % 3, "end_ms": 1_000 * i})
    return out


def arrive_interleaved(order: DecisionOrder, items: list[dict[str, Any]],
                       seed: int) -> dict[str, tuple[bool, str]]:
    """Each partition's summaries in end order, its mark after each; partitions
    interleaved at random; every partition caught up at the end."""
    queues: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in sorted(items, key=order_key):
        queues[s["partition"]].append(s)
    rng = random.Random(seed)
    decided: list[dict[str, Any]] = []
    while any(queues.values()):
        partition = rng.choice([p for p, q in queues.items() if q])
        s = queues[partition].pop(0)
        decided += order.arrive(s)
        decided += order.mark(partition, s["end_ms"])
    for partition in range(order.partitions):
        decided += order.mark(partition, None)
    assert order.pending() == 0
    return {d["iid"]: (d["keep"], d["reason"]) for d in decided}


def test_decisions_do_not_depend_on_the_interleaving() -> None:
    items = summaries()
    reference = new_order()
    expected = {s["iid"]: (d["keep"], d["reason"])
                for s in sorted(items, key=order_key)
                for d in [reference.stage.process(s)]}
    assert sum(not keep for keep, _ in expected.values()) >= 8  # pairs to decide
    for seed in range(12):
        assert arrive_interleaved(new_order(), items, seed) == expected


def test_arrival_order_alone_does_decide_differently() -> None:
    """The control: fed as they arrive, the same interleavings keep different members."""
    items = summaries()
    outcomes = set()
    for seed in range(12):
        rng, stage = random.Random(seed), new_order().stage
        queues: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for s in sorted(items, key=order_key):
            queues[s["partition"]].append(s)
        kept = []
        while any(queues.values()):
            s = queues[rng.choice([p for p, q in queues.items() if q])].pop(0)
            kept += [s["iid"]] if stage.process(s)["keep"] else []
        outcomes.add(tuple(sorted(kept)))
    assert len(outcomes) > 1


def test_nothing_is_decided_until_every_partition_has_a_mark() -> None:
    order = new_order(partitions=2)
    first = summaries(2)[0]
    assert order.arrive(first) == []
    assert order.mark(0, 5_000) == []  # partition 1 has said nothing yet
    assert order.pending() == 1
    decided = order.mark(1, 1)  # its mark passes the summary's end (0)
    assert [d["iid"] for d in decided] == [first["iid"]]


def test_equal_ends_wait_until_the_mark_is_past_them() -> None:
    order = new_order(partitions=1)
    s = {**summaries(1)[0], "end_ms": 7}
    order.arrive(s)
    assert order.mark(0, 7) == []  # another summary of the partition may still end at 7
    assert len(order.mark(0, 8)) == 1


def test_a_summary_below_the_watermark_is_decided_on_arrival_and_counted_late() -> None:
    order = new_order(partitions=1)
    a, b = summaries(2)
    order.mark(0, 10_000)
    assert [d["iid"] for d in order.arrive(b)] == [b["iid"]]  # end 1000 < 10000: at once
    assert order.stage.counters.get("dedup", "late_summaries") == 0
    assert [d["iid"] for d in order.arrive(a)] == [a["iid"]]  # end 0, after end 1000
    assert order.stage.counters.get("dedup", "late_summaries") == 1


def test_repeated_summaries_wait_once_and_get_their_decision_again() -> None:
    order = new_order(partitions=1)
    s = summaries(1)[0]
    assert order.arrive(s) == [] and order.arrive(s) == []
    assert order.pending() == 1
    (decision,) = order.mark(0, None)
    assert order.arrive(s) == [decision]
    assert order.stage.counters.get("dedup", "repeated_summaries") == 2


def test_a_restarted_order_resumes_from_its_store() -> None:
    store: dict[str, Any] = {}
    items = summaries(6)
    first = new_order(store)
    for s in items:
        first.arrive(s)
    first.mark(0, 2_500)
    first.mark(1, 2_500)
    assert sum(k.startswith(PENDING_PREFIX) for k in store) == 6  # partition 2: no mark
    again = new_order(store)  # a restarted worker: its table restored, nothing in memory
    decided = again.mark(2, None)
    assert [d["iid"] for d in decided] == [s["iid"] for s in items[:3]]
    assert not any(k.startswith(PENDING_PREFIX) for k in store if k.endswith("00\x1ft\x1f0"))


def test_a_mark_for_an_unknown_partition_is_refused() -> None:
    with pytest.raises(ConfigError, match="capture topics have 3"):
        new_order().mark(3, 0)
    with pytest.raises(ConfigError, match="partitions"):
        new_order(partitions=0)


def test_clocks_bound_by_the_slowest_topic_less_the_lateness() -> None:
    clocks = EventClocks()
    clocks.observe(0, "transcripts", {"wall_time_ms": 50_000})
    assert clocks.bound(0, 1_000) is None  # no observation read yet: no bound
    clocks.observe(0, "observations", {"wall_time_ms": 20_000})
    clocks.observe(0, "observations", {"wall_time_ms": 10_000})  # late: the clock stays
    clocks.observe(0, "identities", {"wall_time_ms": 90_000})  # completes nothing
    assert clocks.bound(0, 1_000) == 19_000
    assert clocks.bound(1, 1_000) is None


def test_summaries_carry_the_latest_wall_time_of_their_records() -> None:
    pipeline = LocalPipeline(event_order=4)
    feeder, identity = Feeder(), make_identity(layers=4, experts=64, top_k=4)
    spec = ThreadSpec(owner="a", thread="t", start_ms=1_000_000,
                      turns=(("user", 5), ("assistant", 8), ("user", 4)))
    messages = [identity_message(identity), *thread_messages(spec, identity, ProducerClock())]
    pipeline.feed_all(feeder.encoded(messages))
    assert pipeline.decisions == []  # three partitions never read: no mark, it waits
    (waiting,) = [v for k, v in pipeline.dedup_store.items() if k.startswith(PENDING_PREFIX)]
    assert waiting["summary"]["end_ms"] == waiting["end"] == 1_002_000  # the third turn
    pipeline.flush()
    assert [d["keep"] for d in pipeline.decisions] == [True]


def pipeline_windows(encoded: list[tuple[str, int, int, bytes, bytes]], seed: int, *,
                     event_order: bool, one_after_another: int = 0) -> set[str]:
    """The window ids of one interleaving: each topic partition's records in offset order,
    topic partitions merged at random (as fetches interleave them); with
    ``one_after_another`` 1 or -1, each topic partition read whole, in sorted or reverse
    order instead."""
    streams: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for message in encoded[1:]:
        streams[(message[0], message[1])].append(message)
    rng = random.Random(seed)
    pipeline = LocalPipeline(event_order=4 if event_order else None)
    pipeline.feed_all([encoded[0]])  # the identity first
    if one_after_another:
        for key in sorted(streams)[::one_after_another]:
            pipeline.feed_all(streams.pop(key))
    while any(streams.values()):
        stream = streams[rng.choice(sorted(k for k, v in streams.items() if v))]
        pipeline.feed_all([stream.pop(0)])
    pipeline.flush()
    return {w["window_id"] for w in pipeline.windows}


@pytest.fixture(scope="module")
def copied_capture() -> list[tuple[str, int, int, bytes, bytes]]:
    """40 threads, every fourth an exact copy of the one before it."""
    identity = make_identity(layers=4, experts=64, top_k=4)
    specs = random_specs(40, n_owners=40, seed=3, assistant_tokens=24)
    for j in range(1, 40, 4):
        specs[j] = ThreadSpec(**{**specs[j - 1].__dict__, "owner": specs[j].owner,
                                 "thread": specs[j].thread, "start_ms": specs[j].start_ms})
    clock = ProducerClock()
    messages = [identity_message(identity)]
    for spec in specs:
        messages.extend(thread_messages(spec, identity, clock))
    return Feeder().encoded(messages)


def test_pipeline_in_event_order_makes_the_same_windows_in_any_interleaving(
        copied_capture: list[tuple[str, int, int, bytes, bytes]]) -> None:
    runs = [pipeline_windows(copied_capture, seed, event_order=True) for seed in range(6)]
    assert runs[0] and all(run == runs[0] for run in runs)
    # the control: in arrival order, reading the topic partitions one after another,
    # then in the reverse order, completes a copied pair on two partitions the other way
    # round, so another member is kept (whatever partitions the owner pseudonyms get;
    # random interleavings could all agree, and once did)
    arrival = {frozenset(pipeline_windows(copied_capture, 0, event_order=False,
                                          one_after_another=way)) for way in (1, -1)}
    assert len(arrival) > 1


def test_pipeline_takes_one_order_only() -> None:
    with pytest.raises(ConfigError, match="not both"):
        LocalPipeline(release_order=["x"], event_order=4)


def test_order_key_falls_back_to_the_start() -> None:
    assert order_key({"iid": "a", "end_ms": 5, "start_ms": 1}) == (5, "a")
    assert order_key({"iid": "a", "end_ms": None, "start_ms": 1}) == (1, "a")
    assert order_key({"iid": "a"}) == (0, "a")


def test_decision_sequence_replays_the_order_of_a_topic() -> None:
    """What a rebuild replays from the threads topic: the agent's decisions, in order,
    a late summary and a repeat included."""
    items = summaries(12)
    order, topic, decided = new_order(), [], []

    def read(record: dict[str, Any]) -> None:
        topic.append(record)
        if "mark" in record:
            decided.extend(order.mark(record["mark"], record["at"]))
        else:
            decided.extend(order.arrive(record))

    rng = random.Random(5)
    for s in sorted(items[1:], key=order_key):
        read(s)
        read({"mark": s["partition"], "at": s["end_ms"] + rng.randrange(2_000)})
    read(items[1])  # a repeat
    read(items[0])  # late: its end is below every mark
    assert order.stage.counters.get("dedup", "late_summaries") == 1
    waiting = sorted((v["summary"] for k, v in order.store.items()
                      if k.startswith(PENDING_PREFIX)), key=order_key)
    assert waiting  # the last ones wait for marks past their ends
    first_decided = list(dict.fromkeys(d["iid"] for d in decided))  # the repeat: once
    assert len(first_decided) == len(decided) - 1
    assert decision_sequence(topic, 3) == first_decided + [s["iid"] for s in waiting]


def test_mark_policy_passes_a_backlog_at_once_and_live_records_after_a_grace() -> None:
    policy = MarkPolicy(grace_s=0.5, interval_s=0)
    assert policy.next_mark(0, caught_up=False, bound=None, now_s=0.0) == (False, HOLD_MS)
    assert policy.next_mark(0, caught_up=False, bound=100, now_s=0.1) == (True, 100)
    assert policy.next_mark(0, caught_up=False, bound=100, now_s=0.2) == (False, 100)
    # the backlog it started with is read: everything passes at once
    assert policy.next_mark(0, caught_up=True, bound=150, now_s=0.3) == (True, None)
    # live records: the bound holds while the partition is caught up for less than 0.5 s
    assert policy.next_mark(0, caught_up=False, bound=180, now_s=1.0) == (True, 180)
    assert policy.next_mark(0, caught_up=True, bound=200, now_s=1.1) == (True, 200)
    assert policy.due(1.5) == []
    assert policy.due(1.6) == [0]
    assert policy.next_mark(0, caught_up=True, bound=200, now_s=1.6) == (True, None)
    assert policy.due(2.0) == []  # passed: nothing held back
    # records read while it looked caught up all along: the grace starts again
    assert policy.next_mark(0, caught_up=True, bound=300, now_s=2.5, read=True) == (True, 300)
    assert policy.due(2.9) == [] and policy.due(3.0) == [0]
    policy.forget()  # a rebalance: the next caught-up check passes at once again
    assert policy.next_mark(0, caught_up=True, bound=200, now_s=2.1) == (True, None)
    with pytest.raises(ConfigError, match="grace_s"):
        MarkPolicy(grace_s=-1)


def test_mark_policy_holds_every_idle_partition_again_when_records_resume() -> None:
    policy = MarkPolicy(grace_s=0.5, interval_s=0)
    for partition in range(3):  # three empty partitions, caught up: everything passes
        assert policy.next_mark(partition, caught_up=True, bound=None, now_s=0.0) == (True, None)
    # the first batch of partition 5 here: its own bound first (the dedup stage may hold
    # a previous owner's mark); no partition that passed everything was read
    assert policy.resume({5}, lambda p: None) == [(5, HOLD_MS)]
    assert policy.resume({5}, lambda p: None) == []
    bounds = {0: None, 1: 40, 2: None}
    assert policy.resume({1}, bounds.get) == [(0, HOLD_MS), (1, 40), (2, HOLD_MS)]
    assert policy.resume({1}, bounds.get) == []  # already holding
    assert policy.due(10.0) == []  # none is caught up since: no grace runs
    assert policy.next_mark(0, caught_up=True, bound=None, now_s=10.0) == (False, HOLD_MS)
    assert policy.due(10.5) == [0]
    assert policy.next_mark(0, caught_up=True, bound=None, now_s=10.5) == (True, None)


def test_a_moving_bound_goes_out_at_most_once_per_interval() -> None:
    policy = MarkPolicy(grace_s=0.5, interval_s=0.2)
    assert policy.next_mark(0, caught_up=False, bound=100, now_s=0.0) == (True, 100)
    # a newer bound within the interval: the one sent still holds, nothing goes out
    assert policy.next_mark(0, caught_up=False, bound=110, now_s=0.1) == (False, 100)
    assert policy.next_mark(0, caught_up=False, bound=120, now_s=0.2) == (True, 120)
    # passing everything once caught up is never held back by the interval
    assert policy.next_mark(0, caught_up=True, bound=130, now_s=0.25) == (True, None)
    # nor is the first bound after a hold
    assert policy.next_mark(1, caught_up=False, bound=None, now_s=0.0) == (False, HOLD_MS)
    assert policy.resume({1}, lambda p: None) == [(1, HOLD_MS)]
    assert policy.next_mark(1, caught_up=False, bound=50, now_s=0.01) == (True, 50)
    with pytest.raises(ConfigError, match="interval_s"):
        MarkPolicy(grace_s=0.5, interval_s=-1)


def test_marks_are_read_from_the_store_once_and_kept_in_step_with_it() -> None:
    store: dict[str, Any] = {}
    order = new_order(store, partitions=2)
    order.mark(0, 100)
    assert order.watermark() == -float("inf")  # partition 1 has sent no mark yet
    order.mark(1, 200)
    assert store[MARK_PREFIX + "0"] == {"at": 100}
    assert order.watermark() == 100
    order.mark(0, None)
    assert order.watermark() == 200 and store[MARK_PREFIX + "0"] == {"at": None}
    # a restarted worker (a new order over the same store) reads the marks back
    assert new_order(store, partitions=2).watermark() == 200
    order.reset()
    store[MARK_PREFIX + "1"] = {"at": None}  # what a restore from the changelog leaves
    assert order.watermark() == float("inf")
