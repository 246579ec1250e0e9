"""Snapshots on S3-compatible storage, against the real SeaweedFS (TLS, SigV4, per-role keys).

One scenario per module: a replay worker (real teacher, real prefill engine) writes epoch
0 while ``seal_epoch`` seals it with ``snapshot_root=s3://...``: the local seal as always,
then the publication (claim, shards, manifest last). The published objects are compared
byte for byte with the local seal of the same input; readers (verify, the train CLI, the
lazy shard reader, DuckDB through the checked plaintext export) and the rebuild work from
the ``s3://`` URL; a crash between the shard uploads and the manifest leaves no sealed
snapshot and a re-run completes it; a second snapshot of the epoch, a wrong secret key and
writes with the read-only role are refused; the server itself refuses a second
conditional manifest, anonymous and plain-HTTP requests, and keeps its internal ports on
loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pytest
import typer
from typer.testing import CliRunner

from hebrus_flywheel.consumers.exceptions import PublishError
from hebrus_flywheel.consumers.publish import CLAIMS, publish_epoch
from hebrus_flywheel.consumers.rebuild import RebuildConfig, rebuild_snapshot
from hebrus_flywheel.consumers.seal import SealConfig, SealResult, seal_epoch
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core.jsonio import canonical_json
from hebrus_flywheel.core.snapshot import (
    ManifestError,
    VerifyError,
    content_digest,
    load_manifest,
    manifest_digest,
    open_snapshot,
    verify_snapshot,
)
from hebrus_flywheel.core.snapshot.export import export_plaintext
from hebrus_flywheel.core.snapshot.remote import fetch_snapshot
from hebrus_flywheel.core.storage import (
    READ_ROLE,
    WRITE_ROLE,
    S3Store,
    S3Target,
    StorageError,
    s3_target,
)
from hebrus_flywheel.streams.topics import catalogue
from tests.support.planted import make_writable
from tests.support.windows import corpus_token_ids, holdout_window, publish_windows, thread_windows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONSUMERS_CLI = (sys.executable, "-m", "hebrus_flywheel.consumers")


@dataclass
class Scenario:
    bootstrap: str
    root: Path
    s3: str
    teacher_dir: Path
    teacher: Any
    sealed: SealResult

    @property
    def url(self) -> str:
        return f"{self.s3}/epoch=0"

    @property
    def local(self) -> Path:
        return self.sealed.manifest_path.parent


@pytest.fixture(scope="module")
def scenario(topic_factory: Any, teacher_dir: Path, s3_root: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher

    teacher = load_teacher(teacher_dir)
    ident = str(build_runtime_identity(teacher)["identity_id"])
    tokens = corpus_token_ids(teacher_dir)
    bootstrap, prefix = topic_factory.bootstrap, f"{topic_factory.prefix}s3."
    topic_factory.create(catalogue(prefix))
    root = tmp_path_factory.mktemp("s3seal") / "dataset"
    windows = [w for i in range(3) for w in thread_windows(
        tokens, identity_id=ident, owner=f"o{i}", thread="t", start=120 * i,
        split="train" if i < 2 else "validation")]
    holdout = [holdout_window(teacher, tokens[1000 + 70 * i:1040 + 70 * i], identity_id=ident,
                              owner=f"h{i}", thread="t") for i in range(2)]
    publish_windows(bootstrap, prefix, windows + holdout)
    worker = ReplayWorker(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=root, bootstrap=bootstrap, prefix=prefix,
        shard=ShardConfig(offsets_per_shard=2), batch_windows=2, torch_threads=1,
        control_sync_s=0.3), teacher=teacher)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        sealed = seal_epoch(SealConfig(dataset=root, epoch=0, bootstrap=bootstrap,
                                       timeout_s=180, snapshot_root=f"{s3_root}/seal"))
    finally:
        worker.stop()
        thread.join(timeout=120)
    yield Scenario(bootstrap=bootstrap, root=root, s3=f"{s3_root}/seal",
                   teacher_dir=teacher_dir, teacher=teacher, sealed=sealed)
    make_writable(root)


def _local_files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in directory.rglob("*") if p.is_file()}


def _store(url: str, role: str = WRITE_ROLE) -> S3Store:
    return S3Store(url, s3_target(role))


def test_the_published_snapshot_is_byte_identical_to_the_local_seal(scenario: Scenario) -> None:
    assert scenario.sealed.published is not None
    assert scenario.sealed.published.url == scenario.url
    store = _store(scenario.s3, READ_ROLE)
    remote = {k[len("epoch=0/"):]: store.get_bytes(k) for k in store.objects("epoch=0/")}
    local = _local_files(scenario.local)
    assert len(local) == len(scenario.sealed.manifest["shards"]) + 1
    assert remote == local
    assert store.objects(CLAIMS) == {}  # the claim was released
    again = seal_epoch(SealConfig(dataset=scenario.root, epoch=0, bootstrap=scenario.bootstrap,
                                  snapshot_root=scenario.s3))
    assert again.already_sealed and again.published is not None
    assert again.published.already_published


def test_verify_train_and_duckdb_read_the_snapshot_from_s3(scenario: Scenario,
                                                          tmp_path: Path) -> None:
    from hebrus_flywheel.train.cli import train_command

    manifest = scenario.sealed.manifest
    summary = verify_snapshot(scenario.url, keys=True)
    assert summary["snapshot_id"] == scenario.sealed.snapshot_id and summary["plaintext_checked"]
    cli = subprocess.run([*CONSUMERS_CLI, "verify", scenario.url, "--json"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout)["location"] == scenario.url
    sealed = open_snapshot(scenario.url, expected_id=scenario.sealed.snapshot_id)
    rows = sum(sealed.read_shard(i, ["window_id"]).num_rows
               for i in range(len(sealed.manifest.shards)))
    assert rows == manifest["totals"]["rows"]
    plain = tmp_path / "plain"
    export_plaintext(scenario.url, plain)
    got = dict(duckdb.sql(f"SELECT split, count(*) FROM read_parquet('{plain}/split=*/*.parquet',"
                          " hive_partitioning=true) GROUP BY split").fetchall())
    assert got == {s: v["rows"] for s, v in manifest["splits"].items()}
    app = typer.Typer()
    app.command("train")(train_command)
    app.command("noop")(lambda: None)
    done = CliRunner().invoke(app, ["train", "--snapshot", scenario.url, "--out",
                                    str(tmp_path / "ck"), "--max-steps", "2", "--threads", "1",
                                    "--workers", "0", "--no-progress", "--no-consent-ledger"])
    assert done.exit_code == 0, done.output
    lineage = json.loads((tmp_path / "ck" / "lineage.json").read_text())
    assert scenario.sealed.snapshot_id in json.dumps(lineage)


def test_torchrun_with_two_ranks_trains_from_the_s3_snapshot(scenario: Scenario,
                                                             tmp_path: Path) -> None:
    """Both ranks open the s3:// epoch (one checked cache per snapshot id) and train."""
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "hebrus_flywheel.train.cli", "train", "--snapshot", scenario.url, "--out",
         str(out), "--max-steps", "2", "--threads", "1", "--workers", "0", "--no-progress",
         "--no-consent-ledger"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
        cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["world_size"] == 2
    assert scenario.sealed.snapshot_id in json.dumps(lineage)


