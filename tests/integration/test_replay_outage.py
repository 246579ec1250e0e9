"""``flywheel replay worker --drain`` through a broker outage mid-epoch.

The embedded broker of this FLYWHEEL_HOME (never an external cluster) is stopped while
the worker is between shards, for more than three consumer session timeouts, and
started again. Invariant 11: the worker either resumes and exits 0 at lag 0, or exits
non-zero within its stall timeout plus 60 s of the broker's return; it never hangs and
never exits 0 with lag. A restarted worker then writes exactly the shards (bytes and
rows) of a fault-free run: nothing lost, nothing twice.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest

from hebrus_flywheel.consumers.kafka_io import committed_offsets, end_offsets
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core.progress import WatchdogConfig, read_health
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV
from hebrus_flywheel.core.snapshot import default_kek_path
from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker
from hebrus_flywheel.streams.topics import SPLITS, catalogue, window_topic
from tests.support.plaintext import plaintext_copy, plaintext_digests
from tests.support.windows import (
    WorkerProcess,
    corpus_token_ids,
    publish_windows,
    thread_windows,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(bool(os.environ.get(BOOTSTRAP_ENV)),
                                 reason="stops the embedded broker; never an external cluster")]

SHARD = ShardConfig(offsets_per_shard=4, row_group_rows=4)
SESSION_S = 6.0  # the broker's group.min.session.timeout.ms
STALL_S = 30.0
BLOCKS = 10  # 40 windows on partition 0: ten shards of four


@pytest.fixture(scope="module")
def teacher(teacher_dir: Path) -> Any:
    from hebrus_flywheel.replay.teacher import load_teacher

    return load_teacher(teacher_dir)


@pytest.fixture(scope="module")
def windows(teacher: Any, teacher_dir: Path) -> list[dict[str, Any]]:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity

    identity_id = str(build_runtime_identity(teacher)["identity_id"])
    tokens = corpus_token_ids(teacher_dir)
    return [w for i in range(BLOCKS) for w in thread_windows(
        tokens, identity_id=identity_id, owner=f"u{i}", thread="t", count=4, start=90 * i)]


def shard_digests(root: Path) -> dict[str, str]:
    """Plaintext digests: shards are encrypted with fresh data keys on every write."""
    return plaintext_digests(root)


def shard_rows(root: Path) -> list[tuple[Any, ...]]:
    plain = plaintext_copy(root, root.parent / f"{root.name}-plaintext")  # DuckDB: no keys
    return duckdb.sql(
        f"SELECT split, window_id, token_ordinal, source_offset FROM read_parquet("
        f"'{plain}/epoch=*/split=*/*.parquet', hive_partitioning=true) "
        "ORDER BY split, source_offset, token_ordinal").fetchall()


def _reference(teacher: Any, teacher_dir: Path, bootstrap: str, prefix: str,
               root: Path) -> None:
    worker = ReplayWorker(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=root, bootstrap=bootstrap, prefix=prefix,
        group_id="reference", shard=SHARD, batch_windows=2, torch_threads=1,
        watchdog=WatchdogConfig(drain=True)), teacher=teacher)
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive() and worker.drained, "the fault-free run did not drain"


def _args(teacher_dir: Path, root: Path, bootstrap: str, prefix: str) -> list[str]:
    return ["--teacher", str(teacher_dir), "--dataset", str(root), "--bootstrap-servers",
            bootstrap, "--prefix", prefix, "--group-id", "outage", "--offsets-per-shard", "4",
            "--row-group-rows", "4", "--batch-windows", "2", "--torch-threads", "1",
            "--drain", "--session-timeout-s", str(SESSION_S), "--stall-timeout-s",
            str(STALL_S), "--broker-timeout-s", "120", "--instance-id", "outage-0"]


def _lag(bootstrap: str, prefix: str) -> int:
    ends = {(t, p): e for t, parts in end_offsets(
        bootstrap, [prefix + window_topic(s) for s in SPLITS]).items() for p, e in parts.items()}
    committed = committed_offsets(bootstrap, prefix + "outage", list(ends))
    return sum(max(0, end - max(committed.get(tp, 0), 0)) for tp, end in ends.items())


def _wait_for(pred: Any, timeout_s: float, what: str, proc: WorkerProcess) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what}: worker exit {proc.proc.poll()}\n{proc.output()[-3000:]}")
        time.sleep(0.2)


def _exit_status(proc: WorkerProcess, timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except Exception:
        proc.kill()
        pytest.fail(f"worker did not exit within {timeout_s:.0f}s (hang):\n"
                    + proc.output()[-3000:])


def test_broker_outage_mid_epoch_then_restart_gives_the_fault_free_rows(
        topic_factory: Any, teacher: Any, teacher_dir: Path, windows: list[dict[str, Any]],
        tmp_path: Path) -> None:
    bootstrap = topic_factory.bootstrap
    broker = EmbeddedBroker(BrokerConfig())
    assert broker.config.bootstrap == bootstrap
    outage_s = float(os.environ.get("FLYWHEEL_TEST_OUTAGE_S") or 3.5 * SESSION_S)
    prefix = f"{topic_factory.prefix}outage."
    topic_factory.create(catalogue(prefix))
    publish_windows(bootstrap, prefix, windows, partition=0)
    _reference(teacher, teacher_dir, bootstrap, prefix, tmp_path / "reference")
    reference = shard_digests(tmp_path / "reference")
    assert len(reference) == BLOCKS

    # The worker's own home, but the test's key file: the test reads its shards' footers.
    root, env = tmp_path / "outage", {"FLYWHEEL_HOME": str(tmp_path / "home"),
                                      "FLYWHEEL_KEK_FILE": str(default_kek_path())}
    args = _args(teacher_dir, root, bootstrap, prefix)
    first = WorkerProcess(args, log_path=tmp_path / "worker-0.log", env=env)
    _wait_for(lambda: len(shard_digests(root)) >= 1, 240, "first shard", first)
    written = len(shard_digests(root))
    broker.down()
    try:
        time.sleep(outage_s)
    finally:
        broker.up()
    back = time.monotonic()
    rc = _exit_status(first, STALL_S + 60 + 120)
    waited = time.monotonic() - back
    first.kill()
    if rc == 0:
        assert _lag(bootstrap, prefix) == 0, "exit 0 with lag"
    else:
        assert waited <= STALL_S + 60, f"exit {rc} came {waited:.0f}s after the broker"
    print(f"outage {outage_s:.0f}s after {written}/{BLOCKS} shards: first worker exit {rc} "
          f"{waited:.0f}s after the broker returned, {len(shard_digests(root))} shards")

    again = WorkerProcess(args, log_path=tmp_path / "worker-1.log", env=env)
    rc2 = _exit_status(again, 240)
    again.kill()
    assert rc2 == 0, again.output()[-3000:]
    assert read_health(tmp_path / "home", "replay") == []  # a clean exit leaves no record
    assert _lag(bootstrap, prefix) == 0
    assert shard_digests(root) == reference
    rows = shard_rows(root)
    assert len(set(rows)) == len(rows) == len(windows) * 6
    assert rows == shard_rows(tmp_path / "reference")
