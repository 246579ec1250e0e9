"""``flywheel rebuild --from-capture`` over the whole chain on the real broker.

Synthetic threads are decoded by the real teacher and published by the real capture
path; the stream worker (a subprocess, default flags, exiting when idle) cuts them into
windows; a replay worker writes shards and epoch 0 is sealed. The rebuild then re-runs
the capture topics through the in-memory stream chain, finds every sealed window again
(same id, same content digest) and replays the fresh windows into byte-identical shards.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from consumers.capture_check import check_windows, regenerate
from consumers.exceptions import RebuildError
from consumers.kafka_io import read_ranges
from consumers.rebuild import RebuildConfig, rebuild_snapshot
from consumers.seal import SealConfig, SealResult, seal_epoch
from consumers.shards import ShardConfig
from consumers.verify import verify_snapshot
from consumers.worker import ReplayWorker, ReplayWorkerConfig
from replay.capture import CaptureConfig
from replay.capture_cli import run_capture
from replay.synthetic import generate_threads
from schemas import codec
from streams.processors.harness import WorkerProcess
from streams.processors.topology import StreamTopics
from streams.topics import catalogue

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP_ID = "flywheel-streams"


@dataclass
class Chain:
    bootstrap: str
    prefix: str
    teacher_dir: Path
    teacher: Any
    sealed: SealResult


def _track_stream_topics(topic_factory: Any, prefix: str) -> None:
    topics, full_app = StreamTopics.from_prefix(prefix, APP_ID), prefix + APP_ID
    topic_factory.track([topics.threads, topics.decisions, topics.ticks,
                         f"{full_app}-capture-state-changelog",
                         f"{full_app}-dedup-state-changelog", f"{full_app}-__assignor-__leader"])


def _run_streams(bootstrap: str, prefix: str, tmp: Path) -> None:
    worker = WorkerProcess(bootstrap=bootstrap, prefix=prefix, app_id=APP_ID,
                           log_path=tmp / "streams.log", home=tmp / "home",
                           extra=["--idle-exit-s", "6"]).start()
    try:
        if worker.proc is not None:
            worker.proc.wait(timeout=120)
    finally:
        worker.stop()
    log = (tmp / "streams.log").read_text(encoding="utf-8", errors="replace")
    if worker.proc is None or worker.proc.returncode != 0:
        pytest.fail(f"stream worker failed:\n{log[-3000:]}")


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
    from replay.teacher import load_teacher

    bootstrap, prefix = topic_factory.bootstrap, f"{topic_factory.prefix}cap."
    topic_factory.create(catalogue(prefix))
    _track_stream_topics(topic_factory, prefix)
    tmp = tmp_path_factory.mktemp("from-capture")
    run_capture(teacher_dir=teacher_dir, threads=list(generate_threads(4, seed=11)),
                config=CaptureConfig(mode="forced", interleave=2), bootstrap=bootstrap,
                topic_prefix=prefix, create_topics=False)
    _run_streams(bootstrap, prefix, tmp)
    teacher = load_teacher(teacher_dir)
    root = tmp / "dataset"
    sealed = _replay_and_seal(bootstrap, prefix, teacher_dir, teacher, root)
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
    assert report["identical"] and report["snapshot_id_match"], report["differences"]
    assert report["capture_windows_missing"] == []
    assert report["capture_windows_digest_mismatch"] == []
    assert report["capture_windows_regenerated"] == records
    ends = report["capture_end_offsets"]
    assert set(ends) == {chain.prefix + f"flywheel.capture.{k}.v1"
                         for k in ("identities", "transcripts", "observations")}
    assert all(sum(parts.values()) > 0 for parts in ends.values())
    assert verify_snapshot(Path(report["out"]))["snapshot_id"] == chain.sealed.snapshot_id


def test_a_window_the_capture_topics_do_not_regenerate_is_reported(chain: Chain) -> None:
    manifest = chain.sealed.manifest
    ranges = {(t, int(p)): (0, r["end"]) for t, v in manifest["source"]["topics"].items()
              for p, r in v["partitions"].items()}
    first = next(read_ranges(chain.bootstrap, ranges, timeout_s=60))
    dropped = codec.decode(first.value())[1]["window_id"]
    fresh = regenerate(chain.bootstrap, chain.prefix)
    del fresh.windows[dropped], fresh.encoded[dropped]
    check = check_windows(chain.bootstrap, ranges, fresh, timeout_s=60)
    assert check.report()["capture_windows_missing"] == [dropped]
    with pytest.raises(RebuildError, match="not regenerated from the capture topics"):
        check.raise_on_failure(manifest["snapshot_id"])
