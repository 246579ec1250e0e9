"""The replay worker on the real broker with the real teacher and prefill engine.

Windows are crafted with the codec from real token ids of the teacher's tokenizer and
published to uuid-prefixed copies of the window topics (partition 0, so the block
layout is known). Covered: labels equal a direct engine replay, identity-mismatch and
malformed windows go to the quarantine topic, repeats are dropped, offsets are committed
only at block ends, and kill -9 mid-batch / mid-write / after the rename leaves no
partial shard and, after restart, exactly the bytes of an uninterrupted run.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

from hebrus_flywheel.consumers.kafka_io import committed_offsets, end_offsets, read_ranges
from hebrus_flywheel.consumers.shards import STAGING_DIR, ShardConfig, iter_shards
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core.progress import WatchdogConfig
from hebrus_flywheel.core.snapshot import U8_MAX_ABS_ERROR, dequantize_weights_u8
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.topics import QUARANTINE_TOPIC, catalogue, window_topic
from tests.support.plaintext import plaintext_copy, plaintext_digests
from tests.support.windows import (
    WorkerProcess,
    corpus_token_ids,
    make_window,
    publish_windows,
    thread_windows,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHARD = ShardConfig(offsets_per_shard=4, row_group_rows=4)


@pytest.fixture(scope="module")
def teacher(teacher_dir: Path) -> Any:
    from hebrus_flywheel.replay.teacher import load_teacher

    return load_teacher(teacher_dir)


@pytest.fixture(scope="module")
def identity_id(teacher: Any) -> str:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity

    return str(build_runtime_identity(teacher)["identity_id"])


@pytest.fixture(scope="module")
def tokens(teacher_dir: Path) -> list[int]:
    return corpus_token_ids(teacher_dir)


def topics(topic_factory: Any, name: str) -> str:
    prefix = f"{topic_factory.prefix}{name}."
    topic_factory.create(catalogue(prefix))
    return prefix


def run_in_thread(config: ReplayWorkerConfig, teacher: Any) -> ReplayWorker:
    worker = ReplayWorker(config, teacher=teacher)
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "worker did not stop"
    return worker


def shard_digests(root: Path) -> dict[str, str]:
    """Plaintext digests: shards are encrypted with fresh data keys on every write."""
    return plaintext_digests(root)


@dataclass
class EndToEnd:
    prefix: str
    root: Path
    worker: ReplayWorker
    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]
    bad_identity: dict[str, Any]


@pytest.fixture(scope="module")
def e2e(topic_factory: Any, teacher: Any, teacher_dir: Path, identity_id: str,
        tokens: list[int], tmp_path_factory: pytest.TempPathFactory) -> EndToEnd:
    prefix = topics(topic_factory, "e2e")
    train = [w for i in range(3) for w in thread_windows(
        tokens, identity_id=identity_id, owner=f"o{i}", thread="t", start=200 * i)]
    bad_identity = thread_windows(tokens, identity_id="f" * 64, owner="x", thread="t", count=1)
    oov = [make_window(token_ids=[1, 2, 10**6], anchors=[2], identity_id=identity_id,
                       owner="y", thread="t")]
    # 12 messages on train[0]: 9 windows, 2 refused, 1 repeat -> three full blocks of 4.
    publish_windows(topic_factory.bootstrap, prefix,
                    train[:5] + bad_identity + train[5:] + oov + train[:1], partition=0)
    validation = thread_windows(tokens, identity_id=identity_id, owner="v", thread="t",
                                split="validation", count=4, start=900)
    publish_windows(topic_factory.bootstrap, prefix, validation, partition=0)
    root = tmp_path_factory.mktemp("e2e") / "dataset"
    worker = run_in_thread(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=root, bootstrap=topic_factory.bootstrap, prefix=prefix,
        shard=SHARD, batch_windows=3, watchdog=WatchdogConfig(drain=True)), teacher)
    return EndToEnd(prefix=prefix, root=root, worker=worker, train=train,
                    validation=validation, bad_identity=bad_identity[0])


def test_worker_writes_one_shard_per_full_block_and_commits_its_end(
    e2e: EndToEnd, topic_factory: Any,
) -> None:
    train_topic = e2e.prefix + window_topic("train")
    validation_topic = e2e.prefix + window_topic("validation")
    names = sorted(p.name for _, _, p in iter_shards(e2e.root))
    assert names == sorted([f"{train_topic}.p000.o{a:020d}-{b:020d}.parquet"
                            for a, b in ((0, 3), (4, 7), (8, 11))]
                           + [f"{validation_topic}.p000.o{0:020d}-{3:020d}.parquet"])
    counts = e2e.worker.stats.report()["counts"]
    assert counts["intake/duplicate"] == 1 and counts["intake/accepted"] == 13
    committed = committed_offsets(topic_factory.bootstrap, e2e.worker.config.full_group_id,
                                  [(train_topic, 0), (validation_topic, 0)])
    assert committed == {(train_topic, 0): 12, (validation_topic, 0): 4}


def test_shard_labels_equal_a_direct_engine_replay(e2e: EndToEnd, teacher: Any,
                                                   tmp_path: Path) -> None:
    from hebrus_flywheel.replay.prefill import PrefillReplayer

    plain = plaintext_copy(e2e.root, tmp_path / "plain")  # DuckDB cannot use our keys
    rows = duckdb.sql(
        f"SELECT split, window_id, token_ordinal, expert_ids, weights_u8, features "
        f"FROM read_parquet('{plain}/epoch=*/split=*/*.parquet', hive_partitioning=true) "
        f"ORDER BY split, source_offset, token_ordinal").fetchall()
    windows = e2e.train + e2e.validation
    assert len(rows) == 13 * 6
    assert {r[1] for r in rows} == {w["window_id"] for w in windows}
    expected = {lab.window_id: lab for lab in PrefillReplayer(teacher).replay(windows)}
    for split, wid, ordinal, ids, weights_q, features in rows:
        lab = expected[wid]
        a = int(np.flatnonzero(lab.anchor_ordinals_A == ordinal)[0])
        assert np.array_equal(np.asarray(ids), lab.expert_ids_ALK[a])
        err = np.abs(dequantize_weights_u8(np.asarray(weights_q)) - lab.weights_ALK[a]).max()
        assert err <= U8_MAX_ABS_ERROR + 1e-6
        assert np.array_equal(np.asarray(features, dtype=np.float16), lab.features_ALD[a])
        assert split == lab.split


def test_refused_windows_go_to_the_quarantine_topic_with_a_reason(
    e2e: EndToEnd, topic_factory: Any,
) -> None:
    counts = e2e.worker.stats.report()["counts"]
    assert counts["quarantine/identity_mismatch"] == 1
    assert counts["quarantine/token_id_out_of_range"] == 1
    quarantine = e2e.prefix + QUARANTINE_TOPIC
    ends = end_offsets(topic_factory.bootstrap, [quarantine])[quarantine]
    records = [codec.decode_message(m.value(), m.headers())[1] for m in read_ranges(
        topic_factory.bootstrap, {(quarantine, p): (0, e) for p, e in ends.items()})]
    by_reason = {r["reason"]: r for r in records}
    assert set(by_reason) == {"identity_mismatch", "token_id_out_of_range"}
    mismatch = by_reason["identity_mismatch"]
    where = (mismatch["source_topic"], mismatch["source_partition"], mismatch["source_offset"])
    assert where == (e2e.prefix + window_topic("train"), 0, 5)
    assert mismatch["stage"] == "replay"
    # a plaintext Window.v1: kept as metadata only (where it is, its size and digest)
    assert mismatch["reference_only"] and mismatch["value"] == b"" and mismatch["owner"] is None
    assert mismatch["value_size"] > 0 and len(mismatch["value_sha256"]) == 64


def _worker_args(teacher_dir: Path, root: Path, bootstrap: str, prefix: str,
                 group: str) -> list[str]:
    return ["--teacher", str(teacher_dir), "--dataset", str(root), "--bootstrap-servers",
            bootstrap, "--prefix", prefix, "--group-id", group, "--offsets-per-shard", "4",
            "--row-group-rows", "4", "--batch-windows", "2", "--drain",
            "--torch-threads", "1", "--instance-id", f"{group}-0"]


def _visible_shards_are_complete(root: Path, reference: dict[str, str]) -> dict[str, str]:
    seen = shard_digests(root)
    for rel, digest in seen.items():
        assert reference.get(rel) == digest, f"{rel} is partial or differs"
    return seen


def test_kill_mid_batch_and_mid_write_then_restart_gives_the_same_bytes(
    topic_factory: Any, teacher: Any, teacher_dir: Path, identity_id: str, tokens: list[int],
    tmp_path: Path,
) -> None:
    prefix = topics(topic_factory, "crash")
    windows = [w for i in range(4) for w in thread_windows(
        tokens, identity_id=identity_id, owner=f"c{i}", thread="t", start=150 * i)]
    # 12 messages: the repeat at offset 11 must be dropped after every restart as well.
    publish_windows(topic_factory.bootstrap, prefix, windows[:11] + windows[1:2], partition=0)

    reference_root = tmp_path / "reference"
    run_in_thread(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=reference_root, bootstrap=topic_factory.bootstrap,
        prefix=prefix, group_id="reference", shard=SHARD, batch_windows=2, torch_threads=1,
        watchdog=WatchdogConfig(drain=True)), teacher)
    reference = shard_digests(reference_root)
    assert len(reference) == 3

    root = tmp_path / "crashed"
    args = _worker_args(teacher_dir, root, topic_factory.bootstrap, prefix, "crashed")
    plan = [("after_batch:3", 1), ("mid_write:2", 1), ("after_rename:1", 2), (None, 3)]
    for fault, visible in plan:
        proc = WorkerProcess(args, log_path=tmp_path / "worker.log", fault=fault)
        try:
            status = proc.wait(timeout_s=240)
        finally:
            proc.kill()
        assert status == (137 if fault else 0), proc.output()[-3000:]
        seen = _visible_shards_are_complete(root, reference)
        assert len(seen) == visible, (fault, sorted(seen))
    assert shard_digests(root) == reference
    assert not any((root / STAGING_DIR).iterdir())
    assert "already durable with identical plaintext bytes" in (tmp_path / "worker.log").read_text()
