"""Training, checkpoints, TOML configs, evaluation and the CLI on planted snapshots."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.checkpoint import CHECKPOINT_FILE, LINEAGE_FILE, load_checkpoint
from hebrus_flywheel.train.config import (
    DataOptions,
    ModelOptions,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)
from hebrus_flywheel.train.data import Snapshot, SnapshotDataset, StreamConfig
from hebrus_flywheel.train.evaluate import EvaluateConfig, RouterWeights, evaluate
from hebrus_flywheel.train.exceptions import CheckpointError, SplitMixingError
from hebrus_flywheel.train.models import rank_candidates
from hebrus_flywheel.train.qualify.model_evidence import OfflineEvidence
from hebrus_flywheel.train.trainer import Trainer, train
from tests.support.planted import (
    PlantedConfig,
    PlantedSnapshot,
    make_writable,
    write_planted_snapshot,
)

SMALL = PlantedConfig(threads={"train": 8, "validation": 2}, tokens_per_thread=32,
                      anchors_per_window=8, offsets_per_shard=4, row_group_rows=16)
TINY = PlantedConfig(threads={"train": 2, "validation": 1}, tokens_per_thread=16,
                     anchors_per_window=8, offsets_per_shard=2, row_group_rows=8, seed=5)


def quick(**sections: Any) -> TrainConfig:
    base = TrainConfig(
        threads=1, model=ModelOptions(rank=32, hidden=64),
        data=DataOptions(batch_size=256, shuffle_buffer=1024, num_workers=0),
        optim=OptimConfig(max_steps=60, lr=1e-2, min_lr=1e-3, warmup_steps=5),
        schedule=ScheduleConfig(eval_every=20, progress=False, patience=0))
    top = {k: v for k, v in sections.items() if not isinstance(v, dict)}
    nested = {k: dataclasses.replace(getattr(base, k), **v) for k, v in sections.items()
              if isinstance(v, dict)}
    return dataclasses.replace(base, **top, **nested)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlantedSnapshot]:
    root = tmp_path_factory.mktemp("small")
    yield write_planted_snapshot(root, SMALL)
    make_writable(root)


@pytest.fixture(scope="module")
def trained(small: PlantedSnapshot, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    train(small.directory, out, quick(optim={"max_steps": 150}))
    return out


def train_recall(model: torch.nn.Module, snapshot: Snapshot) -> float:
    """Recall@K of the own-layer head on TRAINING rows (the overfit check only)."""
    hits = rows = 0
    stream = SnapshotDataset(snapshot, StreamConfig(splits=("train",), shuffle=False))
    with torch.no_grad():
        for batch in stream:
            scores = model(batch["feature_BD"].float(), batch["layer_B"])[:, 0]
            targets = batch["target_ids_BK"]
            picked = rank_candidates(scores, targets.shape[1])
            hits += int((picked[:, :, None] == targets[:, None, :]).any(-1).sum())
            rows += targets.numel()
    return hits / rows


def test_overfitting_a_tiny_snapshot_reaches_near_perfect_recall(tmp_path: Path) -> None:
    planted = write_planted_snapshot(tmp_path / "tiny", TINY)
    try:
        train(planted.directory, tmp_path / "ckpt", quick(
            model={"rank": 64, "hidden": 256}, data={"batch_size": 128},
            optim={"max_steps": 300, "lr": 1e-2, "min_lr": 1e-2, "weight_decay": 0.0},
            schedule={"eval_every": 300}))
        model = load_checkpoint(tmp_path / "ckpt").model
        assert train_recall(model, Snapshot(planted.directory)) >= 0.97
    finally:
        make_writable(tmp_path / "tiny")


def test_training_generalises_past_every_history_control(small: PlantedSnapshot,
                                                         trained: Path) -> None:
    report = evaluate(small.directory, trained, EvaluateConfig(progress=False))
    recall = {r["method"]: r["splits"]["validation"]["overall"]["recall"]["10"]
              for r in report["offline"]["results"]}
    assert set(recall) == {"random", "frequency", "lru", "previous_token", "adjacent_layer",
                           "sidecar"} and report["skipped"].keys() == {"native_gate"}
    assert recall["sidecar"] > max(v for k, v in recall.items() if k != "sidecar") + 0.1


def test_the_checkpoint_records_its_lineage(small: PlantedSnapshot, trained: Path) -> None:
    lineage = json.loads((trained / LINEAGE_FILE).read_text())
    loaded = load_checkpoint(trained)
    assert loaded.lineage == lineage and loaded.method == "sidecar"
    assert lineage["snapshot"]["snapshot_id"] == small.snapshot_id
    assert lineage["snapshot"]["identity_id"] == small.manifest["identity"]["identity_id"]
    projection = lineage["feature_contract"]["projection"]
    assert projection["projection_digest"] == small.projection.digest
    assert lineage["feature_contract"]["dim"] == 32 and projection["seed"] == 0
    assert lineage["geometry"] == {"layers": 4, "experts": 64, "top_k": 10, "offsets": [[0, 0]]}
    assert lineage["seed"] == 0 and config_from_dict(lineage["config"]).optim.max_steps == 150
    assert lineage["code"]["version"] == "0.1.0" and "git_commit" in lineage["code"]
    assert lineage["training"]["best_step"] in (20, 40, 60, 80, 100, 120, 140, 150)
    assert lineage["world_size"] == 1 and len(lineage["checkpoint_id"]) == 64
    history = [json.loads(line) for line in (trained / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [20, 40, 60, 80, 100, 120, 140, 150]


def test_an_altered_checkpoint_is_refused(trained: Path, tmp_path: Path) -> None:
    payload = torch.load(trained / CHECKPOINT_FILE, weights_only=True)
    payload["lineage"]["seed"] = 1
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="altered"):
        load_checkpoint(tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nothing")


def test_the_same_seed_gives_the_same_checkpoint(small: PlantedSnapshot, tmp_path: Path) -> None:
    ids = [train(small.directory, tmp_path / name, quick(seed=seed)).lineage["checkpoint_id"]
           for name, seed in (("a", 4), ("b", 4), ("c", 5))]
    assert ids[0] == ids[1] != ids[2]


def test_train_frees_its_model_before_it_leaves_the_process_group(
        small: PlantedSnapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under torchrun the model is a DDP wrapper bound to the gloo group: freed later by the
    # collector (at interpreter exit, say) it outlives the group it was bound to.
    alive: list[weakref.ref[torch.nn.Module]] = []
    left_with: list[bool] = []
    built = Trainer.__init__

    def tracked(self: Trainer, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        alive.append(weakref.ref(self.model))

    monkeypatch.setattr(Trainer, "__init__", tracked)
    monkeypatch.setattr("hebrus_flywheel.train.ddp.shutdown",
                        lambda ctx: left_with.append(alive[0]() is not None))
    collecting = gc.isenabled()
    gc.disable()  # the collector must not free it by chance
    try:
        train(small.directory, tmp_path, quick(optim={"max_steps": 2},
                                               schedule={"eval_every": 1}))
    finally:
        if collecting:
            gc.enable()
    assert left_with == [False]


def test_early_stopping_ends_a_run_that_stops_improving(small: PlantedSnapshot,
                                                        tmp_path: Path) -> None:
    result = train(small.directory, tmp_path, quick(
        optim={"lr": 1e-9, "min_lr": 0.0, "max_steps": 200},
        schedule={"eval_every": 10, "patience": 2, "min_delta": 0.01}))
    assert result.lineage["training"]["stopped"] == "early_stopping"
    assert [h["step"] for h in result.history] == [10, 20, 30]
    assert result.lineage["training"]["best_step"] == 10


def test_split_mixing_is_refused_in_training_and_evaluation(small: PlantedSnapshot,
                                                            trained: Path) -> None:
    with pytest.raises(ConfigError, match="train_split"):
        DataOptions(train_split="validation")
    with pytest.raises(ConfigError, match="validation_split"):
        DataOptions(validation_split="train")
    with pytest.raises(ConfigError, match="never train"):
        EvaluateConfig(splits=("train",))
    from hebrus_flywheel.train import ddp

    snapshot = Snapshot(small.directory)
    trainer = Trainer(snapshot, trained / "unused", quick(), ddp.init_distributed("cpu"))
    validation = next(iter(trainer.stream("validation", train=False)))
    with pytest.raises(SplitMixingError):
        trainer.step(validation, 0)
    trainer.config = quick(data={"validation_split": "validation"})
    trainer.stream = lambda split, train: SnapshotDataset(  # type: ignore[method-assign]
        snapshot, StreamConfig(splits=("train",), shuffle=False))
    with pytest.raises(SplitMixingError):
        trainer.validate()


def test_evaluation_reports_every_method_with_the_native_gate(small: PlantedSnapshot,
                                                              trained: Path) -> None:
    router = RouterWeights(router_LEH=small.router_LEH, norm_gain_LH=small.gain_LH,
                           source="planted")
    report = evaluate(small.directory, trained, EvaluateConfig(progress=False), router=router)
    results = {r["method"]: r for r in report["offline"]["results"]}
    gate = results["native_gate"]["splits"]["validation"]
    assert gate["overall"]["recall"]["10"] > 0.99  # D >= H: the lift is exact
    assert all(set(r["splits"]) == {"validation"} for r in results.values())
    sidecar = results["sidecar"]["splits"]["validation"]
    assert sidecar["overall"]["calibration"]["ece"] is not None
    assert set(sidecar["by_layer"]) == {"0", "1", "2", "3"}
    assert set(sidecar["by_domain"]) == {"prose", "code"}
    assert sidecar["overall"]["union_growth"]["windows"] == list(range(1, 9))
    assert report["frequency_fit"]["rows"] == 8 * 32 * 4 and report["checkpoint"]["same_snapshot"]
    evidence = OfflineEvidence(results=tuple(report["offline"]["results"]),
                               candidate="sidecar", features=report["offline"]["features"])
    assert set(evidence.controls) == set(results) - {"sidecar"}


def test_a_checkpoint_of_another_feature_contract_is_refused(trained: Path,
                                                             tmp_path: Path) -> None:
    other = write_planted_snapshot(tmp_path, dataclasses.replace(SMALL, projection_seed=9))
    try:
        with pytest.raises(CheckpointError, match="projection"):
            evaluate(other.directory, trained, EvaluateConfig(progress=False))
    finally:
        make_writable(tmp_path)


def test_p1_trains_both_heads_and_reports_the_next_layer(small: PlantedSnapshot,
                                                         tmp_path: Path) -> None:
    result = train(small.directory, tmp_path, quick(model={"offsets": ((0, 0), (0, 1))}))
    assert result.lineage["geometry"]["offsets"] == [[0, 0], [0, 1]]
    report = evaluate(small.directory, tmp_path, EvaluateConfig(progress=False))
    (next_layer,) = report["auxiliary"]
    node = next_layer["splits"]["validation"]
    assert next_layer["method"] == "sidecar_next_layer" and set(node["by_layer"]) == {"1", "2",
                                                                                      "3"}
    assert node["overall"]["rows"] == 2 * 32 * 3


ASSET = Path(__file__).resolve().parents[1] / "assets" / "train_p1.toml"


def test_toml_configs_load_into_the_dataclasses(tmp_path: Path) -> None:
    config = load_config(ASSET)
    assert config.seed == 3 and config.method == "p1_sidecar"
    assert config.model.offsets == ((0, 0), (0, 1)) and config.model.rank == 16
    assert config.loss.deadline.table == (1.0, 0.5) and config.loss.order_weight == 0.25
    assert config.optim.max_steps == 7 and config.schedule.monitor == "loss"
    assert config_from_dict(config_to_dict(config)) == config
    path = tmp_path / "bad.toml"
    for bad, match in (("[optim]\nmax_step = 3\n", "unknown key.*max_step"),
                       ("[optim]\nmax_steps = 'x'\n", "optim.max_steps must be a int"),
                       ("[model]\noffsets = [[1, 0]]\n", "same token"),
                       ("[schedule]\nmonitor = 'auc'\n", "monitor must be one of"),
                       ("method = 'lru'\n", "control")):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=match):
            load_config(path)


def test_the_cli_trains_and_prints_the_evaluation_table(small: PlantedSnapshot,
                                                        tmp_path: Path) -> None:
    import typer

    from hebrus_flywheel.train.cli import evaluate_command, train_command

    app = typer.Typer()
    app.command("train")(train_command)
    app.command("evaluate")(evaluate_command)
    config = tmp_path / "t.toml"
    config.write_text("threads = 1\n[data]\nnum_workers = 0\nbatch_size = 256\n"
                      "[schedule]\neval_every = 10\n")
    runner = CliRunner()
    done = runner.invoke(app, ["train", "--snapshot", str(small.directory), "--out",
                               str(tmp_path / "ck"), "--config", str(config), "--max-steps", "20",
                               "--no-progress", "--snapshot-id", small.snapshot_id,
                               "--no-consent-ledger"])  # no broker in unit tests
    assert done.exit_code == 0, done.output
    assert "--no-consent-ledger" in done.output and "consent (none): 0 of" in done.output
    shown = runner.invoke(app, ["evaluate", "--snapshot", str(small.directory), "--checkpoint",
                                str(tmp_path / "ck"), "--out", str(tmp_path / "r.json"),
                                "--no-progress", "--no-consent-ledger"])
    assert shown.exit_code == 0, shown.output
    for word in ("previous_token", "adjacent_layer", "sidecar", "ECE", "exact@10"):
        assert word in shown.output
    # the recall columns follow the teacher's top-10: k, 2k, 3k, 4k
    assert all(f"R@{b}" in shown.output for b in (10, 20, 30, 40)) and "R@32" not in shown.output
    # the planted snapshot records no replay throughput: the projection says so
    assert "collection-time projection" in shown.output
    assert '"figure": "collection_hours", "tokens": 10000000' in shown.output
    assert "clean path not measured" in shown.output
    assert json.loads((tmp_path / "r.json").read_text())["snapshot"]["splits"] == ["validation"]


def test_the_cli_module_does_not_import_torch() -> None:
    code = "import sys, train.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_learning_rate_warms_up_then_decays() -> None:
    from hebrus_flywheel.train.trainer import learning_rate

    config = quick(optim={"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "max_steps": 14})
    rates = [learning_rate(s, config) for s in range(15)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0] and np.isclose(rates[-1], 0.1)
    assert all(a >= b for a, b in itertools.pairwise(rates[3:]))