def test_checkpoints_are_published_to_s3_read_back_and_tainted_there(
        scenario: Scenario, tmp_path: Path) -> None:
    """train --out s3:// stages locally and publishes (lineage last) into the checkpoint
    bucket, the only one the trainer may write; evaluate and --resume read it back; a
    taint recorded by an erasure on the staged copy reaches the published one."""
    from hebrus_flywheel.core.storage.config import CHECKPOINT_BUCKET
    from hebrus_flywheel.core.taint import TaintedCheckpointError, add_taint, taint_published
    from hebrus_flywheel.train.cli import evaluate_command, train_command
    from hebrus_flywheel.train.remote_checkpoint import fetch_checkpoint, staging_dir

    url = f"s3://{CHECKPOINT_BUCKET}/t-{uuid.uuid4().hex[:12]}/run"
    app = typer.Typer()
    app.command("train")(train_command)
    app.command("evaluate")(evaluate_command)
    common = ["--max-steps", "2", "--threads", "1", "--workers", "0", "--no-progress",
              "--no-consent-ledger"]
    done = CliRunner().invoke(app, ["train", "--snapshot", scenario.url, "--out", url,
                                    *common])
    assert done.exit_code == 0, done.output
    assert f"published checkpoint.pt, history.jsonl, lineage.json to {url}" in done.output
    store = _store(url, READ_ROLE)
    assert set(store.objects("")) == {"checkpoint.pt", "history.jsonl", "lineage.json"}
    staged = staging_dir(url)
    assert store.get_bytes("lineage.json") == (staged / "lineage.json").read_bytes()
    report = tmp_path / "report.json"
    done = CliRunner().invoke(app, ["evaluate", "--snapshot", scenario.url, "--checkpoint",
                                    url, "--out", str(report), "--no-progress",
                                    "--no-consent-ledger"])
    assert done.exit_code == 0, done.output
    lineage = json.loads((staged / "lineage.json").read_text())
    assert lineage["checkpoint_id"] in report.read_text()
    again = CliRunner().invoke(app, ["train", "--snapshot", scenario.url, "--out",
                                     str(tmp_path / "resumed"), "--resume", url, *common])
    assert again.exit_code == 0, again.output
    resumed = json.loads((tmp_path / "resumed" / "lineage.json").read_text())
    assert lineage["checkpoint_id"] in json.dumps(resumed)
    add_taint(staged, {"owner": "pseudonym", "snapshots": [scenario.sealed.snapshot_id],
                       "receipt": "test"})
    assert taint_published(staged) == url
    fetched = fetch_checkpoint(url)
    assert (fetched / "tainted.json").is_file()
    tainted = CliRunner().invoke(app, ["train", "--snapshot", scenario.url, "--out",
                                       str(tmp_path / "refused"), "--resume", url, *common])
    assert tainted.exit_code != 0
    assert isinstance(tainted.exception, TaintedCheckpointError), tainted.output
    with pytest.raises(StorageError, match="read-only"):  # no write outside its bucket
        _store(scenario.s3, READ_ROLE).put_bytes("epoch=9/x", b"x")
    store_w = _store(url, WRITE_ROLE)
    store_w.delete(list(store_w.objects("")))


