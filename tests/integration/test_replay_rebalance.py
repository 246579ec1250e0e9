"""Replay workers join and leave a running group (cooperative-sticky) with nothing lost
and nothing written twice.

The workers consume the train split only (``splits``), so the group has the train
topic's partitions to share. One worker (A) replays the first windows of every
partition alone; a second worker (B) joins and takes some partitions over
incrementally (A keeps the rest);
more windows arrive, leaving every partition with a half-read block; B leaves (its
complete blocks were committed, its open ones are re-read by A); the last windows
complete every block and A finishes. The shards of that run are exactly those of one
worker that replayed everything alone: same names, same plaintext bytes, every window's
rows once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest

from hebrus_flywheel.consumers.kafka_io import committed_offsets, end_offsets
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core.progress import WatchdogConfig
from hebrus_flywheel.streams.topics import catalogue, window_topic
from tests.support.consent import grant_owners
from tests.support.plaintext import plaintext_copy, plaintext_digests
from tests.support.windows import corpus_token_ids, publish_windows, thread_windows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHARD = ShardConfig(offsets_per_shard=4, row_group_rows=4)
BATCHES = (4, 6, 2)
"""Windows per partition in each wave: a full block, a block and a half, the rest."""


@pytest.fixture(scope="module")
def teacher(teacher_dir: Path) -> Any:
    from hebrus_flywheel.replay.teacher import load_teacher

    return load_teacher(teacher_dir)


class Running:
    """A replay worker in a thread of this process, with its own copy of the teacher (the
    replay engine hooks the model's routers: two workers must not share one model, as
    two worker processes never do)."""

    def __init__(self, config: ReplayWorkerConfig) -> None:
        self.worker = ReplayWorker(config)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc

    def owned(self) -> set[tuple[str, int]]:
        return set(self.worker.logs)

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "worker did not stop"
        assert self.error is None, self.error


def wait_until(what: str, check: Callable[[], bool], *workers: Running,
               timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in workers:
            assert w.error is None, w.error
        if check():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def _waves(tokens: list[int], identity_id: str, partitions: int) -> list[list[tuple[int, Any]]]:
    """(partition, window) lists per wave; windows of one partition come from one owner."""
    waves: list[list[tuple[int, Any]]] = [[] for _ in BATCHES]
    for p in range(partitions):
        windows = thread_windows(tokens, identity_id=identity_id, owner=f"r{p}", thread="t",
                                 count=sum(BATCHES), start=40 * p)
        first = 0
        for wave, size in zip(waves, BATCHES, strict=True):
            wave += [(p, w) for w in windows[first:first + size]]
            first += size
    return waves


def _publish(bootstrap: str, prefix: str, wave: list[tuple[int, Any]]) -> None:
    for p in sorted({p for p, _ in wave}):
        publish_windows(bootstrap, prefix, [w for q, w in wave if q == p], partition=p,
                        consent=False)


def _rows(root: Path, out: Path) -> Counter[tuple[str, int]]:
    plain = plaintext_copy(root, out)
    rows = duckdb.sql(f"SELECT window_id, token_ordinal FROM read_parquet("
                      f"'{plain}/epoch=*/split=*/*.parquet', hive_partitioning=true)").fetchall()
    return Counter((str(w), int(o)) for w, o in rows)


def test_workers_join_and_leave_with_no_lost_or_duplicated_rows(
    topic_factory: Any, teacher: Any, teacher_dir: Path, tmp_path: Path,
) -> None:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity

    bootstrap = topic_factory.bootstrap
    prefix = f"{topic_factory.prefix}rebalance."
    topic_factory.create(catalogue(prefix))
    topic = prefix + window_topic("train")
    partitions = len(end_offsets(bootstrap, [topic])[topic])
    identity_id = str(build_runtime_identity(teacher)["identity_id"])
    waves = _waves(corpus_token_ids(teacher_dir), identity_id, partitions)
    grant_owners(bootstrap, {f"r{p}" for p in range(partitions)}, prefix=prefix)

    def config(root: Path, group: str, **extra: Any) -> ReplayWorkerConfig:
        return ReplayWorkerConfig(teacher=teacher_dir, dataset=root, bootstrap=bootstrap,
                                  prefix=prefix, group_id=group, shard=SHARD, batch_windows=2,
                                  torch_threads=1, session_timeout_s=10.0,
                                  splits=("train",), **extra)

    def committed_to(offset: int) -> Callable[[], bool]:
        tps = [(topic, p) for p in range(partitions)]
        return lambda: set(committed_offsets(bootstrap, prefix + "elastic", tps).values()) \
            == {offset}

    root = tmp_path / "elastic"
    _publish(bootstrap, prefix, waves[0])
    a = Running(config(root, "elastic"))
    wait_until("A alone commits the first block of every partition", committed_to(4), a)
    b = Running(config(root, "elastic"))
    wait_until("B takes partitions over", lambda: bool(b.owned()) and bool(a.owned())
               and len(a.owned() | b.owned()) == partitions, a, b)
    assert not a.owned() & b.owned()
    _publish(bootstrap, prefix, waves[1])
    wait_until("A and B commit the second blocks", committed_to(8), a, b)
    assert b.worker.stats.report()["counts"].get("commit/blocks", 0) >= 1
    b.stop()  # leaves with half-read blocks: A re-reads them
    wait_until("A owns every partition again", lambda: len(a.owned()) == partitions, a)
    _publish(bootstrap, prefix, waves[2])
    wait_until("A commits the last blocks", committed_to(12), a)
    a.stop()

    reference = tmp_path / "reference"
    alone = ReplayWorker(config(reference, "alone", watchdog=WatchdogConfig(drain=True)),
                         teacher=teacher)
    alone.run()
    assert plaintext_digests(root) == plaintext_digests(reference)
    rows, expected = _rows(root, tmp_path / "p1"), _rows(reference, tmp_path / "p2")
    assert rows == expected and set(rows.values()) == {1}
    windows = {w["window_id"] for wave in waves for _, w in wave}
    assert {wid for wid, _ in rows} == windows
