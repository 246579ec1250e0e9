"""Train and evaluate through the CLI with the real tiny teacher's routers (no broker).

The snapshot is sealed with the consumers' writer and manifest code; its routes come from
the teacher's own gate matrices (and the gain of the norm before them) applied to planted
pre-attention states, and its identity is the teacher's runtime identity. So
``flywheel evaluate --teacher DIR`` must load those gates, lift the reduced features with
the recorded projection and find the native routes again, and must refuse a teacher that
is not the snapshot's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from hebrus_flywheel.train.cli import evaluate_command, train_command
from hebrus_flywheel.train.exceptions import BaselineError
from tests.support.planted import (
    PlantedConfig,
    PlantedSnapshot,
    make_writable,
    write_planted_snapshot,
)

pytestmark = pytest.mark.slow

PLANTED = PlantedConfig(threads={"train": 4, "validation": 2, "temporal_holdout": 1},
                        tokens_per_thread=24, anchors_per_window=6, layers=4, experts=512,
                        hidden_dim=64, feature_dim=64)


@pytest.fixture(scope="module")
def teacher_snapshot(teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[tuple[PlantedSnapshot, dict[str, Any]]]:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher
    from hebrus_flywheel.train.evaluate import router_weights

    teacher = load_teacher(teacher_dir)
    router = router_weights(teacher)
    identity = build_runtime_identity(teacher)
    root = tmp_path_factory.mktemp("teacher-snapshot")
    yield write_planted_snapshot(root, PLANTED, router_LEH=router.router_LEH,
                                 gain_LH=router.norm_gain_LH, identity=identity), identity
    make_writable(root)


# The planted snapshots name no consent ledger of their own (prefix ""): these tests are
# about the teacher's routes; the ledger path is tested in test_consent.py and the unit
# tests of train.consent.


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("train")(train_command)
    app.command("evaluate")(evaluate_command)
    return app


def test_evaluate_with_the_teacher_finds_the_native_routes(
        teacher_snapshot: tuple[PlantedSnapshot, dict[str, Any]], teacher_dir: Path,
        tmp_path: Path) -> None:
    snapshot, identity = teacher_snapshot
    assert snapshot.manifest["identity"]["identity_id"] == identity["identity_id"]
    config = tmp_path / "t.toml"
    config.write_text("threads = 1\n[data]\nnum_workers = 0\nbatch_size = 256\n"
                      "[schedule]\neval_every = 20\n")
    runner = CliRunner()
    done = runner.invoke(_app(), ["train", "--snapshot", str(snapshot.directory), "--out",
                                  str(tmp_path / "ck"), "--config", str(config),
                                  "--max-steps", "40", "--no-progress", "--no-consent-ledger"])
    assert done.exit_code == 0, done.output
    shown = runner.invoke(_app(), ["evaluate", "--snapshot", str(snapshot.directory),
                                   "--checkpoint", str(tmp_path / "ck"), "--teacher",
                                   str(teacher_dir), "--out", str(tmp_path / "r.json"),
                                   "--no-progress", "--no-consent-ledger"])
    assert shown.exit_code == 0, shown.output
    assert "native_gate" in shown.output and "temporal_holdout" in shown.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["snapshot"]["splits"] == ["validation", "temporal_holdout"]
    gate = next(r for r in report["offline"]["results"] if r["method"] == "native_gate")
    for split in ("validation", "temporal_holdout"):
        assert gate["splits"][split]["overall"]["recall"]["10"] > 0.99


def test_evaluate_refuses_a_teacher_that_is_not_the_snapshots(
        teacher_snapshot: tuple[PlantedSnapshot, dict[str, Any]], teacher_dir: Path,
        tmp_path: Path) -> None:
    from hebrus_flywheel.train.evaluate import EvaluateConfig, evaluate

    _, identity = teacher_snapshot
    other = write_planted_snapshot(tmp_path / "other", dataclasses.replace(PLANTED, seed=3),
                                   identity={**identity, "model_artifact_digest": "f" * 64})
    try:
        runner = CliRunner()
        done = runner.invoke(_app(), ["train", "--snapshot", str(other.directory), "--out",
                                      str(tmp_path / "ck"), "--max-steps", "2", "--threads", "1",
                                      "--workers", "0", "--no-progress", "--no-consent-ledger"])
        assert done.exit_code == 0, done.output
        with pytest.raises(BaselineError, match="artifact digest"):
            evaluate(other.directory, tmp_path / "ck", EvaluateConfig(progress=False),
                     teacher_dir=teacher_dir)
    finally:
        make_writable(tmp_path / "other")


def test_train_a_gate_prior_predictor_with_the_teacher_and_evaluate_it(
        teacher_snapshot: tuple[PlantedSnapshot, dict[str, Any]], teacher_dir: Path,
        tmp_path: Path) -> None:
    """`flywheel train --model per_layer_mlp --gate-prior --teacher DIR`: the checkpoint
    carries the teacher's routers, so evaluation (and qualification) score it as saved."""
    from hebrus_flywheel.train.checkpoint import load_checkpoint
    from hebrus_flywheel.train.predictor_model import RoutePredictor

    snapshot, _ = teacher_snapshot
    config = tmp_path / "t.toml"
    config.write_text("threads = 1\n[data]\nnum_workers = 0\nbatch_size = 256\n")
    args = ["train", "--snapshot", str(snapshot.directory), "--out", str(tmp_path / "ck"),
            "--config", str(config), "--max-steps", "30", "--eval-every", "15", "--no-progress",
            "--no-consent-ledger", "--model", "per_layer_mlp", "--gate-prior", "--width", "16",
            "--method", "plm-gate", "--lr", "0.001"]
    runner = CliRunner()
    refused = runner.invoke(_app(), args)
    assert refused.exit_code != 0 and "--teacher" in str(refused.exception)
    done = runner.invoke(_app(), [*args, "--teacher", str(teacher_dir)])
    assert done.exit_code == 0, done.output
    loaded = load_checkpoint(tmp_path / "ck")
    assert isinstance(loaded.model, RoutePredictor) and loaded.method == "plm-gate"
    shown = runner.invoke(_app(), ["evaluate", "--snapshot", str(snapshot.directory),
                                   "--checkpoint", str(tmp_path / "ck"), "--teacher",
                                   str(teacher_dir), "--out", str(tmp_path / "r.json"),
                                   "--no-progress", "--no-consent-ledger"])
    assert shown.exit_code == 0, shown.output
    report = json.loads((tmp_path / "r.json").read_text())
    recall = {r["method"]: r["splits"]["validation"]["overall"]["recall"]["10"]
              for r in report["offline"]["results"]}
    # it starts at the native gate (which finds the planted routes) and keeps its best
    assert recall["native_gate"] > 0.99 and recall["plm-gate"] >= recall["native_gate"] - 0.01
    assert report["offline"]["features"] == {"plm-gate": "pre_attention+gate_logits"}


def test_the_shadow_simulator_gets_the_native_gate_control(
        teacher_snapshot: tuple[PlantedSnapshot, dict[str, Any]], teacher_dir: Path) -> None:
    """Gate 6's control: the teacher's router ranks the same rows the candidate ranks."""
    import numpy as np

    from hebrus_flywheel.train.data import Snapshot
    from hebrus_flywheel.train.predictor_data import load_rows
    from hebrus_flywheel.train.qualify.collect_model import HoldoutRows, native_gate_ranked

    snapshot, _ = teacher_snapshot
    rows = load_rows(Snapshot(snapshot.directory), "validation")
    L = PLANTED.layers
    n = len(rows) // L
    holdout = HoldoutRows(features_NLD=rows.feature_ND.reshape(n, L, -1),
                          routes_NLK=rows.target_NK.reshape(n, L, -1),
                          sequence_N=np.zeros(n, np.int64), ordinal_N=np.arange(n),
                          threads=("t",))
    ranked = native_gate_ranked(snapshot.directory, teacher_dir, holdout, 16)
    assert ranked.shape == (n, L, 16)
    hits = (ranked[..., :10, None] == holdout.routes_NLK[..., None, :]).any(-1).mean()
    assert hits > 0.99
