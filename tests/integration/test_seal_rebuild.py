"""Seal, verify and rebuild on the real broker, with the real teacher and prefill engine.

One scenario per module: a replay worker runs in a thread while two epochs are sealed.
Epoch 0 holds train, validation and ``runtime_holdout`` windows whose routes come from
real KV-cache decode, so the seal computes parity on the sealed shards and finds the
identity authoritative. Epoch 1 (train only, plus a repeat of an epoch-0 window) has no
parity sample: it is refused until an override reason is given. Sealed shards are read
back with DuckDB, verified, damaged in copies, and rebuilt byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
from confluent_kafka import TopicPartition

from hebrus_flywheel.consumers.control import ControlChannel
from hebrus_flywheel.consumers.exceptions import RebuildError, SealError
from hebrus_flywheel.consumers.kafka_io import committed_offsets, end_offsets
from hebrus_flywheel.consumers.rebuild import RebuildConfig, rebuild_snapshot
from hebrus_flywheel.consumers.seal import SealConfig, SealResult, seal_epoch
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.snapshot import dequantize_weights_u8, load_manifest, verify_snapshot
from hebrus_flywheel.core.snapshot.export import export_plaintext
from hebrus_flywheel.streams.consent import CONSENT_TOPIC
from hebrus_flywheel.streams.topics import CONTROL_TOPIC, SPLITS, catalogue, window_topic
from tests.support.windows import (
    corpus_token_ids,
    holdout_window,
    publish_windows,
    thread_windows,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONSUMERS_CLI = (sys.executable, "-m", "hebrus_flywheel.consumers")


@dataclass
class Scenario:
    bootstrap: str
    prefix: str
    root: Path
    teacher_dir: Path
    teacher: Any
    epochs: list[SealResult]
    refusal: str
    holdout: list[dict[str, Any]]
    worker: ReplayWorker


def _publish_epoch0(bootstrap: str, prefix: str, teacher: Any, ident: str,
                    tokens: list[int]) -> list[dict[str, Any]]:
    windows = [w for i in range(4) for w in thread_windows(
        tokens, identity_id=ident, owner=f"o{i}", thread="t", start=120 * i,
        split="train" if i < 3 else "validation")]
    holdout = [holdout_window(teacher, tokens[1000 + 70 * i:1040 + 70 * i], identity_id=ident,
                              owner=f"h{i}", thread="t") for i in range(3)]
    publish_windows(bootstrap, prefix, windows + holdout)
    return holdout


@pytest.fixture(scope="module")
def scenario(topic_factory: Any, teacher_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher

    teacher = load_teacher(teacher_dir)
    ident = str(build_runtime_identity(teacher)["identity_id"])
    tokens = corpus_token_ids(teacher_dir)
    bootstrap, prefix = topic_factory.bootstrap, f"{topic_factory.prefix}seal."
    topic_factory.create(catalogue(prefix))
    root = tmp_path_factory.mktemp("seal") / "dataset"
    holdout = _publish_epoch0(bootstrap, prefix, teacher, ident, tokens)
    worker = ReplayWorker(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=root, bootstrap=bootstrap, prefix=prefix,
        shard=ShardConfig(offsets_per_shard=2), batch_windows=2, torch_threads=1,
        control_sync_s=0.3), teacher=teacher)
    thread = threading.Thread(target=worker.run)
    umask = os.umask(0)  # the most permissive umask: modes must not come from it
    thread.start()
    try:
        first = seal_epoch(SealConfig(dataset=root, epoch=0, bootstrap=bootstrap, timeout_s=120))
        later = [w for i in range(4, 6) for w in thread_windows(
            tokens, identity_id=ident, owner=f"o{i}", thread="t", start=120 * i)]
        publish_windows(bootstrap, prefix, later + thread_windows(
            tokens, identity_id=ident, owner="o0", thread="t", count=1))
        with pytest.raises(SealError) as refused:
            seal_epoch(SealConfig(dataset=root, epoch=1, bootstrap=bootstrap, timeout_s=120))
        second = seal_epoch(SealConfig(dataset=root, epoch=1, bootstrap=bootstrap,
                                       timeout_s=120, override_parity="no runtime_holdout "
                                       "windows in epoch 1; parity held in epoch 0"))
    finally:
        worker.stop()
        thread.join(timeout=120)
        os.umask(umask)
    yield Scenario(bootstrap=bootstrap, prefix=prefix, root=root, teacher_dir=teacher_dir,
                   teacher=teacher, epochs=[first, second], refusal=str(refused.value),
                   holdout=holdout, worker=worker)
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)


def test_seal_records_the_boundary_and_writes_a_full_manifest(scenario: Scenario) -> None:
    first, second = scenario.epochs
    assert first.manifest["epoch"] == 0 and second.manifest["previous_snapshot"] == \
        first.snapshot_id
    channel = ControlChannel(scenario.bootstrap, scenario.prefix + CONTROL_TOPIC)
    try:
        state = channel.sync()
    finally:
        channel.close()
    assert sorted(state.boundaries) == [0, 1] and sorted(state.sealed) == [0, 1]
    assert state.sealed[1]["snapshot_id"] == second.snapshot_id
    for result in (first, second):  # consent measured at seal time, every row granted
        consent = result.manifest["consent"]
        assert consent["rows"] == consent["rows_granted"] == result.manifest["totals"]["rows"]
        assert consent["authorized_fraction"] == 1.0 and consent["refused"] == {}
        assert consent["ledger"] == scenario.prefix + CONSENT_TOPIC
    topics = [scenario.prefix + window_topic(s) for s in SPLITS]
    ends = end_offsets(scenario.bootstrap, topics)
    for result, boundary in zip((first, second), (state.boundaries[0], state.boundaries[1]),
                                strict=True):
        for topic, info in result.manifest["source"]["topics"].items():
            for p, span in info["partitions"].items():
                assert span == {"start": boundary.start_of(topic, int(p)),
                                "end": boundary.end_of(topic, int(p))}
    assert {t: dict(v) for t, v in state.boundaries[1].end.items()} == ends
    m = first.manifest
    assert set(m["splits"]) == {"train", "validation", "runtime_holdout"}
    assert m["splits"]["train"]["windows"] == 9 and m["splits"]["runtime_holdout"]["windows"] == 3
    assert m["identity"]["identity_id"] == m["parity"]["identity_id"]
    assert m["teacher"]["model_artifact_digest"] and m["tokenizer"]["tokenizer_digest"]
    assert m["determinism"]["torch_threads"] == 1
    assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 and s["rows"] > 0 for s in m["shards"])
    offsets = committed_offsets(scenario.bootstrap, f"{scenario.prefix}flywheel-replay",
                                [(t, p) for t, parts in ends.items() for p in parts])
    assert all(offsets[(t, p)] >= end for t, parts in ends.items()
               for p, end in parts.items() if end > 0)


def test_sealed_files_are_0440_in_0550_dirs_and_the_rest_0640_in_0750(
        scenario: Scenario) -> None:
    """Written by the replay worker and the seal under umask 0 (see the fixture)."""
    root = scenario.root
    for path in [root, *root.rglob("*")]:
        parts = path.relative_to(root).parts
        if parts and parts[0].startswith("epoch="):  # epochs 0 and 1 are both sealed
            want = 0o550 if path.is_dir() else 0o440
        else:
            want = 0o750 if path.is_dir() else 0o640
        assert stat.S_IMODE(path.stat().st_mode) == want, (path, oct(path.stat().st_mode))


def test_parity_is_computed_on_the_sealed_holdout_and_overrides_are_recorded(
    scenario: Scenario,
) -> None:
    first, second = scenario.epochs
    parity = first.manifest["parity"]
    assert parity["authoritative"] is True and first.manifest["parity_override"] is None
    assert parity["windows_compared"] == 3 and parity["pairs"] == 3 * 6 * 4
    assert parity["mismatched_pairs"] == 0
    assert "not authoritative" in scenario.refusal and "--override-parity" in scenario.refusal
    assert second.manifest["parity"]["authoritative"] is False
    assert second.manifest["parity_override"]["reason"].startswith("no runtime_holdout")


def test_duckdb_reads_sealed_shards_with_the_manifest_counts(scenario: Scenario,
                                                            tmp_path: Path) -> None:
    """DuckDB, the independent reader, refuses the encrypted shards (it cannot use our
    KMS-wrapped keys) and reads the checked plaintext export (`flywheel export-plaintext`)."""
    with pytest.raises(duckdb.Error, match="encrypted"):
        duckdb.sql(f"SELECT count(*) FROM read_parquet('{scenario.root}/epoch=0/*/*.parquet')"
                   ).fetchall()
    plain = tmp_path / "plain"
    for result in scenario.epochs:
        epoch = result.manifest["epoch"]
        export_plaintext(result.manifest_path.parent, plain / f"epoch={epoch}")
        got = dict(duckdb.sql(
            f"SELECT split, count(*) FROM read_parquet('{plain}/epoch=*/split=*/*.parquet',"
            f" hive_partitioning=true) WHERE epoch = {epoch} GROUP BY split").fetchall())
        assert got == {s: v["rows"] for s, v in result.manifest["splits"].items()}
    rows = duckdb.sql(
        f"SELECT window_id, token_ordinal, expert_ids, weights_u8 FROM read_parquet("
        f"'{plain}/epoch=0/split=runtime_holdout/*.parquet') "
        f"ORDER BY window_id, token_ordinal").fetchall()
    captured = {w["window_id"]: w for w in scenario.holdout}
    assert {r[0] for r in rows} == set(captured)
    for wid, ordinal, ids, weights in rows:
        window = captured[wid]
        a = window["anchor_positions"].index(ordinal - window["first_token_ordinal"])
        routes = window["routes"]
        shape = (len(window["anchor_positions"]), routes["layer_count"], routes["top_k"])
        decode = np.frombuffer(routes["expert_ids"], dtype="<i2").reshape(shape)
        assert np.array_equal(np.asarray(ids), decode[a])
        assert np.allclose(dequantize_weights_u8(np.asarray(weights)).sum(-1), 1.0, atol=0.02)
    epoch1 = duckdb.sql(
        f"SELECT count(DISTINCT window_id) FROM read_parquet('{plain}/epoch=1/*/*.parquet')"
    ).fetchall()[0][0]
    assert epoch1 == 6  # the repeat of an epoch-0 window was dropped


def test_sealing_is_idempotent_and_in_order(scenario: Scenario) -> None:
    again = seal_epoch(SealConfig(dataset=scenario.root, epoch=0, bootstrap=scenario.bootstrap))
    assert again.already_sealed and again.snapshot_id == scenario.epochs[0].snapshot_id
    with pytest.raises(SealError, match="sealed in order"):
        seal_epoch(SealConfig(dataset=scenario.root, epoch=5, bootstrap=scenario.bootstrap))


def _verify_cli(snapshot: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CONSUMERS_CLI, "verify", str(snapshot)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_verify_accepts_the_snapshot_and_fails_on_any_damage(scenario: Scenario,
                                                            tmp_path: Path) -> None:
    original = scenario.epochs[0].manifest_path.parent
    assert verify_snapshot(original)["snapshot_id"] == scenario.epochs[0].snapshot_id
    assert _verify_cli(original).returncode == 0
    shard = scenario.epochs[0].manifest["shards"][0]["path"]
    for damage in ("flip", "missing", "extra"):
        copy = tmp_path / damage
        shutil.copytree(original, copy)
        for dirpath, _, filenames in os.walk(copy):
            os.chmod(dirpath, 0o755)
            for name in filenames:
                os.chmod(Path(dirpath) / name, 0o644)
        if damage == "flip":
            data = bytearray((copy / shard).read_bytes())
            data[100] ^= 0x80
            (copy / shard).write_bytes(bytes(data))
        elif damage == "missing":
            (copy / shard).unlink()
        else:
            (copy / "split=train" / "stray.parquet").write_bytes(b"PAR1")
        result = _verify_cli(copy)
        assert result.returncode == 2, (damage, result.stdout, result.stderr)
        assert "failed verification" in result.stderr


def test_rebuild_regenerates_plaintext_identical_shards(scenario: Scenario,
                                                       tmp_path: Path) -> None:
    """Rebuild parity under encryption: every shard's plaintext encoding is byte-identical
    and the content id matches; the ciphertext (and so the snapshot id) is fresh."""
    for result in scenario.epochs:
        report = rebuild_snapshot(RebuildConfig(
            snapshot=result.manifest_path.parent, out=tmp_path / "in-process",
            teacher=scenario.teacher_dir, bootstrap=scenario.bootstrap), teacher=scenario.teacher)
        assert report["identical"] and report["content_id_match"], report["differences"]
        assert not report["snapshot_id_match"]  # fresh data keys and nonces
        assert report["shards"] == len(result.manifest["shards"])
        rebuilt = Path(report["out"])
        summary = verify_snapshot(rebuilt, keys=True)
        assert summary["content_id"] == result.manifest["content_id"]
        assert summary["snapshot_id"] == report["rebuilt_snapshot_id"] != result.snapshot_id
        old = {s["path"]: s for s in result.manifest["shards"]}
        for entry in load_manifest(rebuilt).shards:
            assert entry.plaintext_sha256 == old[entry.path]["plaintext_sha256"]
            assert entry.sha256 != old[entry.path]["sha256"]
    cli = subprocess.run(
        [*CONSUMERS_CLI, "rebuild", "--snapshot",
         str(scenario.epochs[1].manifest_path.parent), "--out", str(tmp_path / "cli"),
         "--teacher", str(scenario.teacher_dir), "--bootstrap-servers", scenario.bootstrap,
         "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert cli.returncode == 0, cli.stderr[-3000:]
    report = json.loads(cli.stdout)
    assert report["identical"] and report["content_id_match"]
    assert report["rebuilt_content_id"] == scenario.epochs[1].manifest["content_id"]


def _candidate_config(scenario: Scenario, out: Path) -> Any:
    from hebrus_flywheel.consumers.candidate_epoch import CandidateEpochConfig

    return CandidateEpochConfig(
        snapshot=scenario.epochs[0].manifest_path.parent, out=out,
        teacher=scenario.teacher_dir, bootstrap=scenario.bootstrap,
        drafters=("teacher_self", "prompt_lookup", "dense"), width=2, depth=2,
        anchors_per_window=2,
        parity_windows=2)


def test_candidate_epoch_is_its_own_product_over_the_clean_epochs_windows(
        scenario: Scenario, tmp_path: Path) -> None:
    """`flywheel replay candidates`: the same blocks as the clean epoch, parity against
    step-by-step decode, a product clean readers refuse; a rerun after a crash keeps the
    shards written and ends in the same content; a sealed epoch is not redone."""
    from hebrus_flywheel.consumers.candidate_epoch import build_candidate_epoch
    from hebrus_flywheel.core.snapshot import PRODUCT_CANDIDATE, ProductError, open_snapshot
    from hebrus_flywheel.train.candidates.rows import read_candidate_table

    clean = scenario.epochs[0].manifest
    config = _candidate_config(scenario, tmp_path / "first")
    report = build_candidate_epoch(config, teacher=scenario.teacher)
    sealed = Path(report["out"])
    manifest = load_manifest(sealed).to_dict()
    assert manifest["product"] == PRODUCT_CANDIDATE and report["rows"] > 0
    assert manifest["parity"]["authoritative"] and manifest["parity"]["paths"] > 0
    assert report["parity"]["candidate_rank_exact"] == 1.0
    assert report["parity"]["accepted_prefix_digest_parity"] == 1.0
    assert report["accepted_tokens"] > 0 and report["replay_cost_s_per_accepted_token"] > 0
    # teacher self-drafting proposes at every anchor: every clean shard has its candidate twin
    assert {s["path"] for s in manifest["shards"]} == {s["path"] for s in clean["shards"]}
    assert manifest["source"]["clean_snapshot"] == clean["snapshot_id"]
    verify_snapshot(sealed, keys=True)
    with pytest.raises(ProductError):
        open_snapshot(sealed)
    table = read_candidate_table(sealed)
    drafters = set(table.column("drafter_id").to_pylist())
    assert "teacher_self" in drafters and any(d.startswith("dense_gru/") for d in drafters)
    assert not {"accepted", "accepted_prefix_digest", "path_id"} - set(table.column_names)
    opened = open_snapshot(scenario.epochs[0].manifest_path.parent)
    windows = {w for i in range(len(opened.manifest.shards))
               for w in opened.read_shard(i, ["window_id"]).column("window_id").to_pylist()}
    assert set(table.column("window_id").to_pylist()) <= windows
    with pytest.raises(RebuildError, match="already sealed"):
        build_candidate_epoch(config, teacher=scenario.teacher)

    # A crash that left every shard but one: the rerun replays only the missing block.
    partial = tmp_path / "second"
    shards = sorted(s["path"] for s in manifest["shards"])
    for rel in shards[1:]:  # manifest paths are relative to the epoch directory
        (partial / sealed.name / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sealed / rel, partial / sealed.name / rel)
    again = build_candidate_epoch(_candidate_config(scenario, partial), teacher=scenario.teacher)
    assert (again["shards_written"], again["shards_kept"]) == (1, len(shards) - 1)
    assert load_manifest(Path(again["out"])).to_dict()["content_id"] == manifest["content_id"]


def test_candidate_blocks_reach_any_worker_through_the_candidate_topics(
        scenario: Scenario, tmp_path: Path) -> None:
    """With --external-workers the planner replays nothing: a `flywheel replay
    candidate-worker` process (as the replay role) takes the work items from the
    candidate topic and reports every shard on the candidate control topic; the items
    name offsets and window ids, never tokens."""
    from dataclasses import replace

    from hebrus_flywheel.consumers.candidate_epoch import build_candidate_epoch
    from hebrus_flywheel.consumers.candidate_jobs import decode_item
    from hebrus_flywheel.streams.topics import CANDIDATE_BLOCKS_TOPIC

    config = replace(_candidate_config(scenario, tmp_path / "external"), external_workers=True,
                     drafters=("teacher_self", "prompt_lookup"), wait_s=300)
    result: dict[str, Any] = {}

    def plan_and_seal() -> None:
        try:
            result.update(build_candidate_epoch(config, teacher=scenario.teacher))
        except Exception as exc:  # handed to the test thread
            result["error"] = exc

    planner = threading.Thread(target=plan_and_seal, daemon=True)
    planner.start()
    env = {k: v for k, v in os.environ.items() if k != "FLYWHEEL_ROLE"}
    worker = subprocess.run(
        [*CONSUMERS_CLI, "replay", "candidate-worker", "--teacher", str(scenario.teacher_dir),
         "--bootstrap-servers", scenario.bootstrap, "--prefix", scenario.prefix,
         "--max-idle-s", "20"], capture_output=True, text=True, timeout=400, check=False,
        env=env)
    planner.join(timeout=300)
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert "error" not in result, result.get("error")
    stats = json.loads(worker.stdout)
    assert stats["counts"]["items/replayed"] == result["planned_blocks"] == result["shards_written"]
    assert result["shards_kept"] == 0 and len(result["workers"]) == 1
    assert str(os.getpid()) not in result["workers"][0]
    clean = scenario.epochs[0].manifest
    manifest = load_manifest(Path(result["out"])).to_dict()
    assert {s["path"] for s in manifest["shards"]} == {s["path"] for s in clean["shards"]}
    assert manifest["parity"]["authoritative"]
    topic = scenario.prefix + CANDIDATE_BLOCKS_TOPIC
    ends = end_offsets(scenario.bootstrap, [topic])[topic]
    records = list(kafka.read_ranges(kafka.client_config(scenario.bootstrap),
                                     {(topic, p): (0, e) for p, e in ends.items() if e},
                                     timeout_s=30))
    items = [decode_item(m.value(), "test") for m in records]
    mine = [i for i in items if i.job.job_id == result["job_id"]]
    assert len(mine) == result["planned_blocks"]
    assert all(b"token_ids" not in m.value() for m in records)


def test_seal_without_running_workers_times_out_with_a_clear_message(
    scenario: Scenario,
) -> None:
    publish_windows(scenario.bootstrap, scenario.prefix, thread_windows(
        corpus_token_ids(scenario.teacher_dir), identity_id="a" * 64, owner="late", thread="t",
        count=1))
    start = time.monotonic()
    with pytest.raises(SealError, match="timed out") as info:
        seal_epoch(SealConfig(dataset=scenario.root, epoch=2, bootstrap=scenario.bootstrap,
                              timeout_s=3, poll_interval_s=0.5))
    assert time.monotonic() - start < 60
    assert "flywheel replay worker" in str(info.value) and "re-run the same seal" in str(info.value)


def test_rebuild_refuses_once_retention_removed_its_records(scenario: Scenario,
                                                            tmp_path: Path) -> None:
    """Last in the module: it deletes the first records of a shared window partition,
    as retention would, and rebuild must say so instead of sealing another snapshot."""
    result = scenario.epochs[0]
    topic, partition, start = next(
        (t, int(p), int(r["start"])) for t, v in sorted(result.manifest["source"]["topics"].items())
        for p, r in sorted(v["partitions"].items()) if int(r["end"]) > int(r["start"]))
    admin = kafka.make_admin(kafka.client_config(scenario.bootstrap))
    for fut in admin.delete_records([TopicPartition(topic, partition, start + 1)]).values():
        fut.result(timeout=30)
    with pytest.raises(RebuildError, match=rf"{topic}\[{partition}\] starts at offset "
                                           rf"{start + 1} on the broker but the rebuild needs "
                                           rf"the window records from offset {start}"):
        rebuild_snapshot(RebuildConfig(
            snapshot=result.manifest_path.parent, out=tmp_path / "gone",
            teacher=scenario.teacher_dir, bootstrap=scenario.bootstrap), teacher=scenario.teacher)
    assert not (tmp_path / "gone").exists()
