"""``flywheel rebuild --from-capture`` over the whole chain on the real broker.

Synthetic threads are decoded by the real teacher and published by the real capture
path; the stream worker (a subprocess run with ``--drain``) cuts them into windows, in two
runs with different configurations (the second sends every new thread to the temporal
holdout); a replay worker writes shards and epoch 0 is sealed; then more threads are
captured. The rebuild re-runs the capture topics up to the recorded offsets through the
in-memory stream chain, one segment per run configuration, finds every sealed window
again (same id, same content digest) and replays the fresh windows into shards whose
plaintext encodings are byte-identical (the ciphertext uses fresh data keys).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.consumers.capture_check import check_windows, regenerate
from hebrus_flywheel.consumers.exceptions import RebuildError
from hebrus_flywheel.consumers.kafka_io import end_offsets, read_ranges
from hebrus_flywheel.consumers.rebuild import RebuildConfig, rebuild_snapshot
from hebrus_flywheel.consumers.seal import SealConfig, SealResult, seal_epoch
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core.snapshot import verify_snapshot
from hebrus_flywheel.replay.capture import CaptureConfig
from hebrus_flywheel.replay.capture_cli import run_capture
from hebrus_flywheel.replay.synthetic import generate_threads
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.processors.runs import group_members, read_runs
from hebrus_flywheel.streams.topics import OBSERVATIONS_TOPIC, STREAMS_RUNS_TOPIC
from tests.support.consent import grant_owners
from tests.support.streams_harness import WorkerProcess, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP_ID = "flywheel-streams"
# The second streams run: every new thread that is no runtime holdout is temporal.
SECOND_RUN = {"temporal_cut_ms": 0, "runtime_holdout_fraction": 0.0}


@dataclass
class Chain:
    bootstrap: str
    prefix: str
    teacher_dir: Path
    teacher: Any
    sealed: SealResult


def _run_streams(bootstrap: str, prefix: str, tmp: Path, flags: dict[str, Any],
                 name: str) -> None:
    worker = WorkerProcess(bootstrap=bootstrap, prefix=prefix, app_id=APP_ID,
                           log_path=tmp / f"{name}.log", home=tmp / "home", flags=flags,
                           extra=["--drain"]).start()
    try:
        if worker.proc is not None:
            worker.proc.wait(timeout=120)
    finally:
        worker.stop()
    log = (tmp / f"{name}.log").read_text(encoding="utf-8", errors="replace")
    if worker.proc is None or worker.proc.returncode != 0:
        pytest.fail(f"stream worker failed:\n{log[-3000:]}")


def _capture(bootstrap: str, prefix: str, teacher_dir: Path, seed: int) -> None:
    threads = [dataclasses.replace(t, thread_id=f"s{seed}-{t.thread_id}")
               for t in generate_threads(4, seed=seed)]
    grant_owners(bootstrap, {t.owner for t in threads}, prefix=prefix)
    run_capture(teacher_dir=teacher_dir, threads=threads,
                config=CaptureConfig(mode="forced", interleave=2), bootstrap=bootstrap,
                topic_prefix=prefix, create_topics=False)


def _replay_and_seal(bootstrap: str, prefix: str, teacher_dir: Path, teacher: Any,
                     root: Path) -> SealResult:
    worker = ReplayWorker(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=root, bootstrap=bootstrap, prefix=prefix,
        shard=ShardConfig(offsets_per_shard=2), batch_windows=2, torch_threads=1,
        control_sync_s=0.3), teacher=teacher)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        return seal_epoch(SealConfig(dataset=root, epoch=0, bootstrap=bootstrap, timeout_s=120,
                                     override_parity="capture test: parity not under test"))
    finally:
        worker.stop()
        thread.join(timeout=120)


@pytest.fixture(scope="module")
def chain(topic_factory: Any, teacher_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    from hebrus_flywheel.replay.teacher import load_teacher

    bootstrap = topic_factory.bootstrap
    prefix, _ = topic_factory.streams_namespace("cap", APP_ID)
    tmp = tmp_path_factory.mktemp("from-capture")
    _capture(bootstrap, prefix, teacher_dir, seed=11)
    _run_streams(bootstrap, prefix, tmp, {}, "streams-1")
    _capture(bootstrap, prefix, teacher_dir, seed=12)
    _run_streams(bootstrap, prefix, tmp, SECOND_RUN, "streams-2")
    teacher = load_teacher(teacher_dir)
    root = tmp / "dataset"
    sealed = _replay_and_seal(bootstrap, prefix, teacher_dir, teacher, root)
    _capture(bootstrap, prefix, teacher_dir, seed=13)  # after the seal: not in the epoch
    yield Chain(bootstrap=bootstrap, prefix=prefix, teacher_dir=teacher_dir, teacher=teacher,
                sealed=sealed)
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)


def test_rebuild_from_capture_regenerates_every_window_and_identical_shards(
    chain: Chain, tmp_path: Path,
) -> None:
    manifest = chain.sealed.manifest
    records = sum(r["end"] for t in manifest["source"]["topics"].values()
                  for r in t["partitions"].values())
    assert records > 0 and manifest["shards"], "the stream worker produced no windows"
    report = rebuild_snapshot(RebuildConfig(
        snapshot=chain.sealed.manifest_path.parent, out=tmp_path / "rebuilt",
        teacher=chain.teacher_dir, bootstrap=chain.bootstrap, from_capture=True),
        teacher=chain.teacher)
    assert report["identical"] and report["content_id_match"], report["differences"]
    assert report["capture_windows_missing"] == []
    assert report["capture_windows_digest_mismatch"] == []
    assert report["capture_windows_regenerated"] == records
    assert report["capture_segments"] == 2
    ends = report["capture_end_offsets"]
    assert set(ends) == {chain.prefix + f"flywheel.capture.{k}.v1"
                         for k in ("identities", "transcripts", "observations")}
    assert all(sum(parts.values()) > 0 for parts in ends.values())
    recorded = manifest["source"]["capture"]["end"]
    assert {t: {int(p): o for p, o in v.items()} for t, v in ends.items()} == {
        t: {int(p): o for p, o in v.items()} for t, v in recorded.items()}
    now = end_offsets(chain.bootstrap, ends)
    assert sum(map(sum, (v.values() for v in now.values()))) > sum(
        map(sum, (v.values() for v in recorded.values()))), "capture after the seal is unread"
    rebuilt = verify_snapshot(Path(report["out"]), keys=True)
    assert rebuilt["content_id"] == manifest["content_id"]
    assert rebuilt["snapshot_id"] != chain.sealed.snapshot_id  # fresh ciphertext


def test_both_stream_configurations_are_recorded_and_shape_the_snapshot(chain: Chain) -> None:
    runs = chain.sealed.manifest["source"]["capture"]["streams_runs"]
    assert [r["config"]["split"]["temporal_cut_ms"] for r in runs] == [None, 0]
    assert runs[0]["config_id"] != runs[1]["config_id"]
    assert sum(runs[1]["capture_start"][chain.prefix + OBSERVATIONS_TOPIC].values()) > 0
    windows = {s: v["windows"] for s, v in chain.sealed.manifest["splits"].items()}
    assert windows.get("temporal_holdout", 0) > 0, windows  # the second run's threads
    assert sum(windows.values()) > windows.get("temporal_holdout", 0), windows  # the first's


def test_a_window_the_capture_topics_do_not_regenerate_is_reported(chain: Chain) -> None:
    manifest = chain.sealed.manifest
    ranges = {(t, int(p)): (0, r["end"]) for t, v in manifest["source"]["topics"].items()
              for p, r in v["partitions"].items()}
    first = next(read_ranges(chain.bootstrap, ranges, timeout_s=60))
    dropped = codec.decode(first.value())[1]["window_id"]
    fresh = regenerate(chain.bootstrap, chain.prefix, manifest["source"]["capture"])
    del fresh.windows[dropped], fresh.encoded[dropped]
    check = check_windows(chain.bootstrap, ranges, fresh, timeout_s=60)
    assert check.report()["capture_windows_missing"] == [dropped]
    with pytest.raises(RebuildError, match="not regenerated from the capture topics"):
        check.raise_on_failure(manifest["snapshot_id"])


def test_a_worker_with_another_config_refuses_to_join_a_running_group(
    topic_factory: Any, tmp_path: Path,
) -> None:
    bootstrap = topic_factory.bootstrap
    prefix, _ = topic_factory.streams_namespace("cfg", APP_ID)

    def worker(name: str, flags: dict[str, Any]) -> WorkerProcess:
        return WorkerProcess(bootstrap=bootstrap, prefix=prefix, app_id=APP_ID, flags=flags,
                             log_path=tmp_path / f"{name}.log", home=tmp_path / name)

    first = worker("first", {}).start()
    try:
        wait_until(lambda: group_members(bootstrap, prefix + APP_ID) > 0, timeout_s=90,
                   what="the first worker joining its group")
        other = worker("other", {"validation_fraction": 0.5}).start()
        assert other.proc is not None and other.proc.wait(timeout=90) != 0
        log = (tmp_path / "other.log").read_text(encoding="utf-8", errors="replace")
        assert "workers of one group run one configuration" in log, log[-2000:]
        assert first.alive()
    finally:
        first.stop()
    runs = read_runs(bootstrap, prefix + STREAMS_RUNS_TOPIC, app_id=prefix + APP_ID)
    assert len(runs) == 1 and runs[0].capture_start  # the refused worker recorded nothing