def _copy_to(scenario: Scenario, name: str) -> tuple[S3Store, str]:
    """The sealed epoch's objects under another prefix (to damage them there)."""
    url = f"{scenario.s3}-{name}/epoch=0"
    store = _store(url)
    for rel, data in _local_files(scenario.local).items():
        store.put_bytes(rel, data)
    return store, url


def test_damage_on_s3_is_refused_by_verify_and_readers(scenario: Scenario,
                                                      tmp_path: Path) -> None:
    """(A reader holding a checked cache of the same snapshot id keeps using it; a reader
    without one downloads, checks and refuses.)"""
    shard = scenario.sealed.manifest["shards"][0]["path"]
    store, url = _copy_to(scenario, "flip")
    data = bytearray(store.get_bytes(shard) or b"")
    data[100] ^= 0x80
    store.put_bytes(shard, bytes(data))
    with pytest.raises(VerifyError, match="SHA-256"):
        verify_snapshot(url)
    with pytest.raises(VerifyError, match="SHA-256"):
        fetch_snapshot(url, cache=tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*/manifest.json"))
    store, url = _copy_to(scenario, "extra")
    store.put_bytes("split=train/stray.parquet", b"PAR1")
    cli = subprocess.run([*CONSUMERS_CLI, "verify", url], capture_output=True, text=True,
                         timeout=120, check=False)
    assert cli.returncode == 2 and "extra file split=train/stray.parquet" in cli.stderr


def test_a_crash_between_shards_and_manifest_leaves_no_sealed_snapshot(
        scenario: Scenario) -> None:
    root = f"{scenario.s3}-crash"
    cmd = [*CONSUMERS_CLI, "seal", "--epoch", "0", "--dataset", str(scenario.root),
           "--bootstrap-servers", scenario.bootstrap, "--snapshot-root", root]
    crashed = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                             env={**os.environ, "FLYWHEEL_FAULT": "publish_before_manifest"})
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    store = _store(root, READ_ROLE)
    uploaded = store.objects("epoch=0/")
    assert len(uploaded) == len(scenario.sealed.manifest["shards"])  # every shard, no manifest
    with pytest.raises(ManifestError, match="not sealed"):
        open_snapshot(f"{root}/epoch=0")
    with pytest.raises(VerifyError, match="not sealed"):
        verify_snapshot(f"{root}/epoch=0")
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"published    {root}/epoch=0" in resumed.stdout
    assert verify_snapshot(f"{root}/epoch=0")["snapshot_id"] == scenario.sealed.snapshot_id
    assert store.objects(CLAIMS) == {}


