"""`flywheel train` with a predictor of the ablation: it trains, saves a normal checkpoint
with its calibration and gate, restores it, resumes from it, and evaluation, Gate 3's
offline evidence and the shadow simulator's ranking score that very checkpoint."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train import ddp
from hebrus_flywheel.train import trainer as trainer_module
from hebrus_flywheel.train.checkpoint import load_checkpoint
from hebrus_flywheel.train.config import (
    DataOptions,
    ModelOptions,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
)
from hebrus_flywheel.train.data import Snapshot
from hebrus_flywheel.train.evaluate import EvaluateConfig, RouterWeights, evaluate
from hebrus_flywheel.train.exceptions import CheckpointError
from hebrus_flywheel.train.isotonic import KNOTS
from hebrus_flywheel.train.predictor_data import GateWeights
from hebrus_flywheel.train.predictor_model import PredictorConfig, RoutePredictor
from hebrus_flywheel.train.predictors import GateArrays, PlattCalibration, PredictorSpec
from hebrus_flywheel.train.trainer import Trainer, make_optimizer, train
from tests.support.planted import (
    PlantedConfig,
    PlantedSnapshot,
    make_writable,
    write_planted_snapshot,
)

SMALL = PlantedConfig(threads={"train": 8, "validation": 2}, tokens_per_thread=32,
                      anchors_per_window=8, offsets_per_shard=4, row_group_rows=16)


def config(**model: Any) -> TrainConfig:
    return TrainConfig(
        threads=1, method="learned", model=ModelOptions(**{"rank": 16, **model}),
        data=DataOptions(batch_size=256, shuffle_buffer=1024, num_workers=0),
        optim=OptimConfig(max_steps=60, lr=3e-3, min_lr=3e-4, warmup_steps=5),
        schedule=ScheduleConfig(eval_every=20, progress=False, patience=0))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlantedSnapshot]:
    root = tmp_path_factory.mktemp("small")
    yield write_planted_snapshot(root, SMALL)
    make_writable(root)


def gate_of(planted: PlantedSnapshot) -> GateArrays:
    """The planted router, the lift of the stored features and the gain (teacher's role)."""
    lift = np.linalg.pinv(planted.projection.matrix_HD.astype(np.float64))
    return GateArrays(planted.router_LEH.astype(np.float32), lift.astype(np.float32),
                      planted.gain_LH.astype(np.float32))


def router_of(planted: PlantedSnapshot) -> RouterWeights:
    return RouterWeights(router_LEH=planted.router_LEH, norm_gain_LH=planted.gain_LH,
                         source="planted")


@pytest.fixture(scope="module")
def prior_ckpt(small: PlantedSnapshot, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prior")
    settings = config(architecture="per_layer_mlp", gate_prior=True)
    Trainer(Snapshot(small.directory), out, settings, ddp.init_distributed("cpu"),
            gate_of(small)).run()
    return out


def _recall(report: dict[str, Any]) -> dict[str, float]:
    return {r["method"]: r["splits"]["validation"]["overall"]["recall"]["10"]
            for r in report["offline"]["results"]}


def test_config_names_the_architecture_and_refuses_bad_pairs() -> None:
    assert not ModelOptions().needs_teacher and ModelOptions().architecture == "sidecar"
    assert ModelOptions(architecture="gate_adapter").needs_teacher
    with pytest.raises(ConfigError, match="architecture"):
        ModelOptions(architecture="transformer")
    with pytest.raises(ConfigError, match="gate_prior"):
        ModelOptions(architecture="sidecar", gate_prior=True)
    with pytest.raises(ConfigError, match="offsets"):
        ModelOptions(architecture="per_layer_mlp", offsets=((0, 0), (0, 2)))
    with pytest.raises(ConfigError, match="hidden_dim"):
        PredictorConfig(gate_prior=True, feature_dim=4, layer_count=2, expert_count=8)
    with pytest.raises(ConfigError, match="teacher"):
        RoutePredictor(PredictorConfig(gate_prior=True, feature_dim=4, layer_count=2,
                                       expert_count=8, hidden_dim=4))


def test_the_model_is_the_benchs_predictor_and_p1_rows_of_the_last_layer_are_zero() -> None:
    torch.manual_seed(0)
    cfg = PredictorConfig(architecture="shared_lowrank", width=8, feature_dim=6,
                          layer_count=3, expert_count=16, offsets=((0, 0), (0, 1)))
    assert cfg.name == PredictorSpec(architecture="shared_lowrank", width=8).name
    model = RoutePredictor(cfg)
    layer = torch.tensor([0, 1, 2, 2])
    scores = model(torch.randn(4, 6), layer)
    assert scores.shape == (4, 2, 16)
    assert torch.equal(scores[2:, 1], torch.zeros(2, 16)) and scores[:2, 1].abs().sum() > 0
    target, valid = model.target_layers(layer)
    assert target[:, 1].tolist() == [1, 2, 2, 2] and valid[:, 1].tolist() == [1, 1, 0, 0]
    model.set_calibration(1, PlattCalibration(scale=0.5, bias=-1.0))
    assert model.calibration(1) == PlattCalibration(scale=0.5, bias=-1.0)
    knots = tuple(float(v) for v in torch.linspace(0.01, 0.99, KNOTS))
    mapped = PlattCalibration(scale=0.5, knot_x=knots, knot_y=tuple(v * v for v in knots))
    model.set_calibration(0, mapped)  # the isotonic map travels in the state dict
    restored = RoutePredictor(cfg)
    restored.load_state_dict(model.state_dict())
    assert restored.calibration(0) == mapped and restored.calibration(1).knot_x == ()
    decayed = {id(p) for g in make_optimizer(model, TrainConfig()).param_groups
               if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert not any("layer_film" in n or "expert_bias" in n for n in names)


def test_a_gate_prior_predictor_trains_saves_and_is_what_evaluation_scores(
        small: PlantedSnapshot, prior_ckpt: Path) -> None:
    loaded = load_checkpoint(prior_ckpt)
    assert isinstance(loaded.model, RoutePredictor) and loaded.method == "learned"
    assert loaded.model.config.name == "per_layer_mlp+gate_prior@16"
    assert loaded.lineage["config"]["model"]["architecture"] == "per_layer_mlp"
    calibration = loaded.model.calibration(0)
    assert calibration != PlattCalibration()  # fitted on validation, saved with the model
    assert loaded.lineage["training"]["best_step"] in (0, 20, 40, 60)
    report = evaluate(small.directory, prior_ckpt, EvaluateConfig(progress=False),
                      router=router_of(small))
    recall = _recall(report)
    # it starts at the native-gate control (step 0 is validated) and keeps the best state
    assert recall["learned"] >= recall["native_gate"] - 0.01 and recall["native_gate"] > 0.9
    assert report["offline"]["features"] == {"learned": "pre_attention+gate_logits"}
    node = next(r for r in report["offline"]["results"] if r["method"] == "learned")
    assert node["splits"]["validation"]["overall"]["calibration"]["ece"] < 0.2


def test_a_per_layer_mlp_learns_past_the_history_controls(small: PlantedSnapshot,
                                                          tmp_path: Path) -> None:
    result = train(small.directory, tmp_path, dataclasses.replace(
        config(architecture="per_layer_mlp", rank=32, offsets=((0, 0), (0, 1))),
        optim=OptimConfig(max_steps=80, lr=1e-2, min_lr=1e-3, warmup_steps=5)))
    assert result.lineage["geometry"]["offsets"] == [[0, 0], [0, 1]]
    # the recipe validates the initialisation too (step 0), then every 20 steps
    assert [r["step"] for r in result.history] == [0, 20, 40, 60, 80]
    assert result.lineage["training"]["recipe"] == "train.recipe.fit_predictor"
    report = evaluate(small.directory, tmp_path, EvaluateConfig(progress=False))
    recall = _recall(report)
    assert recall["learned"] > max(v for k, v in recall.items() if k != "learned") + 0.1
    (next_layer,) = report["auxiliary"]
    assert next_layer["method"] == "learned_next_layer"


def test_resume_and_the_teacher_requirement(small: PlantedSnapshot, prior_ckpt: Path,
                                            tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    settings = config(architecture="per_layer_mlp", gate_prior=True)
    with pytest.raises(ConfigError, match="--teacher"):
        train(small.directory, tmp_path / "a", settings)
    monkeypatch.setattr(trainer_module, "load_gate", lambda d, s: GateWeights(
        router_LEH=small.router_LEH.astype(np.float64), norm_gain_LH=small.gain_LH,
        lift_DH=np.linalg.pinv(small.projection.matrix_HD.astype(np.float64))))
    resumed = train(small.directory, tmp_path / "b", dataclasses.replace(
        settings, optim=OptimConfig(max_steps=5, warmup_steps=1)), resume=prior_ckpt,
        teacher_dir=tmp_path)
    assert resumed.lineage["parent"] == load_checkpoint(prior_ckpt).lineage["checkpoint_id"]
    with pytest.raises(CheckpointError, match="does not fit"):
        train(small.directory, tmp_path / "c", config(), resume=prior_ckpt)


def test_the_simulator_ranks_with_the_predictor(small: PlantedSnapshot,
                                                prior_ckpt: Path) -> None:
    from hebrus_flywheel.train.qualify.collect_model import HoldoutRows, sidecar_ranked

    loaded = load_checkpoint(prior_ckpt)
    features = np.random.default_rng(0).normal(size=(3, 4, 32)).astype(np.float32)
    rows = HoldoutRows(features_NLD=features, routes_NLK=np.zeros((3, 4, 10), np.int64),
                       sequence_N=np.zeros(3, np.int64), ordinal_N=np.arange(3), threads=("t",))
    own, nxt = sidecar_ranked(loaded, rows, 12)
    assert own.shape == (3, 4, 12) and nxt is None
    with torch.no_grad():
        scores = loaded.model(torch.from_numpy(features.reshape(12, 32)),
                              torch.arange(4).repeat(3))[:, 0]
    assert np.array_equal(own.reshape(12, 12), scores.argsort(dim=1, descending=True,
                                                              stable=True)[:, :12].numpy())


def test_flywheel_train_and_the_ablation_are_one_recipe(small: PlantedSnapshot,
                                                         tmp_path: Path) -> None:
    """The checkpoint of `flywheel train` holds the parameters the ablation chose for the
    same spec: one function (train.recipe.fit_predictor) trains both."""
    from hebrus_flywheel.train.losses import LossConfig
    from hebrus_flywheel.train.predictor_bench import BenchConfig, train_one
    from hebrus_flywheel.train.predictor_data import load_rows

    snapshot = Snapshot(small.directory)
    spec = PredictorSpec(architecture="per_layer_mlp", width=16)
    bench = BenchConfig(specs=(spec,), steps=40, batch_size=128, lr=1e-2, eval_every=10,
                        patience=2, seed=3)
    L, E = int(snapshot.geometry["layers"]), snapshot.expert_count
    item = train_one(spec, load_rows(snapshot, "train"), load_rows(snapshot, "validation"),
                     None, bench, layer_count=L, expert_count=E)
    settings = TrainConfig(
        threads=1, seed=3, method="learned", loss=LossConfig(calibration_weight=0.0),
        model=ModelOptions(architecture="per_layer_mlp", rank=16),
        data=DataOptions(batch_size=128, num_workers=0),
        optim=OptimConfig(max_steps=40, lr=1e-2, min_lr=1e-3),
        schedule=ScheduleConfig(eval_every=10, progress=False, patience=2))
    result = train(small.directory, tmp_path, settings)
    head = load_checkpoint(tmp_path).model.heads[0]
    mine, theirs = head.state_dict(), item.model.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert result.lineage["training"]["best_step_per_layer"] == item.best_step
    assert load_checkpoint(tmp_path).model.calibration(0) == item.calibration
