"""Per-worker replay throughput, for sizing (docs/operations.md); one JSON line per figure.

Publishes ``--windows`` causal windows (cut from the shipped corpus with the teacher's
tokenizer, spread over every partition of the train window topic) to uuid-prefixed
topics, then runs ONE real replay worker (``consumers.worker.ReplayWorker``: consume,
classify, consent, content policy, batched prefill replay, encrypted Parquet shards,
commits) until it has drained the topic. Rates are per wall second of that run, from
the worker's start (teacher already loaded) to lag 0:

* ``replay_worker_windows_per_s``: windows replayed and written;
* ``replay_worker_labels_per_s``: labels, one per (anchor token, routed layer), the unit
  of ``bench/replay.py``.

On the default tiny teacher (``tiny-qwen3-next``, ``--preset`` to change). Figures vary
with the machine and its load (reported, never asserted).

    .venv/bin/python bench/replay_worker.py [--windows 96] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hebrus_flywheel.consumers.kafka_io import end_offsets
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core.progress import WatchdogConfig
from hebrus_flywheel.core.settings import bootstrap_servers
from hebrus_flywheel.streams.acls import grant_catalogue
from hebrus_flywheel.streams.topics import catalogue, create_topics, delete_topics, window_topic
from tests.support.windows import corpus_token_ids, publish_windows, thread_windows

ANCHORS = 6


def emit(figure: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"figure": figure, "value": round(value, 3), "unit": unit, **extra}),
          flush=True)


def _publish(bootstrap: str, prefix: str, teacher: Any, teacher_dir: Path, count: int
             ) -> tuple[int, int]:
    """Publish about ``count`` windows, the same number to every partition of the train
    topic; (windows published, windows per partition)."""
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity

    identity_id = str(build_runtime_identity(teacher)["identity_id"])
    tokens = corpus_token_ids(teacher_dir)
    topic = prefix + window_topic("train")
    partitions = len(end_offsets(bootstrap, [topic])[topic])
    per = -(-count // partitions)
    for p in range(partitions):
        windows = thread_windows(tokens, identity_id=identity_id, owner=f"b{p}", thread="t",
                                 count=per, start=(7 * p) % 200, anchors_per_window=ANCHORS)
        publish_windows(bootstrap, prefix, windows, partition=p)
    return per * partitions, per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--windows", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch-windows", type=int, default=8)
    parser.add_argument("--preset", default="tiny-qwen3-next")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    from hebrus_flywheel.replay.teacher import init_teacher, load_teacher

    torch.set_num_threads(args.threads)
    bootstrap = bootstrap_servers(args.bootstrap_servers)
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    specs = catalogue(prefix)
    create_topics(bootstrap, specs)
    grant_catalogue(bootstrap, prefix)
    with tempfile.TemporaryDirectory(prefix="bench-replay-worker-") as tmp:
        try:
            teacher_dir = init_teacher(Path(tmp) / "teacher", preset=args.preset, seed=0)
            teacher = load_teacher(teacher_dir)
            n, per = _publish(bootstrap, prefix, teacher, teacher_dir, args.windows)
            worker = ReplayWorker(ReplayWorkerConfig(
                teacher=teacher_dir, dataset=Path(tmp) / "dataset", bootstrap=bootstrap,
                prefix=prefix, shard=ShardConfig(offsets_per_shard=per),  # one block each
                batch_windows=args.batch_windows, torch_threads=args.threads,
                watchdog=WatchdogConfig(drain=True)), teacher=teacher)
            layers = len(teacher.geometry.routed_layers)
            start, cpu = time.perf_counter(), time.process_time()
            thread = threading.Thread(target=worker.run)
            thread.start()
            thread.join()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        finally:
            delete_topics(bootstrap, [s.name for s in specs])
    accepted = worker.stats.report()["counts"].get("intake/accepted", 0)
    if accepted != n:
        raise SystemExit(f"the worker accepted {accepted} of {n} windows: {worker.stats.report()}")
    labels = n * ANCHORS * layers
    common = {"windows": n, "routed_layers": layers, "anchors_per_window": ANCHORS,
              "torch_threads": args.threads, "seconds": round(wall, 2), "preset": args.preset}
    emit("replay_worker_windows_per_s", n / wall, "windows/s", **common)
    emit("replay_worker_labels_per_s", labels / wall, "labels/s",
         cpu_rate=round(labels / cpu, 1), **common)


if __name__ == "__main__":
    main()
