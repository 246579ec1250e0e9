"""Assemble stage: canonical histories from interleaved records, completion, redelivery."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors import assemble
from hebrus_flywheel.streams.processors.assemble import AssembleConfig
from hebrus_flywheel.streams.processors.common import (
    ranges_add,
    ranges_contains,
    ranges_covers,
    ranges_minus,
    turn_key,
)
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from tests.support.sealing import thread_key
from tests.support.streams_synthetic import (
    Feeder,
    ProducerClock,
    Scenario,
    ThreadSpec,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)


def window_set(pipeline: LocalPipeline) -> set[tuple[str, str]]:
    return {(w["window_id"], w["content_digest"]) for w in pipeline.windows}


def interleave(streams: list[list[Any]], seed: int) -> list[Any]:
    """Random merge that keeps each stream's own order."""
    rng = random.Random(seed)
    queues = [list(s) for s in streams if s]
    out = []
    while queues:
        q = rng.choice(queues)
        out.append(q.pop(0))
        if not q:
            queues.remove(q)
    return out


def encoded_run(specs: list[ThreadSpec], identity: dict[str, Any]) -> list[Any]:
    clock = ProducerClock()
    feeder = Feeder()
    messages = [identity_message(identity)]
    for s in specs:
        messages.extend(thread_messages(s, identity, clock))
    return feeder.encoded(messages)


def test_ranges_helpers() -> None:
    r = ranges_add([], 5, 7)
    r = ranges_add(r, 0, 2)
    r = ranges_add(r, 2, 5)
    assert r == [[0, 7]]
    assert ranges_contains(r, 6) and not ranges_contains(r, 7)
    assert ranges_covers(r, [[1, 3], [4, 7]]) and not ranges_covers(r, [[6, 8]])


def test_ranges_minus_matches_the_ordinal_sets() -> None:
    rng = random.Random(7)

    def random_ranges() -> list[list[int]]:
        out: list[list[int]] = []
        for _ in range(rng.randint(0, 6)):
            start = rng.randint(0, 60)
            out = ranges_add(out, start, start + rng.randint(1, 12))
        return out

    for _ in range(500):
        kept, removed = random_ranges(), random_ranges()
        ordinals = {o for lo, hi in kept for o in range(lo, hi)}
        ordinals -= {o for lo, hi in removed for o in range(lo, hi)}
        got = ranges_minus(kept, removed)
        assert [o for lo, hi in got for o in range(lo, hi)] == sorted(ordinals)
        assert all(lo < hi for lo, hi in got)


def test_interleaving_across_threads_gives_the_same_windows() -> None:
    identity = make_identity(layers=4, experts=64, top_k=4)
    messages = encoded_run(random_specs(12, seed=3), identity)
    baseline = LocalPipeline()
    baseline.feed_all(messages)
    per_partition: dict[tuple[str, int], list[Any]] = {}
    for m in messages[1:]:
        per_partition.setdefault((m[0], m[1]), []).append(m)
    for seed in range(3):
        shuffled = LocalPipeline()
        shuffled.feed_all([messages[0], *interleave(list(per_partition.values()), seed)])
        assert window_set(shuffled) == window_set(baseline)
        assert shuffled.quarantined == []
    assert len(baseline.windows) >= 12


def test_turn_before_its_observations_still_completes() -> None:
    sc = Scenario(LocalPipeline())
    sc.publish_identity()
    messages = sc.messages(ThreadSpec(owner="o", thread="t"))
    turns = [m for m in messages if m[0] == "transcripts"]
    obs = [m for m in messages if m[0] == "observations"]
    for m in turns + obs:
        sc.send(*m)
    assert sc.pipeline.quarantined == []
    assert len(sc.pipeline.windows) == 1
    assert sc.pipeline.capture_store  # only headers, counters and their expiry schedule
    assert all(k[0] in "hcx" for k in sc.pipeline.capture_store)


def test_end_marker_waits_for_missing_routes_until_idle() -> None:
    sc = Scenario(LocalPipeline(ProcessorConfig(assemble=AssembleConfig(idle_timeout_ms=100))))
    sc.publish_identity()
    messages = sc.messages(ThreadSpec(owner="o", thread="t"))
    for m in messages[:3] + messages[4:]:
        sc.send(*m, now_ms=0)
    assert sc.pipeline.decisions == []
    sc.pipeline.tick(partition=sc.feeder.place("transcripts", thread_key("o", "t"))[0], now_ms=1000)
    assert len(sc.pipeline.decisions) == 1
    assert sc.pipeline.counters.get("assemble", "completed_idle") == 1
    summary_routes = sc.pipeline.decisions[0]
    assert summary_routes["keep"]


