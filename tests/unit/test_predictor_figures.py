"""predictor-figures.jsonl: literature budgets, one line per figure, learned models carry
exact-match@k and ECE, Gate 3 judges the best learned model against the best control."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.exceptions import SnapshotError
from hebrus_flywheel.train.figures import (
    figure_value,
    literature_budgets,
    read_figures,
    result_lines,
    write_figures,
)
from hebrus_flywheel.train.metrics import MetricsAccumulator, MetricsConfig
from hebrus_flywheel.train.qualify.gates_figures import best_learned, figures_checks

E, K = 16, 2


def _result(method: str, scores: np.ndarray, targets: np.ndarray, *,
            probabilities: np.ndarray | None = None) -> dict:
    acc = MetricsAccumulator(MetricsConfig(expert_count=E, top_k=K, budgets=literature_budgets(K),
                                           union_max_window=2), method=method)
    rows = len(targets)
    acc.update(target_ids_BK=targets, layer_B=np.arange(rows) % 2, split_B="validation",
               scores_BE=scores, membership_prob_BE=probabilities,
               domain_B=np.array(["code"] * rows), thread_B=np.array(["t"] * rows),
               ordinal_B=np.arange(rows) // 2)
    return acc.result()


def _perfect(rows: int = 6) -> tuple[np.ndarray, np.ndarray]:
    targets = np.array([[i % E, (i + 1) % E] for i in range(rows)])
    scores = np.zeros((rows, E))
    np.put_along_axis(scores, targets, [2.0, 1.0], axis=1)
    return scores, targets


def test_literature_budgets_are_multiples_of_k() -> None:
    assert literature_budgets(10) == (10, 20, 30, 40)
    with pytest.raises(ConfigError, match="top_k"):
        literature_budgets(0)


def test_lines_cover_every_budget_and_the_byte_budget() -> None:
    scores, targets = _perfect()
    probs = np.where(scores > 0, 0.9, 0.01)
    lines = result_lines(_result("mlp", scores, targets, probabilities=probs), kind="learned",
                         target="same_layer", expert_bytes=100)
    overall = [x for x in lines if x["group"] == "overall"]
    recall = {x["budget"]: x for x in overall if x["figure"] == "recall_at_budget"}
    assert sorted(recall) == [2, 4, 6, 8]
    assert all(x["bytes"] == 100 * x["budget"] for x in overall)
    assert figure_value(lines, model="mlp", figure="exact_match_at_k", split="validation") == 1.0
    assert figure_value(lines, model="mlp", figure="mrr", split="validation") == 1.0
    assert {x["group"] for x in lines} >= {"overall", "layer=0", "layer=1", "domain=code"}
    assert any(x["figure"] == "union_growth" for x in overall)


def test_learned_models_must_carry_ece(tmp_path) -> None:
    scores, targets = _perfect()
    lines = result_lines(_result("mlp", scores, targets), kind="learned", target="same_layer",
                         expert_bytes=1)
    with pytest.raises(SnapshotError, match="ece"):
        write_figures(tmp_path / "f.jsonl", lines)


def test_round_trip_and_bad_line(tmp_path) -> None:
    scores, targets = _perfect()
    lines = result_lines(_result("native_gate", scores, targets), kind="control",
                         target="same_layer", expert_bytes=1)
    path = write_figures(tmp_path / "f.jsonl", lines)
    assert read_figures(path) == [json.loads(t) for t in path.read_text().splitlines()]
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(SnapshotError, match=r"f.jsonl:\d+ is not JSON"):
        read_figures(path)


def _lines(recall: dict[str, float], exact: dict[str, float], ece: float) -> tuple[dict, ...]:
    out = []
    for model, value in recall.items():
        kind = "control" if model.startswith("ctl") else "learned"
        for split in ("validation", "runtime_holdout"):
            base = {"model": model, "kind": kind, "split": split, "budget": K,
                    "group": "overall", "target": "same_layer"}
            out.append({**base, "figure": "recall_at_budget", "value": value})
            out.append({**base, "figure": "exact_match_at_k", "value": exact[model]})
            if kind == "learned":
                out.append({**base, "figure": "ece", "value": ece})
    return tuple(out)


def test_gate3_figures_pass_and_fail() -> None:
    good = _lines({"ctl": 0.90, "a": 0.95, "b": 0.93}, {"ctl": 0.5, "a": 0.6, "b": 0.9}, 0.01)
    assert best_learned(good, K) == "a"  # chosen on validation recall, not exact match
    checks, table = figures_checks(good, splits=("validation", "runtime_holdout"), top_k=K,
                                   margin=0.02, max_ece=0.05)
    assert all(c.status == "pass" for c in checks), checks
    assert table["best_learned"] == "a"
    close = _lines({"ctl": 0.94, "a": 0.95}, {"ctl": 0.5, "a": 0.6}, 0.2)
    checks, _ = figures_checks(close, splits=("validation",), top_k=K, margin=0.02, max_ece=0.05)
    failed = {c.name for c in checks if c.status == "fail"}
    assert failed == {"figures_recall_at_budget_validation", "figures_ece_validation"}
