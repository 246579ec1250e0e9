"""The demo uses the pretrained teacher unless told otherwise, runs the predictor bench
after evaluate, and hands its figures file to qualify."""

from __future__ import annotations

from pathlib import Path

import pytest

from hebrus_flywheel import demo


def test_teacher_is_pretrained_unless_random_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLYWHEEL_DEMO_TEACHER", raising=False)
    assert demo._teacher_name() == "tiny-qwen3-next-pretrained"
    monkeypatch.setenv("FLYWHEEL_DEMO_TEACHER", "random")
    assert demo._teacher_name() == "tiny-qwen3-next"


def test_predictors_run_before_qualify_and_feed_it(tmp_path: Path) -> None:
    names = [name for name, _ in demo.STAGES]
    assert names.index("evaluate") < names.index("predictors") < names.index("qualify")
    ctx = demo.DemoContext(home=tmp_path, bootstrap="x", teacher_dir=tmp_path, run_dir=tmp_path,
                           dataset_dir=tmp_path, epoch=0, threads=1)
    assert demo._figures_args(ctx) == []
    ctx.results["predictor_figures"] = str(tmp_path / "predictor-figures.jsonl")
    assert demo._figures_args(ctx) == ["--predictor-figures",
                                       str(tmp_path / "predictor-figures.jsonl")]