def test_thread_without_end_marker_completes_on_idle() -> None:
    config = ProcessorConfig(assemble=AssembleConfig(idle_timeout_ms=100))
    sc = Scenario(LocalPipeline(config))
    sc.publish_identity()
    sc.send_thread(ThreadSpec(owner="o", thread="t", closes=False), now_ms=0)
    assert sc.pipeline.windows == []
    partition = sc.feeder.place("transcripts", thread_key("o", "t"))[0]
    sc.pipeline.tick(partition=(partition + 1) % 4, now_ms=1000)
    assert sc.pipeline.windows == []
    sc.pipeline.tick(partition=partition, now_ms=1000)
    assert len(sc.pipeline.windows) == 1


def test_redelivery_is_idempotent() -> None:
    identity = make_identity(layers=4, experts=64, top_k=4)
    messages = encoded_run(random_specs(6, seed=5), identity)
    clean = LocalPipeline()
    clean.feed_all(messages)
    replayed = LocalPipeline()
    rng = random.Random(1)
    i = 0
    while i < len(messages):
        j = min(len(messages), i + rng.randint(1, 30))
        replayed.feed_all(messages[i:j])
        back = rng.randint(0, j - i)
        replayed.feed_all(messages[j - back : j])  # redeliver a suffix, as after a crash
        i = j
    assert replayed.quarantined == []
    assert window_set(replayed) == window_set(clean)
    assert replayed.counters.get("assemble", "redelivered") > 0


def test_redelivered_refusal_gets_the_same_verdict() -> None:
    sc = Scenario(LocalPipeline())
    sc.publish_identity()
    messages = [m for m in sc.messages(ThreadSpec(owner="o", thread="t")) if m[0] == "observations"]
    kind, key, later = messages[1]
    earlier = copy.deepcopy(messages[0][2])
    sc.send(kind, key, later)
    part, _ = sc.feeder.place(kind, key)
    from tests.support.streams_synthetic import encode_message

    value, _ = encode_message(kind, earlier)
    sc.pipeline.feed(kind, part, 1, key, value)
    sc.pipeline.feed(kind, part, 1, key, value)
    assert [q["reason"] for q in sc.pipeline.quarantined] == ["counter_regression"] * 2
    ids = {q["quarantine_id"] for q in sc.pipeline.quarantined}
    assert len(ids) == 1


def test_rejected_speculative_routes_never_enter_the_history() -> None:
    sc = Scenario(LocalPipeline())
    sc.publish_identity()
    messages = sc.messages(ThreadSpec(owner="o", thread="t"))
    spec_obs = copy.deepcopy(next(m for m in messages if m[0] == "observations"))
    spec_obs[2]["speculative"] = {
        "proposal_id": "p",
        "proposal_generation": 1,
        "candidate_position": 0,
        "accepted_prefix_digest": "d",
        "verifier_generation": 1,
        "accepted": False,
    }
    spec_obs[2]["token_id"] = 999
    sc.send(*spec_obs)
    for m in messages:
        sc.send(*m)
    assert sc.pipeline.quarantined == []
    assert sc.pipeline.counters.get("assemble", "speculative_rejected_skipped") == 1
    assert len(sc.pipeline.windows) == 1


def test_generations_are_assembled_separately() -> None:
    sc = Scenario(LocalPipeline())
    sc.publish_identity()
    sc.send_thread(ThreadSpec(owner="o", thread="t", generation=0, seed=1))
    sc.send_thread(ThreadSpec(owner="o", thread="t", generation=1, seed=2))
    assert sc.pipeline.quarantined == []
    assert {d["generation"] for d in sc.pipeline.decisions} == {0, 1}
    assert len({d["split"] for d in sc.pipeline.decisions}) == 1


def test_assemble_config_validation() -> None:
    with pytest.raises(ConfigError, match="idle_timeout_ms"):
        AssembleConfig(idle_timeout_ms=0)


def test_stale_decision_never_drops_an_open_thread() -> None:
    sc = Scenario(LocalPipeline())
    sc.publish_identity()
    messages = sc.messages(ThreadSpec(owner="o", thread="t"))
    for m in messages[:-1]:
        sc.send(*m)
    iid = "o\x1ft\x1f0"
    stale = {"iid": iid, "keep": True, "split": "train"}
    sc.pipeline.window.finish(stale)
    assert sc.pipeline.counters.get("window", "stale_decision") == 1
    sc.send(*messages[-1])
    assert sc.pipeline.quarantined == []
    assert len(sc.pipeline.windows) == 1


