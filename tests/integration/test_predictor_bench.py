"""``flywheel predictors`` through the CLI on a sealed snapshot whose routes are the real
tiny teacher's gates applied to planted pre-attention states (no broker).

The native-gate control must find the routes; every learned model carries exact-match@k
and ECE lines at the literature budgets; the gate-prior models start at the control and
keep their best validation state, so they are at least as good as the control there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hebrus_flywheel.train.cli import predictors_command
from hebrus_flywheel.train.figures import figure_value, read_figures
from tests.support.planted import (
    PlantedConfig,
    PlantedSnapshot,
    make_writable,
    write_planted_snapshot,
)

pytestmark = pytest.mark.slow

PLANTED = PlantedConfig(threads={"train": 4, "validation": 2, "runtime_holdout": 1},
                        tokens_per_thread=24, anchors_per_window=6, layers=4, experts=512,
                        hidden_dim=64, feature_dim=64)


@pytest.fixture(scope="module")
def planted(teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[PlantedSnapshot]:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher
    from hebrus_flywheel.train.evaluate import router_weights

    teacher = load_teacher(teacher_dir)
    router = router_weights(teacher)
    root = tmp_path_factory.mktemp("predictor-snapshot")
    yield write_planted_snapshot(root, PLANTED, router_LEH=router.router_LEH,
                                 gain_LH=router.norm_gain_LH,
                                 identity=build_runtime_identity(teacher))
    make_writable(root)


def test_predictors_writes_figures_for_every_model(planted: PlantedSnapshot, teacher_dir: Path,
                                                   tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("predictors")(predictors_command)
    app.command("unused")(lambda: None)
    done = CliRunner().invoke(app, [
        "predictors", "--snapshot", str(planted.directory), "--teacher", str(teacher_dir),
        "--out", str(tmp_path), "--steps", "20", "--width", "8"])
    assert done.exit_code == 0, done.output
    assert "best learned (chosen on validation)" in done.output
    lines = read_figures(tmp_path / "predictor-figures.jsonl")
    learned = {x["model"] for x in lines if x["kind"] == "learned"}
    assert len(learned) == 10 and "p1_per_layer_mlp+gate_prior@8" in learned
    assert {x["budget"] for x in lines if x["figure"] == "recall_at_budget"} == {10, 20, 30, 40}
    for model in learned:
        for split in ("validation", "runtime_holdout"):
            assert figure_value(lines, model=model, figure="ece", split=split) is not None
            assert figure_value(lines, model=model, figure="exact_match_at_k",
                                split=split) is not None
    gate = figure_value(lines, model="native_gate", figure="recall_at_budget",
                        split="validation", budget=10)
    prior = figure_value(lines, model="per_layer_mlp+gate_prior@8",
                         figure="recall_at_budget", split="validation", budget=10)
    assert gate is not None and gate > 0.99
    assert prior is not None and prior >= gate - 1e-9
    assert (tmp_path / "predictor-report.md").read_text().startswith("| model |")
