"""The worker's state on RocksDB: a restart reads only the changelog's tail.

A worker drains a first batch and stops; a second worker on the same data directory
(``FLYWHEEL_HOME``) drains a second batch. It restores fewer changelog records than the
first run wrote (RocksDB kept the state and its changelog offsets) and the windows of
both runs are exactly those of one clean in-process run over both batches. The
changelog topics are compacted, and no RocksDB file holds an owner's token ids in the
clear (values are sealed at rest).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from rocksdict import AccessType, Options, Rdict

from hebrus_flywheel.core import kafka
from hebrus_flywheel.streams.processors.state_codec import SealedState, loads
from hebrus_flywheel.streams.processors.state_seal import owner_of_key
from hebrus_flywheel.streams.topics import describe_topics
from tests.support.streams_harness import (
    WorkerProcess,
    expected_pipeline,
    last_logged,
    produce,
    producer,
    read_windows,
    window_pairs,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDENTITY = make_identity(layers=4, experts=64, top_k=4)
FLAGS = {"validation_fraction": 0.3, "runtime_holdout_fraction": 0.0, "stress_rate": 0.0}
APP_ID = "flywheel-streams"
TABLES = ("capture-state", "dedup-state")


def _messages(n_threads: int, seed: int, *, identity: bool) -> list[Any]:
    clock = ProducerClock(producer_id=f"runtime-{seed}")
    messages = [identity_message(IDENTITY)] if identity else []
    for spec in random_specs(n_threads, n_owners=5, seed=seed, assistant_tokens=16):
        spec = dataclasses.replace(spec, thread=f"{spec.thread}-{seed}")  # fresh threads
        messages.extend(thread_messages(spec, IDENTITY, clock))
    return messages


def _drain(bootstrap: str, prefix: str, tmp: Path, tag: str) -> Path:
    """Run one worker with ``--drain`` to its end; its log."""
    worker = WorkerProcess(
        bootstrap=bootstrap, prefix=prefix, app_id=APP_ID, log_path=tmp / f"worker-{tag}.log",
        flags=FLAGS, home=tmp / "home",
        extra=["--drain", "--session-timeout-s", "6", "--stall-timeout-s", "30"]).start()
    assert worker.proc is not None
    try:
        rc = worker.proc.wait(timeout=240)
    finally:
        worker.stop()
    assert rc == 0, worker.log_path.read_text(errors="replace")[-3000:]
    return worker.log_path


def _changelog_records(bootstrap: str, prefix: str) -> int:
    names = [f"{prefix}{APP_ID}-{t}-changelog" for t in TABLES]
    marks = kafka.end_watermarks(kafka.client_config(bootstrap), names, timeout_s=30)
    return sum(high - low for low, high in marks.values())


def test_a_restart_reads_only_the_changelog_tail_and_repeats_identical_windows(
        topic_factory: Any, tmp_path: Path) -> None:
    bootstrap = topic_factory.bootstrap
    prefix, topics = topic_factory.streams_namespace("state", APP_ID)
    first, second = _messages(6, 21, identity=True), _messages(6, 22, identity=False)
    expected = window_pairs(
        expected_pipeline(first + second, worker_processor_config(FLAGS)).windows)
    produce(producer(bootstrap), topics, first)
    _drain(bootstrap, prefix, tmp_path, "0")
    written = _changelog_records(bootstrap, prefix)
    assert written > 0
    produce(producer(bootstrap), topics, second)
    log = _drain(bootstrap, prefix, tmp_path, "1")
    counters = last_logged(log, "streams counters ")
    assert counters, log.read_text(errors="replace")[-3000:]
    restored = sum(int(counters.get(f"state/{t}_restored_records", 0)) for t in TABLES)
    print(f"first run wrote {written} changelog records; the restart restored {restored}")
    assert restored < written, (restored, written)
    assert not any(k.startswith("quarantine/") for k in counters), counters
    assert window_pairs(read_windows(bootstrap, topics)) == expected
    configs = describe_topics(bootstrap, [f"{prefix}{APP_ID}-{t}-changelog" for t in TABLES])
    assert {i.configs.get("cleanup.policy") for i in configs.values()} == {"compact"}
    owned, sealed = _owner_values_on_disk(tmp_path / "home")
    assert owned > 0 and sealed == owned, (owned, sealed)


def _owner_values_on_disk(home: Path) -> tuple[int, int]:
    """Values of owner keys in the worker's RocksDB files, and how many are sealed."""
    owned = sealed = 0
    dbs = [p for p in home.rglob("*.db") if p.is_dir()]
    assert dbs, f"no RocksDB database under {home}"
    for path in dbs:
        db = Rdict(str(path), Options(raw_mode=True), access_type=AccessType.read_only())
        try:
            for raw_key, raw in db.items():
                if raw_key.startswith(b"__faust"):
                    continue
                if owner_of_key(json.loads(raw_key)) is not None:
                    owned += 1
                    sealed += isinstance(loads(raw), SealedState)
        finally:
            db.close()
    return owned, sealed
