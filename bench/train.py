"""Loader versus trainer throughput on a sealed snapshot; one JSON line per figure.

Builds a planted sealed snapshot at the default geometry (48 routed layers, 512 experts,
top-10, D = H = 64; no broker, see ``tests/support/planted.py``), then in one run measures:

* ``loader_rows_per_s``: (token, layer) rows per second that the snapshot dataset
  delivers through its DataLoader alone (shard verification, Parquet decoding,
  shuffling, batching), over an endless training stream like the trainer's;
* ``trainer_rows_per_s``: rows per second consumed by optimisation steps of the model
  (forward, loss, backward, AdamW) on batches already in memory: the default sidecar,
  or with ``--model per_layer_mlp --gate-prior`` a predictor of the ablation (its gate
  prior reads the planted router, as a trained one reads the teacher's);
* ``end_to_end_rows_per_s``: the trainer fed by the loader (both share the CPU here);
* ``loader_to_trainer_ratio``: the first over the second. Goal (reported, not enforced):
  >= 5, the design note's falsifier 10 (the GPUs must not wait for feature shards).

Loader and trainer are measured in interleaved rounds and the medians reported (with the
lowest and highest round), because on a shared machine a burst of other load can slow
one measurement several-fold.

Figures vary with the machine and its load; this is not a test.

    .venv/bin/python bench/train.py [--threads 64 --tokens 64 --workers 1 --rounds 3]
        [--model per_layer_mlp --gate-prior --width 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from itertools import cycle, islice
from pathlib import Path
from typing import Any

# This file is bench/train.py: run as a script, its folder comes first on sys.path and
# would shadow the ``train`` package. Drop the folder so the package is imported.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]
# The planted snapshot builder is test scaffolding (tests/support), not installed.
sys.path.insert(0, str(_HERE.parent))

GOAL_RATIO = 5.0


def emit(figure: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"bench": "train", "figure": figure, "value": round(value, 3),
                      "unit": unit, **extra}), flush=True)


def build(root: Path, args: argparse.Namespace) -> Any:
    from tests.support.planted import PlantedConfig, write_planted_snapshot

    config = PlantedConfig(threads={"train": args.threads, "validation": 2},
                           tokens_per_thread=args.tokens, anchors_per_window=8,
                           offsets_per_shard=16, row_group_rows=8192, layers=args.layers,
                           experts=512, top_k=10, hidden_dim=64, feature_dim=64)
    started = time.perf_counter()
    planted = write_planted_snapshot(root, config, read_only=False)
    emit("snapshot_build_s", time.perf_counter() - started, "s",
         rows=planted.manifest["totals"]["rows"], shards=planted.manifest["totals"]["shards"],
         bytes=planted.manifest["totals"]["bytes"])
    return planted


def loader_rate(trainer: Any, args: argparse.Namespace) -> tuple[float, list[Any]]:
    """Rows/s of the training stream alone, and the first batches (for the trainer)."""
    from hebrus_flywheel.train.data import make_loader

    loader = iter(make_loader(trainer.stream("train", train=True), num_workers=args.workers))
    kept = [next(loader) for _ in range(2)]  # warm-up: workers started, first shards read
    rows, started = 0, time.perf_counter()
    for batch in islice(loader, args.loader_batches):
        rows += len(batch["layer_B"])
        if len(kept) < 8:
            kept.append(batch)
    rate = rows / (time.perf_counter() - started)
    del loader
    return rate, kept


def trainer_rate(trainer: Any, batches: list[Any], steps: int) -> float:
    """Rows/s consumed by optimisation steps on in-memory batches."""
    for step, batch in enumerate(batches[:2]):
        trainer.step(batch, step)
    rows, started = 0, time.perf_counter()
    for step, batch in enumerate(islice(cycle(batches), steps)):
        trainer.step(batch, step)
        rows += len(batch["layer_B"])
    return rows / (time.perf_counter() - started)


def end_to_end_rate(trainer: Any, args: argparse.Namespace) -> float:
    from hebrus_flywheel.train.data import make_loader

    loader = iter(make_loader(trainer.stream("train", train=True), num_workers=args.workers))
    trainer.step(next(loader), 0)
    rows, started = 0, time.perf_counter()
    for step, batch in enumerate(islice(loader, args.steps)):
        trainer.step(batch, step)
        rows += len(batch["layer_B"])
    rate = rows / (time.perf_counter() - started)
    del loader
    return rate


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=64, help="train threads in the snapshot")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per thread")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=4096, help="(token, layer) rows")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers")
    parser.add_argument("--steps", type=int, default=15, help="timed optimisation steps")
    parser.add_argument("--loader-batches", type=int, default=60, help="timed loader batches")
    parser.add_argument("--rounds", type=int, default=3, help="loader/trainer rounds (median)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="trainer threads; 1 is stable on a shared 2-core machine, where "
                        "two OpenMP threads swing several-fold with other load; 0: torch's")
    parser.add_argument("--model", default="sidecar", help="model.architecture: sidecar, "
                        "per_layer_mlp, shared_lowrank or gate_adapter")
    parser.add_argument("--gate-prior", action="store_true", help="model.gate_prior")
    parser.add_argument("--width", type=int, default=64, help="model.rank (predictor width)")
    return parser.parse_args()


def gate_arrays(planted: Any) -> Any:
    """The planted router, the lift of the stored features and the gain."""
    import numpy as np

    from hebrus_flywheel.train.predictors import GateArrays

    lift = np.linalg.pinv(planted.projection.matrix_HD.astype(np.float64))
    return GateArrays(planted.router_LEH.astype(np.float32), lift.astype(np.float32),
                      planted.gain_LH.astype(np.float32))


def main() -> None:
    args = parse()
    import torch

    from hebrus_flywheel.train import ddp
    from hebrus_flywheel.train.config import DataOptions, ModelOptions, TrainConfig
    from hebrus_flywheel.train.data import Snapshot
    from hebrus_flywheel.train.trainer import Trainer

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        planted = build(Path(tmp), args)
        model = ModelOptions(architecture=args.model, gate_prior=args.gate_prior,
                             rank=args.width) if args.model != "sidecar" else ModelOptions()
        config = TrainConfig(model=model, data=DataOptions(batch_size=args.batch_size,
                                                           num_workers=args.workers))
        trainer = Trainer(Snapshot(planted.directory), Path(tmp) / "ckpt", config,
                          ddp.init_distributed("cpu"),
                          gate_arrays(planted) if model.needs_teacher else None)
        name = args.model + ("+gate_prior" if args.gate_prior else "") + (
            f"@{args.width}" if args.model != "sidecar" else "")
        shape = {"model": name, "batch_rows": args.batch_size, "layers": args.layers,
                 "experts": 512,
                 "feature_dim": 64, "workers": args.workers,
                 "torch_threads": torch.get_num_threads(), "rounds": args.rounds}
        loaders, trainers = [], []
        for _ in range(args.rounds):  # interleaved, so a burst of load hits both alike
            rate, batches = loader_rate(trainer, args)
            loaders.append(rate)
            trainers.append(trainer_rate(trainer, batches, args.steps))
        report(loaders, trainers, end_to_end_rate(trainer, args), shape)


def report(loaders: list[float], trainers: list[float], end_to_end: float,
           shape: dict[str, Any]) -> None:
    loader, trainer = statistics.median(loaders), statistics.median(trainers)
    emit("loader_rows_per_s", loader, "rows/s", low=round(min(loaders)),
         high=round(max(loaders)), **shape)
    emit("trainer_rows_per_s", trainer, "rows/s", low=round(min(trainers)),
         high=round(max(trainers)), **shape)
    emit("end_to_end_rows_per_s", end_to_end, "rows/s", **shape)
    ratio = loader / trainer
    emit("loader_to_trainer_ratio", ratio, "x", goal=GOAL_RATIO, met=ratio >= GOAL_RATIO)


if __name__ == "__main__":
    main()
