"""The demo uses the pretrained teacher unless told otherwise, runs the predictor bench
before training, trains the same-layer predictor the bench chose on validation, and hands
its figures file to qualify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hebrus_flywheel import demo, demo_context, demo_learn
from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.train.predictor_bench import method_name, train_arguments


def test_teacher_is_pretrained_unless_random_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLYWHEEL_DEMO_TEACHER", raising=False)
    assert demo_context.teacher_name() == "tiny-qwen3-next-pretrained"
    monkeypatch.setenv("FLYWHEEL_DEMO_TEACHER", "random")
    assert demo_context.teacher_name() == "tiny-qwen3-next"


def test_predictors_run_before_qualify_and_feed_it(tmp_path: Path) -> None:
    names = [name for name, _ in demo.STAGES]
    assert names.index("predictors") < names.index("train") < names.index("evaluate")
    assert names.index("evaluate") < names.index("qualify")
    ctx = demo.DemoContext(home=tmp_path, bootstrap="x", teacher_dir=tmp_path, run_dir=tmp_path,
                           dataset_dir=tmp_path, epoch=0, threads=1)
    assert demo_learn._figures_args(ctx) == []
    ctx.results["predictor_figures"] = str(tmp_path / "predictor-figures.jsonl")
    assert demo_learn._figures_args(ctx) == ["--predictor-figures",
                                       str(tmp_path / "predictor-figures.jsonl")]


def test_train_gets_the_same_layer_choice_of_validation(tmp_path: Path) -> None:
    ctx = demo.DemoContext(home=tmp_path, bootstrap="x", teacher_dir=tmp_path, run_dir=tmp_path,
                           dataset_dir=tmp_path, epoch=0, threads=1)
    spec = {"architecture": "per_layer_mlp", "gate_prior": True, "target_offset": 0,
            "width": 128}
    summary = {"goal": {"same_layer": {"best_learned": "per_layer_mlp+gate_prior@128"},
                        "next_layer": {"best_learned": "p1_shared_lowrank@32"}},
               "training": {"per_layer_mlp+gate_prior@128": {"spec": spec}}}
    (tmp_path / "predictor-summary.json").write_text(json.dumps(summary))
    chosen = demo_learn._chosen_predictor(ctx)
    assert chosen == {"name": "per_layer_mlp+gate_prior@128", **spec}
    args = train_arguments(chosen)
    assert args[:6] == ["--model", "per_layer_mlp", "--width", "128", "--gate-prior",
                        "--method"]
    assert args[6] == method_name(spec) == "per_layer_mlp-gate_prior-w128"
    assert float(args[args.index("--lr") + 1]) == pytest.approx(3e-3 * 0.3)
    summary["goal"]["same_layer"]["best_learned"] = None
    (tmp_path / "predictor-summary.json").write_text(json.dumps(summary))
    with pytest.raises(FlywheelError, match="no same-layer model"):
        demo_learn._chosen_predictor(ctx)
