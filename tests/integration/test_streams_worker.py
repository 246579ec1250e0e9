"""The faust streams worker against the real broker: kill -9 restarts, two workers, leakage.

Each test gets its own uuid-prefixed copy of the topic catalogue and its own app id;
the expected windows come from the in-process pipeline over the same records.
"""

from __future__ import annotations

import copy
import itertools
import random
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.streams.processors.dedup import DedupConfig, minhash_of
from hebrus_flywheel.streams.processors.inspect import read_topic, summarize_topics
from hebrus_flywheel.streams.processors.runs import group_members
from hebrus_flywheel.streams.processors.split import SplitConfig, owner_split
from hebrus_flywheel.streams.routes import to_v1
from tests.support.sealing import owner_pseudonym
from tests.support.streams_harness import (
    WorkerProcess,
    expected_pipeline,
    grant_for,
    produce,
    producer,
    read_windows,
    wait_until,
    window_pairs,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    ThreadSpec,
    encode_message,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDENTITY = make_identity(layers=8, experts=64, top_k=4)
FLAGS = {"validation_fraction": 0.3, "runtime_holdout_fraction": 0.3, "stress_rate": 0.0}


class Setup:
    """Topics and app id of one test, all deleted at module teardown."""

    def __init__(self, topic_factory: Any, name: str) -> None:
        self.bootstrap = topic_factory.bootstrap
        self.app_id = "flywheel-streams"
        self.prefix, self.topics = topic_factory.streams_namespace(name, self.app_id)

    def worker(self, tmp_path: Path, tag: str, flags: dict[str, Any] = FLAGS,
               home: str = "home") -> WorkerProcess:
        """A worker on ``home``: a restart on the same one keeps its RocksDB tables; two
        running at once need two (as on two machines)."""
        return WorkerProcess(
            bootstrap=self.bootstrap,
            prefix=self.prefix,
            app_id=self.app_id,
            log_path=tmp_path / f"worker-{tag}.log",
            flags=flags,
            home=tmp_path / home,
        )

    def windows_reach(self, expected: set[tuple[str, str]]) -> Any:
        def done() -> bool:
            return window_pairs(read_windows(self.bootstrap, self.topics)) >= expected

        return done


def capture_messages(n_threads: int, seed: int, *, v1_every: int = 0,
                     raw_ids: bool = False) -> list[Any]:
    """Capture records (observations packed as RouteObservation.v2; with ``v1_every``,
    every n-th observation in the v1 shape, which is sealed as v3 all the same)."""
    clock = ProducerClock(producer_id=f"runtime-{seed}")
    messages = [identity_message(IDENTITY)]
    for spec in random_specs(n_threads, n_owners=9, seed=seed, assistant_tokens=24):
        messages.extend(thread_messages(spec, IDENTITY, clock, raw_ids=raw_ids))
    if v1_every:
        messages = [
            (kind, key, to_v1(record) if kind == "observations" and i % v1_every == 0 else record)
            for i, (kind, key, record) in enumerate(messages)
        ]
    return messages


def quarantined(setup: Setup) -> list[str]:
    return [
        dict(m.headers() or {}).get("reason", b"?").decode()
        for m in read_topic(setup.bootstrap, setup.topics.quarantine)
    ]


def log_tail(worker: WorkerProcess) -> str:
    return worker.log_path.read_text(errors="replace")[-3000:]


def _thread_chunks(messages: list[Any], n: int) -> list[list[Any]]:
    """``messages`` cut into ``n`` consecutive chunks at thread boundaries (a thread's
    records are consecutive), so no thread waits for a later chunk."""
    starts = [i for i in range(len(messages)) if i == 0 or messages[i][1] != messages[i - 1][1]]
    cuts = [starts[len(starts) * k // n] for k in range(1, n)]
    bounds = [0, *cuts, len(messages)]
    return [messages[a:b] for a, b in itertools.pairwise(bounds)]


def _feed(prod: Any, setup: Setup, chunk: list[Any]) -> threading.Thread:
    feeder = threading.Thread(target=produce, args=(prod, setup.topics, chunk),
                              kwargs={"pace_s": 0.3, "every": 10}, daemon=True)
    feeder.start()
    return feeder


def test_kill9_restarts_lose_nothing_and_repeat_identical_windows(
    topic_factory: Any, tmp_path: Path
) -> None:
    setup = Setup(topic_factory, f"restart{uuid.uuid4().hex[:6]}")
    messages = capture_messages(36, seed=1)
    expected = window_pairs(expected_pipeline(messages, worker_processor_config(FLAGS)).windows)
    prod = producer(setup.bootstrap)
    produce(prod, setup.topics, messages[:1])
    # Each worker gets its own share of the input while it runs (under a heavy load a
    # restart takes long enough for one paced feed of everything to finish first, and a
    # later worker then had nothing left to do before its kill).
    chunks = _thread_chunks(messages[1:], 4)
    worker = setup.worker(tmp_path, "0").start()
    rng = random.Random(3)
    progress = []
    try:
        for i in range(3):
            before = len(read_windows(setup.bootstrap, setup.topics))
            feeder = _feed(prod, setup, chunks[i])
            wait_until(
                lambda b=before: len(read_windows(setup.bootstrap, setup.topics)) >= b + 2,
                timeout_s=180,
                interval_s=0.5,
                what=f"progress of worker {i}",
            )
            time.sleep(rng.uniform(0.0, 1.5))  # kill at a random point while it works
            worker.kill()
            progress.append(len(read_windows(setup.bootstrap, setup.topics)) - before)
            feeder.join(120)
            worker = setup.worker(tmp_path, str(i + 1)).start()
        _feed(prod, setup, chunks[3]).join(120)
        wait_until(setup.windows_reach(expected), timeout_s=240, what="all expected windows")
    finally:
        worker.stop()
    windows = read_windows(setup.bootstrap, setup.topics)
    assert len(progress) == 3 and min(progress) >= 2
    assert window_pairs(windows) == expected, log_tail(worker)
    digests: dict[str, set[str]] = {}
    for w in windows:
        digests.setdefault(w["window_id"], set()).add(w["content_digest"])
    assert all(len(d) == 1 for d in digests.values())
    assert quarantined(setup) == []


def test_two_workers_share_partitions_and_produce_the_same_windows(
    topic_factory: Any, tmp_path: Path
) -> None:
    setup = Setup(topic_factory, f"pair{uuid.uuid4().hex[:6]}")
    messages = capture_messages(24, seed=2, v1_every=3)
    expected = window_pairs(expected_pipeline(messages, worker_processor_config(FLAGS)).windows)
    workers = [setup.worker(tmp_path, "a", home="home-a").start(),
               setup.worker(tmp_path, "b", home="home-b").start()]
    group = setup.prefix + setup.app_id

    # each worker logs its counters every second; which record kinds a worker reads
    # depends on when the second one joined (the first may have read every transcript)
    def both_counted() -> bool:
        return all('"validate/passed"' in w.log_path.read_text() for w in workers)

    try:
        # both join the group before data arrives
        wait_until(lambda: group_members(setup.bootstrap, group) >= 2, timeout_s=120,
                   interval_s=0.5, what="both workers in the group")
        produce(producer(setup.bootstrap), setup.topics, messages)
        wait_until(setup.windows_reach(expected), timeout_s=180, what="all expected windows")
        wait_until(both_counted, timeout_s=60, interval_s=0.5, what="both workers' counters")
    finally:
        for w in workers:
            w.stop()
    assert window_pairs(read_windows(setup.bootstrap, setup.topics)) == expected
    for w in workers:
        assert '"validate/passed"' in w.log_path.read_text(), log_tail(w)
        # its capture partitions came through librdkafka (streams.processors.fetch)
        assert "capture partitions read through librdkafka" in w.log_path.read_text()
    # standby replicas (the default, 1): each worker keeps the other's table partitions
    # warm, so both data directories hold every partition of both tables
    held = [{p.name for p in (tmp_path / home).glob("streams/*/v1/tables/*.db")}
            for home in ("home-a", "home-b")]
    assert held[0] == held[1] and {"dedup-state-0.db", "capture-state-0.db"} <= held[0], held


def _owners(config: SplitConfig, split: str, n: int) -> list[str]:
    found = [f"owner-{i:04d}" for i in range(500)
             if owner_split(owner_pseudonym(f"owner-{i:04d}"), config) == split]
    return found[:n]


def _leakage_specs(config: SplitConfig) -> tuple[list[ThreadSpec], list[ThreadSpec]]:
    train_owners, eval_owners = _owners(config, "train", 4), _owners(config, "validation", 4)
    rng = random.Random(5)
    train, evals = [], []
    for i, owner in enumerate(train_owners):
        body = tuple(tuple(rng.randrange(10, 4000) for _ in range(n)) for n in (30, 60, 20, 50))
        base = ThreadSpec(
            owner=owner,
            thread=f"train-{i}",
            tokens=body,
            turns=(("user", 30), ("assistant", 60), ("user", 20), ("assistant", 50)),
        )
        train.append(base)
        near = [list(t) for t in body]
        near[1][5] = 3  # one changed token: Jaccard well above 0.8
        copy_of = ThreadSpec(
            **{
                **base.__dict__,
                "owner": eval_owners[i],
                "thread": f"copy-{i}",
                "tokens": tuple(tuple(t) for t in near),
            }
        )
        evals.append(
            copy_of
            if i % 2
            else ThreadSpec(**{**base.__dict__, "owner": eval_owners[i], "thread": f"exact-{i}"})
        )
    for i, owner in enumerate(eval_owners):
        evals.append(ThreadSpec(owner=owner, thread=f"fresh-{i}", seed=100 + i))
    return train, evals


def test_no_leakage_between_train_and_evaluation_and_bad_records_are_quarantined(
    topic_factory: Any, tmp_path: Path
) -> None:
    setup = Setup(topic_factory, f"leak{uuid.uuid4().hex[:6]}")
    flags = {"validation_fraction": 0.5, "runtime_holdout_fraction": 0.0, "stress_rate": 0.0}
    config = worker_processor_config(flags)
    train, evals = _leakage_specs(config.split)
    clock = ProducerClock()
    train_msgs = [identity_message(IDENTITY)]
    for spec in train:
        train_msgs.extend(thread_messages(spec, IDENTITY, clock))
    eval_msgs = [m for spec in evals for m in thread_messages(spec, IDENTITY, clock)]
    bad = copy.deepcopy(next(m for m in eval_msgs if m[0] == "observations"))
    bad[2]["expert_ids"] = bad[2]["expert_ids"][:-2]  # one uint16 id short of top_k
    bad[2]["weights"] = bad[2]["weights"][:-4]
    bad[2]["counter"] = clock.next()
    worker = setup.worker(tmp_path, "0", flags).start()
    prod = producer(setup.bootstrap)
    try:
        produce(prod, setup.topics, train_msgs)
        expected_train = window_pairs(expected_pipeline(train_msgs, config).windows)
        wait_until(setup.windows_reach(expected_train), timeout_s=120, what="train windows")
        prod.produce(setup.topics.observations, key=bad[1], value=b"\x00garbage")
        produce(prod, setup.topics, [bad, *eval_msgs])
        expected = window_pairs(expected_pipeline(train_msgs + eval_msgs, config).windows)
        wait_until(setup.windows_reach(expected), timeout_s=120, what="all windows")
        wait_until(lambda: len(quarantined(setup)) >= 2, timeout_s=60, what="quarantine")
    finally:
        worker.stop()
    _assert_no_leakage(setup, train + evals)
    assert sorted(quarantined(setup)) == ["undecodable", "wrong_k"]
    summary = summarize_topics(setup.bootstrap, prefix=setup.prefix)
    assert summary["quarantine"] == {"undecodable": 1, "wrong_k": 1}
    assert summary["dedup"]["by_reason"]["near_duplicate_of_train"] == 2
    assert summary["dedup"]["by_reason"]["exact_duplicate"] == 2
    assert summary["splits"]["validation"]["threads"] == 4


def _assert_no_leakage(setup: Setup, specs: list[ThreadSpec]) -> None:
    windows = read_windows(setup.bootstrap, setup.topics)
    thread_splits: dict[str, set[str]] = {}
    owner_splits: dict[str, set[str]] = {}
    for w in windows:
        thread_splits.setdefault(f"{w['owner']}/{w['thread']}", set()).add(w["split"])
        owner_splits.setdefault(w["owner"], set()).add(w["split"])
    assert all(len(s) == 1 for s in thread_splits.values())
    assert not any({"train", "validation"} <= s for s in owner_splits.values())
    tokens = _thread_tokens(specs)
    dedup = DedupConfig()
    hashes = {key: minhash_of(tokens[key], dedup) for key in thread_splits}
    train = [k for k, s in thread_splits.items() if s == {"train"}]
    evaluation = [k for k, s in thread_splits.items() if s != {"train"}]
    assert train and evaluation
    for t in train:
        for e in evaluation:
            assert hashes[t].jaccard(hashes[e]) < dedup.threshold, (t, e)
    counts = Counter(next(iter(s)) for s in thread_splits.values())
    assert counts["train"] == 4


def _thread_tokens(specs: list[ThreadSpec]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for spec in specs:
        for kind, key, record in thread_messages(spec, IDENTITY, ProducerClock()):
            if kind == "transcripts":
                out.setdefault(key.decode(), []).extend(record["token_ids"])
    return out


def test_encode_message_round_trip() -> None:
    kind, _, record = identity_message(IDENTITY)
    value, headers = encode_message(kind, record)
    assert value[:2] == b"\xc3\x01" and headers


def test_records_from_the_runtime_publisher_become_the_expected_windows(
    topic_factory: Any, tmp_path: Path
) -> None:
    pytest.importorskip("cramjam", reason="aiokafka needs cramjam to read lz4 batches")
    from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher

    setup = Setup(topic_factory, f"pub{uuid.uuid4().hex[:6]}")
    messages = capture_messages(8, seed=4)
    expected = window_pairs(expected_pipeline(messages, worker_processor_config(FLAGS)).windows)
    grant_for(producer(setup.bootstrap), setup.topics, messages)
    publisher = RuntimePublisher(
        PublisherConfig(
            bootstrap_servers=setup.bootstrap,
            identities_topic=setup.topics.identities,
            transcripts_topic=setup.topics.transcripts,
            observations_topic=setup.topics.observations,
            consent_topic=setup.topics.consent,
        )
    )
    assert publisher.publish_identity(messages[0][2])
    # the runtime's raw ids: the publisher pseudonymizes them as the expected records are
    for kind, _, record in capture_messages(8, seed=4, raw_ids=True)[1:]:
        publish = publisher.publish_turn if kind == "transcripts" else publisher.publish_observation
        assert publish(record)
    publisher.flush()
    publisher.close()
    worker = setup.worker(tmp_path, "0").start()
    try:
        wait_until(setup.windows_reach(expected), timeout_s=120, what="all expected windows")
    finally:
        worker.stop()
    assert window_pairs(read_windows(setup.bootstrap, setup.topics)) == expected
    assert quarantined(setup) == []
