"""``torchrun --nproc_per_node=2`` (gloo on CPU) matches one process within tolerance.

Both runs see the same global batch (one process x 256 rows, two ranks x 128 rows) from
the same seed; they differ only in which rows each step draws, so their validation
metrics agree within :data:`RECALL_TOLERANCE` (absolute recall@10) rather than exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hebrus_flywheel.train.checkpoint import load_checkpoint
from hebrus_flywheel.train.evaluate import EvaluateConfig, evaluate
from tests.support.planted import (
    PlantedConfig,
    PlantedSnapshot,
    make_writable,
    write_planted_snapshot,
)

pytestmark = pytest.mark.slow

RECALL_TOLERANCE = 0.03
"""Largest |recall@10 (2 ranks) - recall@10 (1 process)| accepted on validation."""
PLANTED = PlantedConfig(threads={"train": 8, "validation": 3}, tokens_per_thread=32,
                        anchors_per_window=8, offsets_per_shard=4, row_group_rows=32)
"""Three validation units: the ranks validate on unequal halves (2 units and 1)."""
CONFIG = """threads = 1
seed = 11
[model]
rank = 32
hidden = 64
[data]
num_workers = 0
shuffle_buffer = 1024
[optim]
max_steps = 150
lr = 1e-2
min_lr = 1e-3
warmup_steps = 5
[schedule]
eval_every = 50
patience = 0
progress = false
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlantedSnapshot]:
    root = tmp_path_factory.mktemp("ddp")
    yield write_planted_snapshot(root, PLANTED)
    make_writable(root)


def _run(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=180, cwd=Path(__file__).resolve().parents[2], check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_two_ranks_reach_the_metrics_of_one_process(planted: PlantedSnapshot,
                                                    tmp_path: Path) -> None:
    config = tmp_path / "train.toml"
    config.write_text(CONFIG)
    # no broker in unit tests: the consent re-check is covered by tests/integration
    common = ["train", "--snapshot", str(planted.directory), "--config", str(config),
              "--no-consent-ledger"]
    cli = "hebrus_flywheel.train.cli"
    _run(["-m", cli, *common, "--out", str(tmp_path / "one"), "--batch-size", "256"], tmp_path)
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
          cli, *common, "--out", str(tmp_path / "two"), "--batch-size", "128"], tmp_path)
    one, two = (load_checkpoint(tmp_path / name) for name in ("one", "two"))
    assert one.lineage["world_size"] == 1 and two.lineage["world_size"] == 2
    best_one = one.lineage["training"]["best_validation"]
    best_two = two.lineage["training"]["best_validation"]
    assert best_one["rows"] == best_two["rows"] == 3 * 32 * 4  # ranks' parts all-reduced
    assert abs(best_one["recall"] - best_two["recall"]) <= RECALL_TOLERANCE
    recalls = []
    for name in ("one", "two"):
        report = evaluate(planted.directory, tmp_path / name, EvaluateConfig(progress=False))
        sidecar = next(r for r in report["offline"]["results"] if r["method"] == "sidecar")
        recalls.append(sidecar["splits"]["validation"]["overall"]["recall"]["10"])
    assert abs(recalls[0] - recalls[1]) <= RECALL_TOLERANCE and min(recalls) > 0.8


def test_two_ranks_train_a_predictor_and_agree_on_its_calibration(
        planted: PlantedSnapshot, tmp_path: Path) -> None:
    """The per-layer MLP under DDP: every rank fits the calibration on the whole
    validation split, so rank 0 saves the fit a single process makes of those weights."""
    config = tmp_path / "train.toml"
    config.write_text(CONFIG.replace("max_steps = 150", "max_steps = 50"))
    common = ["train", "--snapshot", str(planted.directory), "--config", str(config),
              "--no-consent-ledger", "--model", "per_layer_mlp", "--width", "32", "--method", "plm"]
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
          "hebrus_flywheel.train.cli", *common, "--out", str(tmp_path / "two"),
          "--batch-size", "128"], tmp_path)
    two = load_checkpoint(tmp_path / "two")
    assert two.lineage["world_size"] == 2
    assert two.lineage["config"]["model"]["architecture"] == "per_layer_mlp"
    report = evaluate(planted.directory, tmp_path / "two", EvaluateConfig(progress=False))
    learned = next(r for r in report["offline"]["results"] if r["method"] == "plm")
    overall = learned["splits"]["validation"]["overall"]
    assert overall["recall"]["10"] > 0.5 and overall["calibration"]["ece"] < 0.1