def test_only_the_completing_record_repeats_the_summary_and_ticks_repeat_it_later() -> None:
    config = ProcessorConfig(assemble=AssembleConfig(idle_timeout_ms=1000))
    sc = Scenario(LocalPipeline(config))
    sc.publish_identity()
    stage = sc.pipeline.capture
    feeder = Feeder()
    encoded = feeder.encoded(sc.messages(ThreadSpec(owner="o", thread="t")))
    emitted = []
    for kind, part, offset, key, value in encoded:
        emitted += stage.process(
            topic=stage.topics[kind], partition=part, offset=offset, key=key, value=value, now_ms=0
        )
    assert [e.kind for e in emitted] == ["summary"]  # no decision arrives: stays ready
    again = []
    for kind, part, offset, key, value in encoded:
        again += stage.process(
            topic=stage.topics[kind], partition=part, offset=offset, key=key, value=value, now_ms=10
        )
    assert again == emitted  # only the completing record repeated it, identically
    partition = encoded[-1][1]
    assert stage.tick(partition, now_ms=500) == []
    assert stage.tick(partition, now_ms=5000) == emitted
    assert stage.tick(partition, now_ms=5500) == []
    # each repeat doubles the wait for the next: 2 s after the first, then 4 s
    assert stage.tick(partition, now_ms=6500) == []
    assert stage.tick(partition, now_ms=8000) == emitted
    assert stage.tick(partition, now_ms=11_000) == []
    assert stage.tick(partition, now_ms=13_000) == emitted
    assert sc.pipeline.counters.get("assemble", "summaries_repeated") == 3


def _open_generation(sc: Scenario) -> tuple[list[Any], list[Any]]:
    """A thread's records split in two: all but its last transcript turn, then the rest."""
    messages = sc.messages(ThreadSpec(owner="o", thread="t"))
    last_turn = max(i for i, m in enumerate(messages) if m[0] == "transcripts")
    return messages[:last_turn], messages[last_turn:]


def _one_thread_windows() -> set[tuple[str, str]]:
    """The windows of the thread :func:`_open_generation` splits, sent whole."""
    baseline = Scenario(LocalPipeline())
    baseline.publish_identity()
    baseline.send_thread(ThreadSpec(owner="o", thread="t"))
    return window_set(baseline.pipeline)


def test_turns_live_in_the_header_not_under_keys_of_their_own() -> None:
    sc = Scenario(LocalPipeline())
    sc.publish_identity()
    first, rest = _open_generation(sc)
    for m in first:
        sc.send(*m)
    store = sc.pipeline.capture_store
    (header,) = [v for k, v in store.items() if k[0] == "h"]
    assert header["turn_values"] and not any(k[0] == "t" for k in store)
    assert sorted(header["turn_values"]) == list(range(len(header["turn_values"])))
    for m in rest:
        sc.send(*m)
    (header,) = [v for k, v in store.items() if k[0] == "h"]
    assert len(sc.pipeline.windows) == 1  # dropped when done; which turns it held stays
    assert header["turn_values"] and set(header["turn_values"].values()) == {None}


def test_a_header_holds_at_most_its_token_budget_the_rest_goes_under_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _one_thread_windows()  # with the default budget
    sc = Scenario(LocalPipeline())
    sc.publish_identity()
    messages = sc.messages(ThreadSpec(owner="o", thread="t"))
    first_turn = next(m for m in messages if m[0] == "transcripts")
    sc.send(*first_turn)
    (header,) = [v for k, v in sc.pipeline.capture_store.items() if k[0] == "h"]
    budget = sum(len(t["token_ids"]) for t in header["turn_values"].values())
    monkeypatch.setattr(assemble, "HELD_TOKENS_MAX", budget)  # the first turn, no more
    last_obs = max(i for i, m in enumerate(messages) if m[0] == "observations")
    for i, m in enumerate(messages):
        if m is not first_turn and i != last_obs:
            sc.send(*m)  # every turn arrived; the generation waits for its last route
    store = sc.pipeline.capture_store
    (header,) = [v for k, v in store.items() if k[0] == "h"]
    assert list(header["turn_values"]) == [0] and [k for k in store if k[0] == "t"]
    sc.send(*messages[last_obs])
    assert window_set(sc.pipeline) == expected and window_set(sc.pipeline)
    assert not any(k[0] in "to" for k in store)


def test_a_generation_begun_with_turn_keys_still_completes_and_drops_them() -> None:
    """A header restored from a worker before ``turn_values`` (turns under ``t`` keys)."""
    sc = Scenario(LocalPipeline())
    sc.publish_identity()
    first, rest = _open_generation(sc)
    for m in first:
        sc.send(*m)
    store = sc.pipeline.capture_store
    (hkey,) = [k for k in store if k[0] == "h"]
    header = dict(store[hkey])
    for index, turn in header.pop("turn_values").items():
        store[turn_key(hkey[2:], index)] = turn
    store[hkey] = header
    for m in rest:
        sc.send(*m)
    assert window_set(sc.pipeline) == _one_thread_windows() and window_set(sc.pipeline)
    assert not any(k[0] in "to" for k in store) and "turn_values" not in store[hkey]
