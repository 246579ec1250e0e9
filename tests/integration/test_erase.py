"""``flywheel erase`` over a real pipeline run: windows on the broker, a replay worker,
``flywheel seal``, stream-table changelogs and a trained-checkpoint lineage.

One canary owner publishes windows made of a canary token sequence, another owner
ordinary text. After the erasure (killed once half-way, then run again), the live
snapshot holds 0 rows of the canary owner and verifies with its keys, the other owner's
rows are all there, the owner's changelog keys are tombstoned, the owner's data key is
gone, the checkpoint that saw the rows is tainted and ``flywheel train --resume`` refuses
it, the receipt names the pseudonym only, and no file of the dataset, the erasure or the
checkpoints holds the canary in plaintext.

The windows go to the broker as the stream workers write them, sealed under each
owner's data key (``Window.v2``), and the scan over the broker's log directories of every
topic of the run finds 0 plaintext occurrences of the canary (the scanner finds it in a
plaintext file, so the scan is not vacuous). The capture side of the same proof (capture,
window, internal and changelog topics after a stream-worker run) is
``tests/integration/test_streams_sealed.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.consumers.seal import SealConfig, seal_epoch
from hebrus_flywheel.consumers.shards import iter_shards
from hebrus_flywheel.consumers.supersede import snapshot_owner_rows
from hebrus_flywheel.consumers.tombstones import owner_of_key, table_key
from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.canary import CanaryScanner
from hebrus_flywheel.core.privacy import (
    LocalOwnerKeyStore,
    OwnerKeyDestroyedError,
    Pseudonymizer,
)
from hebrus_flywheel.core.snapshot import default_kek_path, load_manifest, verify_snapshot
from hebrus_flywheel.streams.broker import BrokerConfig
from hebrus_flywheel.streams.owner_seal import OwnerSealer
from hebrus_flywheel.streams.topics import TopicSpec, catalogue
from tests.support.planted import make_writable
from tests.support.windows import (
    WorkerProcess,
    corpus_token_ids,
    publish_windows,
    thread_windows,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SEP = "\x1f"


def _canary(tokens: list[int], other: list[int]) -> list[int]:
    """Four real token ids in an order that never occurs in the other owner's text."""
    distinct = list(dict.fromkeys(tokens[200:400]))
    for start in range(0, len(distinct) - 4):
        pick = distinct[start:start + 4][::-1]
        text = ",".join(map(str, other))
        if ",".join(map(str, pick)) not in text:
            return pick
    raise AssertionError("no canary found")


def _changelog(factory: Any, prefix: str, owners: list[str]) -> str:
    topic = f"{prefix}erasetest-capture-state-changelog"
    factory.create([TopicSpec(name=topic, partitions=2, doc="test changelog",
                              cleanup_policy="compact")])
    producer = kafka.CheckedProducer(kafka.client_config(factory.bootstrap))
    for owner in owners:
        for kind in ("h", "t"):
            key = json.dumps(f"{kind}{SEP}{owner}{SEP}tthread{SEP}0").encode()
            producer.produce(topic, b'{"state": 1}', key=key)
    producer.produce(topic, b"7", key=json.dumps(f"c{SEP}p{SEP}x{SEP}0").encode())
    producer.flush(30)
    return topic


def _latest(bootstrap: str, topic: str) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for msg in kafka.read_to_end(kafka.client_config(bootstrap), [topic]):
        out[table_key(msg.key())] = msg.value()
    return out


def _erase(argv: list[str], env: dict[str, str], fault: str | None = None
           ) -> subprocess.CompletedProcess[str]:
    run_env = {**env, **({"FLYWHEEL_FAULT": fault} if fault else {})}
    return subprocess.run([sys.executable, "-m", "hebrus_flywheel.cli", *argv], env=run_env,
                          capture_output=True, text=True, timeout=600)


