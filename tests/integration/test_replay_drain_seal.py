"""``flywheel replay worker --drain`` ends at the boundary ``flywheel seal`` records.

What the demo's replay step relies on: the open epoch's last, partial block closes only
at a recorded boundary, so a draining worker keeps running (no premature exit 0, no
stall verdict) until the seal records the epoch's end offsets, then writes the partial
block, commits every partition to its end and exits 0 ("drained ... final lag 0").
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.consumers.kafka_io import committed_offsets
from hebrus_flywheel.consumers.seal import SealConfig, seal_epoch
from hebrus_flywheel.consumers.shards import iter_shards
from hebrus_flywheel.core.progress import read_health
from hebrus_flywheel.core.snapshot import default_kek_path
from hebrus_flywheel.streams.topics import catalogue, window_topic
from tests.support.consent import revoke_owners
from tests.support.windows import (
    WorkerProcess,
    corpus_token_ids,
    publish_windows,
    thread_windows,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_drain_waits_for_the_seal_boundary_then_exits_zero(
        topic_factory: Any, teacher_dir: Path, tmp_path: Path) -> None:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher

    ident = str(build_runtime_identity(load_teacher(teacher_dir))["identity_id"])
    tokens = corpus_token_ids(teacher_dir)
    bootstrap, prefix = topic_factory.bootstrap, f"{topic_factory.prefix}drainseal."
    topic_factory.create(catalogue(prefix))
    windows = [w for i in range(2) for w in thread_windows(
        tokens, identity_id=ident, owner=f"d{i}", thread="t", count=3, start=100 * i)]
    publish_windows(bootstrap, prefix, windows, partition=0)  # offsets 0..5: 4 + partial 2
    root = tmp_path / "dataset"
    worker = WorkerProcess(
        ["--teacher", str(teacher_dir), "--dataset", str(root), "--bootstrap-servers",
         bootstrap, "--prefix", prefix, "--offsets-per-shard", "4", "--row-group-rows", "4",
         "--batch-windows", "2", "--torch-threads", "1", "--drain", "--stall-timeout-s", "20"],
        # Its own home, but the key file the seal (this process) reads the shards with.
        log_path=tmp_path / "worker.log", env={"FLYWHEEL_HOME": str(tmp_path / "home"),
                                               "FLYWHEEL_KEK_FILE": str(default_kek_path())})
    try:
        deadline = time.monotonic() + 240
        while not list(iter_shards(root)) and worker.proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.3)
        time.sleep(25)  # > the stall timeout: the open partial block is not a stall
        assert worker.proc.poll() is None, worker.output()[-3000:]
        assert len(list(iter_shards(root))) == 1
        sealed = seal_epoch(SealConfig(dataset=root, epoch=0, bootstrap=bootstrap,
                                       timeout_s=120, override_parity="test: no holdout"))
        status = worker.wait(120)
    finally:
        worker.kill()
    out = worker.output()
    assert status == 0, out[-3000:]
    assert "drained: processed" in out and "final lag 0" in out, out[-3000:]
    assert read_health(tmp_path / "home", "replay") == []  # a clean exit leaves no record
    topic = prefix + window_topic("train")
    assert committed_offsets(bootstrap, prefix + "flywheel-replay", [(topic, 0)]) == {
        (topic, 0): 6}
    assert sealed.manifest["totals"]["windows"] == 6
    assert len(list(iter_shards(root))) == 2
    for dirpath, _, _ in os.walk(root):  # sealed epochs are read-only
        os.chmod(dirpath, 0o755)


def test_seal_refuses_rows_of_an_owner_who_revoked_after_replay(
        topic_factory: Any, teacher_dir: Path, tmp_path: Path) -> None:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher
    from hebrus_flywheel.train.data import Snapshot

    ident = str(build_runtime_identity(load_teacher(teacher_dir))["identity_id"])
    tokens = corpus_token_ids(teacher_dir)
    bootstrap, prefix = topic_factory.bootstrap, f"{topic_factory.prefix}revoked."
    topic_factory.create(catalogue(prefix))
    windows = [w for i in range(2) for w in thread_windows(
        tokens, identity_id=ident, owner=f"r{i}", thread="t", count=4, start=100 * i)]
    publish_windows(bootstrap, prefix, windows, partition=0)  # two whole blocks of 4
    root = tmp_path / "dataset"
    worker = WorkerProcess(
        ["--teacher", str(teacher_dir), "--dataset", str(root), "--bootstrap-servers",
         bootstrap, "--prefix", prefix, "--offsets-per-shard", "4", "--row-group-rows", "4",
         "--batch-windows", "2", "--torch-threads", "1", "--drain"],
        log_path=tmp_path / "worker.log", env={"FLYWHEEL_HOME": str(tmp_path / "home"),
                                               "FLYWHEEL_KEK_FILE": str(default_kek_path())})
    try:
        assert worker.wait(240) == 0, worker.output()[-3000:]
    finally:
        worker.kill()
    revoke_owners(bootstrap, ["r1"], prefix=prefix)  # after replay, before the seal
    sealed = seal_epoch(SealConfig(dataset=root, epoch=0, bootstrap=bootstrap,
                                   timeout_s=120, override_parity="test: no holdout"))
    consent = sealed.manifest["consent"]
    rows = sealed.manifest["totals"]["rows"]
    assert consent["rows"] == rows and consent["rows_refused"] == rows // 2
    assert consent["refused"] == {"train": {"r1": rows // 2}}
    assert consent["authorized_fraction"] == 0.5 and consent["owners_refused"] == 1
    snapshot = Snapshot(root / "epoch=0")  # every reader skips the refused rows
    assert snapshot.consent["rows_excluded"] == rows // 2
    owners = {o for unit in snapshot.units(["train"])
              for o in snapshot.read(unit, ["owner"]).column("owner").to_pylist()}
    assert owners == {"r0"}
    # `flywheel train|evaluate` ask the ledger the snapshot's prefix names, again
    from hebrus_flywheel.train.cli import consent_source
    from hebrus_flywheel.train.consent import check_ledger
    report = check_ledger(snapshot, ["train"], consent_source(root / "epoch=0", bootstrap, False))
    assert report["source"] == "ledger" and report["rows_excluded"] == rows // 2
    for dirpath, _, _ in os.walk(root):  # sealed epochs are read-only
        os.chmod(dirpath, 0o755)