def _other_snapshot(scenario: Scenario, tmp_path: Path) -> Path:
    """Another valid snapshot of epoch 0 (same shards, another parity override)."""
    other = tmp_path / "other" / "epoch=0"
    shutil.copytree(scenario.local, other)
    make_writable(other)
    manifest = load_manifest(other).to_dict()
    manifest["parity_override"] = {"reason": "a second sealer"}
    manifest["content_id"] = content_digest(manifest)
    manifest["snapshot_id"] = manifest_digest(manifest)
    (other / "manifest.json").write_bytes(canonical_json(manifest))
    return other


def test_a_second_snapshot_cannot_seal_the_same_epoch(scenario: Scenario,
                                                       tmp_path: Path) -> None:
    other = _other_snapshot(scenario, tmp_path)
    with pytest.raises(PublishError, match=f"already sealed as snapshot "
                                           f"{scenario.sealed.snapshot_id}"):
        publish_epoch(other, scenario.s3)
    assert verify_snapshot(scenario.url)["snapshot_id"] == scenario.sealed.snapshot_id
    race = f"{scenario.s3}-race"
    outcome: dict[str, object] = {}

    def seal(name: str, directory: Path) -> None:
        try:
            outcome[name] = publish_epoch(directory, race).snapshot_id
        except PublishError as exc:
            outcome[name] = exc

    threads = [threading.Thread(target=seal, args=a)
               for a in (("ours", scenario.local), ("other", other))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [v for v in outcome.values() if isinstance(v, str)]
    assert len(winners) <= 1, outcome
    if winners:
        assert verify_snapshot(f"{race}/epoch=0")["snapshot_id"] == winners[0]


def test_a_wrong_secret_key_and_writes_by_the_read_only_role_are_refused(
        scenario: Scenario) -> None:
    good = s3_target(WRITE_ROLE)
    wrong = S3Target(endpoint=good.endpoint, access_key=good.access_key,
                     secret_key=good.secret_key[::-1], ca_bundle=good.ca_bundle, role=WRITE_ROLE)
    with pytest.raises(StorageError, match="SignatureDoesNotMatch"):
        S3Store(scenario.s3, wrong).objects("")
    with pytest.raises(StorageError, match="SignatureDoesNotMatch"):
        S3Store(scenario.s3, wrong).put_bytes("epoch=9/x", b"x")
    reader = _store(scenario.s3, READ_ROLE)
    with pytest.raises(StorageError, match="read-only"):
        reader.put_bytes("epoch=9/x", b"x")
    with pytest.raises(StorageError, match="cannot delete"):
        reader.delete(["epoch=0/manifest.json"])
    untrusted = S3Target(endpoint=good.endpoint, access_key=good.access_key,
                         secret_key=good.secret_key, ca_bundle=None, role=WRITE_ROLE)
    with pytest.raises(StorageError, match=r"SSL|certificate"):
        S3Store(scenario.s3, untrusted).objects("")
    assert reader.get_bytes("epoch=0/manifest.json") is not None


def test_the_store_refuses_a_second_conditional_put_at_the_server(scenario: Scenario) -> None:
    """``If-None-Match: *`` is enforced by SeaweedFS itself (412), so the manifest is the
    commit point even without the claim step."""
    writer = _store(scenario.s3, WRITE_ROLE)
    key = f"conditional/{uuid.uuid4().hex}/manifest.json"
    assert writer.put_bytes(key, b"first", if_absent=True) is True
    assert writer.put_bytes(key, b"second", if_absent=True) is False
    assert writer.get_bytes(key) == b"first"
    writer.delete([key])


def test_anonymous_plain_http_and_outside_access_are_refused(scenario: Scenario) -> None:
    import requests

    from hebrus_flywheel.core.storage.config import security_dir, storage_port
    from hebrus_flywheel.streams.storage_server import EmbeddedStorage, embedded_layout

    port = storage_port()
    url = f"https://127.0.0.1:{port}/{scenario.s3.removeprefix('s3://')}/epoch=0/manifest.json"
    anonymous = requests.get(url, verify=str(security_dir() / "ca.crt"), timeout=10)
    assert anonymous.status_code == 403 and b"AccessDenied" in anonymous.content
    assert b"snapshot_id" not in anonymous.content
    plain = requests.get(f"http://127.0.0.1:{port}/{scenario.s3.removeprefix('s3://')}/",
                         timeout=10)
    assert plain.status_code == 400 and b"HTTPS server" in plain.content  # TLS only
    pid = EmbeddedStorage().pid()
    assert pid is not None
    listening = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    ours = [line.split()[3] for line in listening if f"pid={pid}," in line]
    assert {a.rsplit(":", 1)[1] for a in ours} >= {str(p) for p in embedded_layout().ports()}
    assert all(a.startswith("127.0.0.1:") for a in ours), ours


def test_rebuild_from_s3_is_plaintext_identical_to_the_local_seal(scenario: Scenario,
                                                                 tmp_path: Path) -> None:
    report = rebuild_snapshot(RebuildConfig(
        snapshot=scenario.url, out=tmp_path / "rebuilt", teacher=scenario.teacher_dir,
        bootstrap=scenario.bootstrap), teacher=scenario.teacher)
    assert report["identical"] and report["content_id_match"], report["differences"]
    local = {s["path"]: s["plaintext_sha256"] for s in scenario.sealed.manifest["shards"]}
    rebuilt = {e.path: e.plaintext_sha256 for e in load_manifest(Path(report["out"])).shards}
    assert rebuilt == local
    assert verify_snapshot(Path(report["out"]), keys=True)["content_id"] == \
        scenario.sealed.manifest["content_id"]


def test_expire_and_a_superseding_snapshot_on_s3(scenario: Scenario, tmp_path: Path) -> None:
    """Expiry unseals (manifest first) and deletes the older epoch, keeping the newest; a
    snapshot that supersedes the published one (what `flywheel erase` writes) replaces it."""
    from hebrus_flywheel.consumers.expire_remote import expire_published

    root = f"{scenario.s3}-expire"
    store = _store(root)
    for epoch in (0, 1):
        for rel, data in _local_files(scenario.local).items():
            store.put_bytes(f"epoch={epoch}/{rel}", data)
    result = expire_published(root, older_than_ms=1, keep=1, now_s=time.time() + 3600)
    assert {e.epoch: e.state for e in result.epochs} == {1: "kept", 0: "removed"}
    assert not any(k.startswith("epoch=0/") for k in store.objects(""))
    with pytest.raises(VerifyError, match="not sealed"):
        verify_snapshot(f"{root}/epoch=0")
    new = _other_snapshot(scenario, tmp_path)
    manifest = load_manifest(new).to_dict()
    manifest.pop("parity_override")
    manifest["parity_override"] = scenario.sealed.manifest["parity_override"]
    manifest["supersedes"] = scenario.sealed.snapshot_id
    manifest["content_id"] = content_digest(manifest)
    manifest["snapshot_id"] = manifest_digest(manifest)
    (new / "manifest.json").write_bytes(canonical_json(manifest))
    target = f"{scenario.s3}-supersede"
    publish_epoch(scenario.local, target)
    published = publish_epoch(new, target)
    summary = verify_snapshot(f"{target}/epoch=0")
    assert summary["snapshot_id"] == published.snapshot_id == manifest["snapshot_id"]
    with pytest.raises(PublishError, match="already sealed"):
        publish_epoch(scenario.local, target)  # the superseded snapshot never comes back