def test_erase_a_canary_owner_from_a_sealed_pipeline_run(
        topic_factory: Any, teacher_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher

    keys_dir = tmp_path / "owner-keys"
    monkeypatch.setenv("FLYWHEEL_OWNER_KEYS", str(keys_dir))
    store = LocalOwnerKeyStore(create=True)
    names = Pseudonymizer(store)
    canary_owner, other_owner = names.owner("canary-user"), names.owner("other-user")
    generation = store.data_key(canary_owner, create=True).generation
    store.data_key(other_owner, create=True)
    ident = str(build_runtime_identity(load_teacher(teacher_dir))["identity_id"])
    tokens = corpus_token_ids(teacher_dir)
    other_tokens = tokens[1000:1200]
    canary = _canary(tokens, other_tokens)
    bootstrap, prefix = topic_factory.bootstrap, f"{topic_factory.prefix}erase."
    topic_factory.create(catalogue(prefix))
    windows = thread_windows(canary * 30, identity_id=ident, owner=canary_owner,
                             thread=names.thread("canary-user", "c"), count=3)
    windows += thread_windows(other_tokens, identity_id=ident, owner=other_owner,
                              thread=names.thread("other-user", "o"), count=3)
    # as the stream workers write them: sealed under each owner's data key (Window.v2)
    publish_windows(bootstrap, prefix, windows, partition=0,
                    sealer=OwnerSealer(lambda: LocalOwnerKeyStore(keys_dir)))
    root = tmp_path / "dataset"
    worker = WorkerProcess(
        ["--teacher", str(teacher_dir), "--dataset", str(root), "--bootstrap-servers",
         bootstrap, "--prefix", prefix, "--offsets-per-shard", "4", "--row-group-rows", "4",
         "--batch-windows", "2", "--torch-threads", "1", "--drain", "--stall-timeout-s", "60"],
        log_path=tmp_path / "worker.log", env={"FLYWHEEL_HOME": str(tmp_path / "home"),
                                               "FLYWHEEL_KEK_FILE": str(default_kek_path())})
    try:
        deadline = time.monotonic() + 300
        while not list(iter_shards(root)) and worker.proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        sealed = seal_epoch(SealConfig(dataset=root, epoch=0, bootstrap=bootstrap,
                                       timeout_s=300, override_parity="test: no holdout"))
        assert worker.wait(120) == 0, worker.output()[-3000:]
    finally:
        worker.kill()
    run = PipelineRun(factory=topic_factory, tmp=tmp_path, root=root, keys=keys_dir,
                      sealed_id=sealed.snapshot_id, canary=canary, owner=canary_owner,
                      other=other_owner, generation=generation, prefix=prefix)
    try:
        _check_erasure(run)
    finally:
        make_writable(root)


@dataclass(frozen=True, kw_only=True)
class PipelineRun:
    """What the pipeline run left for the erasure checks."""

    factory: Any
    tmp: Path
    root: Path
    keys: Path
    sealed_id: str
    canary: list[int]
    owner: str
    other: str
    generation: int
    prefix: str


def _check_erasure(run: PipelineRun) -> None:
    tmp_path, root, canary_owner, other_owner = run.tmp, run.root, run.owner, run.other
    bootstrap, prefix = run.factory.bootstrap, run.prefix
    epoch = root / "epoch=0"
    before, total = snapshot_owner_rows(epoch, canary_owner)
    other_before = snapshot_owner_rows(epoch, other_owner)[0]
    assert before > 0 and other_before > 0
    changelog = _changelog(run.factory, prefix, [canary_owner, other_owner])
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "lineage.json").write_text(json.dumps(
        {"checkpoint_id": "c" * 64, "snapshot": {"snapshot_id": run.sealed_id}}))
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path / "erase-home"),
           "FLYWHEEL_KEK_FILE": str(default_kek_path()),
           "FLYWHEEL_OWNER_KEYS": str(run.keys)}
    argv = ["erase", "--owner", "canary-user", "--dataset", str(root), "--checkpoints",
            str(ck), "--grace", "0", "--bootstrap-servers", bootstrap, "--changelog-prefix",
            prefix, "--json"]
    killed = _erase(argv, env, fault="erase_between_renames")
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert not epoch.exists()  # killed with the old snapshot retired, the new not in place
    done = _erase(argv, env)
    assert done.returncode == 0, done.stderr[-3000:]
    receipt = json.loads(done.stdout)
    again = _erase(argv, env)
    assert json.loads(again.stdout) == receipt  # a rerun ends in the same receipt
    on_disk = (tmp_path / "erase-home" / "erasure" / canary_owner / "receipt.json").read_text()
    assert json.loads(on_disk) == receipt and "canary-user" not in on_disk
    # snapshots: 0 rows of the owner, every other row kept, verifies with its keys
    assert snapshot_owner_rows(epoch, canary_owner) == (0, total - before)
    assert snapshot_owner_rows(epoch, other_owner)[0] == other_before
    live = load_manifest(epoch)
    assert live["supersedes"] == run.sealed_id
    assert verify_snapshot(epoch, keys=True)["snapshot_id"] == live.snapshot_id
    assert receipt["owner"] == canary_owner
    assert receipt["owner_rows_before"] == before and receipt["owner_rows_after"] == 0
    assert receipt["snapshots"][0]["superseded_by"] == live.snapshot_id
    assert receipt["snapshots"][0]["verifies"] is True
    assert receipt["snapshots"][0]["superseded_files"]["state"] == "deleted"
    assert receipt["keys_destroyed"]["generations_destroyed"] == [run.generation]
    with pytest.raises(OwnerKeyDestroyedError):
        LocalOwnerKeyStore().data_key(canary_owner)
    # the stream state: the owner's keys tombstoned, the other owner's and counters kept
    assert receipt["changelog_tombstones"]["topics"] == {changelog: 2}
    latest = _latest(bootstrap, changelog)
    assert {k: v for k, v in latest.items() if owner_of_key(k) == canary_owner} == {
        f"h{SEP}{canary_owner}{SEP}tthread{SEP}0": None,
        f"t{SEP}{canary_owner}{SEP}tthread{SEP}0": None}
    assert all(v is not None for k, v in latest.items() if owner_of_key(k) != canary_owner)
    # the checkpoint that saw the rows is tainted; training refuses to resume from it
    assert [t["path"] for t in receipt["tainted_checkpoints"]] == [str(ck.resolve())]
    refused = _erase(["train", "--snapshot", str(epoch), "--out", str(tmp_path / "new-ck"),
                      "--resume", str(ck), "--no-progress"], env)
    assert refused.returncode == 2 and "tainted" in refused.stderr, refused.stderr[-2000:]
    _scan(run, env, receipt)


