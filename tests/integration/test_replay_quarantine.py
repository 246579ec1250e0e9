"""The replay worker's two kinds of failure (issue 20), against the real broker and the
tiny teacher.

* A window the teacher cannot replay is quarantined with its reason and the worker goes
  on: a token id outside the vocabulary (``token_id_out_of_range``), a window longer
  than the teacher's context (``window_exceeds_context``), captured routes with another
  layer count (``layer_count_mismatch``). The valid windows around them are written.
* An infrastructure fault, a shard write that fails (the staging path is unusable),
  exits non-zero without committing; after the fault is fixed a restarted worker
  writes every row exactly once.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import duckdb
import pytest

from hebrus_flywheel.consumers.kafka_io import committed_offsets, end_offsets, read_ranges
from hebrus_flywheel.consumers.shards import STAGING_DIR, ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core.progress import WatchdogConfig
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.topics import QUARANTINE_TOPIC, catalogue, window_topic
from tests.support.consent import grant_owners
from tests.support.plaintext import plaintext_copy
from tests.support.windows import (
    WorkerProcess,
    corpus_token_ids,
    make_window,
    publish_windows,
    thread_windows,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHARD = ShardConfig(offsets_per_shard=4, row_group_rows=4)
ANCHORS = 6  # per window of thread_windows


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


def _prefix(topic_factory: Any, name: str) -> str:
    prefix = f"{topic_factory.prefix}{name}."
    topic_factory.create(catalogue(prefix))
    return prefix


def _quarantined(bootstrap: str, prefix: str) -> list[dict[str, Any]]:
    topic = prefix + QUARANTINE_TOPIC
    ends = end_offsets(bootstrap, [topic])[topic]
    return [codec.decode_message(m.value(), m.headers())[1] for m in read_ranges(
        bootstrap, {(topic, p): (0, e) for p, e in ends.items()})]


def _rows(root: Path) -> list[tuple[Any, ...]]:
    with tempfile.TemporaryDirectory() as tmp:  # DuckDB cannot use our keys: read a copy
        plain = plaintext_copy(root, Path(tmp))
        return duckdb.sql(
            f"SELECT window_id, token_ordinal FROM read_parquet('{plain}/epoch=*/split=*/"
            "*.parquet', hive_partitioning=true) ORDER BY source_offset, token_ordinal"
        ).fetchall()


def _unreplayable(teacher: Any, tokens: list[int], identity_id: str) -> list[dict[str, Any]]:
    context = int(teacher.context_length)
    layers = int(teacher.geometry.routed_layer_count)
    top_k = int(teacher.geometry.top_k)
    long_tokens = (tokens * (context // len(tokens) + 2))[: context + 1]
    wrong = layers + 3
    routes = {"layer_count": wrong, "top_k": top_k, "layers": list(range(wrong)),
              "stages": [0] * wrong, "expert_ids": bytes(2 * wrong * top_k),
              "weights": bytes(4 * wrong * top_k)}
    return [
        make_window(token_ids=[1, 2, teacher.vocab_size + 5], anchors=[2],
                    identity_id=identity_id, owner="oov", thread="t"),
        make_window(token_ids=long_tokens, anchors=[context], identity_id=identity_id,
                    owner="long", thread="t"),
        make_window(token_ids=tokens[:16], anchors=[15], identity_id=identity_id,
                    owner="layers", thread="t", routes=routes),
    ]


def test_windows_the_teacher_cannot_replay_are_quarantined_and_the_worker_goes_on(
    topic_factory: Any, teacher: Any, teacher_dir: Path, identity_id: str, tokens: list[int],
    tmp_path: Path,
) -> None:
    bootstrap = topic_factory.bootstrap
    prefix = _prefix(topic_factory, "unreplayable")
    valid = [w for i in range(5) for w in thread_windows(
        tokens, identity_id=identity_id, owner=f"ok{i}", thread="t", count=1, start=80 * i)]
    bad = _unreplayable(teacher, tokens, identity_id)
    # 8 messages on train[0]: two full blocks of 4, the refused ones in between
    publish_windows(bootstrap, prefix, valid[:2] + bad[:2] + valid[2:4] + bad[2:] + valid[4:],
                    partition=0)
    root = tmp_path / "dataset"
    worker = ReplayWorker(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=root, bootstrap=bootstrap, prefix=prefix,
        shard=SHARD, batch_windows=2, torch_threads=1, watchdog=WatchdogConfig(drain=True)),
        teacher=teacher)
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "worker did not stop"

    records = _quarantined(bootstrap, prefix)
    got = {r["source_offset"]: (r["reason"], r["stage"]) for r in records}
    print(f"replay quarantine: {got}")
    assert got == {2: ("token_id_out_of_range", "replay"),
                   3: ("window_exceeds_context", "replay"),
                   6: ("layer_count_mismatch", "replay")}, got
    # plaintext Window.v1 records: metadata only, nothing of the window copied
    assert all(r["reference_only"] and r["value"] == b"" and r["owner"] is None
               and r["value_size"] > 0 for r in records), records
    counts = worker.stats.report()["counts"]
    for reason in ("token_id_out_of_range", "window_exceeds_context", "layer_count_mismatch"):
        assert counts[f"quarantine/{reason}"] == 1, counts
    rows = _rows(root)
    assert sorted({r[0] for r in rows}) == sorted(w["window_id"] for w in valid)
    assert len(rows) == len(valid) * ANCHORS
    train = prefix + window_topic("train")
    committed = committed_offsets(bootstrap, worker.config.full_group_id, [(train, 0)])
    assert committed == {(train, 0): 8}


def _args(teacher_dir: Path, root: Path, bootstrap: str, prefix: str) -> list[str]:
    return ["--teacher", str(teacher_dir), "--dataset", str(root), "--bootstrap-servers",
            bootstrap, "--prefix", prefix, "--group-id", "writer", "--offsets-per-shard", "4",
            "--row-group-rows", "4", "--batch-windows", "2", "--drain",
            "--torch-threads", "1", "--instance-id", "writer-0"]


def test_a_failed_shard_write_exits_non_zero_without_commit_and_a_restart_writes_once(
    topic_factory: Any, teacher_dir: Path, identity_id: str, tokens: list[int], tmp_path: Path,
) -> None:
    bootstrap = topic_factory.bootstrap
    prefix = _prefix(topic_factory, "shardfail")
    windows = thread_windows(tokens, identity_id=identity_id, owner="w", thread="t", count=8)
    publish_windows(bootstrap, prefix, windows, partition=0)
    root = tmp_path / "dataset"
    root.mkdir()
    # the tests run as root, so a read-only directory would not stop the write: a plain
    # file where the epoch directory must be makes every shard write fail
    blocker = root / "epoch=0"
    blocker.write_text("not a directory")
    args = _args(teacher_dir, root, bootstrap, prefix)
    failed = WorkerProcess(args, log_path=tmp_path / "failed.log")
    try:
        status = failed.wait(timeout_s=240)
    finally:
        failed.kill()
    assert status == 2, failed.output()[-3000:]
    assert "error: writing the shard of" in failed.output(), failed.output()[-3000:]
    train = prefix + window_topic("train")
    group = f"{prefix}writer"
    assert committed_offsets(bootstrap, group, [(train, 0)]).get((train, 0), -1) <= 0
    assert not list(root.glob("epoch=*/split=*/*.parquet"))
    print(f"failed shard write: exit {status}; last line: "
          f"{failed.output().strip().splitlines()[-1]}")

    blocker.unlink()
    again = WorkerProcess(args, log_path=tmp_path / "again.log")
    try:
        status = again.wait(timeout_s=240)
    finally:
        again.kill()
    assert status == 0, again.output()[-3000:]
    rows = _rows(root)
    assert len(rows) == len(set(rows)) == len(windows) * ANCHORS
    assert not any((root / STAGING_DIR).iterdir())
    assert {r[0] for r in rows} == {w["window_id"] for w in windows}
    assert committed_offsets(bootstrap, group, [(train, 0)]) == {(train, 0): 8}


def test_windows_without_a_live_grant_of_their_scope_are_quarantined_metadata_only(
    topic_factory: Any, teacher_dir: Path, identity_id: str, tokens: list[int], tmp_path: Path,
) -> None:
    bootstrap = topic_factory.bootstrap
    prefix = _prefix(topic_factory, "noconsent")
    ok = thread_windows(tokens, identity_id=identity_id, owner="ok", thread="t", count=3)
    evaluate_only = thread_windows(tokens, identity_id=identity_id, owner="eval-only",
                                   thread="t", count=2)
    nobody = thread_windows(tokens, identity_id=identity_id, owner="nobody", thread="t",
                            count=3)  # 8 offsets: two whole blocks of 4
    grant_owners(bootstrap, ["eval-only"], prefix=prefix, scopes=("capture", "evaluate"))
    publish_windows(bootstrap, prefix, ok, partition=0)  # grants "ok" every scope
    publish_windows(bootstrap, prefix, evaluate_only + nobody, partition=0, consent=False)
    root = tmp_path / "dataset"
    root.mkdir()
    worker = WorkerProcess(_args(teacher_dir, root, bootstrap, prefix),
                           log_path=tmp_path / "worker.log")
    try:
        assert worker.wait(timeout_s=240) == 0, worker.output()[-3000:]
    finally:
        worker.kill()
    assert {r[0] for r in _rows(root)} == {w["window_id"] for w in ok}
    refused = _quarantined(bootstrap, prefix)
    assert len(refused) == len(evaluate_only) + len(nobody)
    for rec in refused:  # train windows need a train grant; nothing of them is copied
        assert rec["reason"] == "no_consent" and rec["stage"] == "replay"
        assert rec["reference_only"] and rec["value"] == b"" and rec["owner"] is None
        assert "train grant" in rec["detail"]