def _scan(run: PipelineRun, env: dict[str, str], receipt: dict[str, Any]) -> None:
    tmp_path, canary = run.tmp, run.canary
    scanner = CanaryScanner(canary)
    # the broker's log segments of every topic of the run (windows, quarantine, control,
    # consent): the windows were sealed under the owner's key, now destroyed
    topic_dirs = sorted(BrokerConfig().data_dir.glob(f"{run.prefix}*"))
    assert topic_dirs, "no log directories of the run's topics"
    broker = scanner.scan(topic_dirs)
    print(f"broker log canary hits over {broker.files} files: {len(broker.hits)}")
    assert broker.hits == [] and broker.files > 0, broker.to_json()
    # ... while the scan finds the canary where it is plaintext (not vacuous)
    plain = tmp_path / "plaintext-canary.bin"
    plain.write_bytes(b"".join(t.to_bytes(4, "little") for t in canary))
    assert scanner.scan([plain]).hits
    # every file of the dataset, the erasure, the checkpoints, the worker's home and log
    scanned = [run.root, tmp_path / "erase-home", tmp_path / "ck", tmp_path / "home",
               tmp_path / "worker.log"]
    result = scanner.scan(scanned)
    assert result.hits == [] and result.unreadable == [], result.to_json()
    assert result.files > 0
    cli = _erase(["erase", "--scan-canary", ",".join(map(str, canary)), "--owner-pseudonym",
                  run.owner, "--dataset", str(run.root), "--json",
                  *[a for p in scanned for a in ("--scan-root", str(p))]], env)
    report = json.loads(cli.stdout)
    assert cli.returncode == 0 and report["hits"] == 0 and report["owner_rows_live"] == 0, \
        cli.stderr[-2000:]
    assert receipt["owner_rows_after"] == 0
