"""Model B, the route sidecar on candidate positions, on a tiny learnable fixture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.candidates.bench import run_model_b, write_candidate_figures
from hebrus_flywheel.train.candidates.evaluate import strongest_fair_control
from hebrus_flywheel.train.candidates.model import (
    AcceptanceLoss,
    AcceptanceLossConfig,
    acceptance_schedule,
)
from hebrus_flywheel.train.candidates.rows import acceptance_by_position, load_candidate_rows
from hebrus_flywheel.train.candidates.train import CandidateTrainConfig
from hebrus_flywheel.train.exceptions import SnapshotError
from hebrus_flywheel.train.figures import read_figures
from tests.support.candidates import candidate_table


@pytest.fixture(scope="module")
def table():
    return candidate_table(proposals=60, experts=16, top_k=2, layers=2, block=4)


@pytest.fixture(scope="module")
def model_b(table):
    config = CandidateTrainConfig(width=16, steps=60, batch_size=128, eval_every=20, lr=1e-2)
    return run_model_b(table, expert_count=16, expert_bytes=100, config=config)


def test_rows_flatten_layers_and_measure_acceptance(table):
    rows = load_candidate_rows(table, "train")
    n = sum(s == "train" for s in table.column("split").to_pylist())
    assert len(rows) == 2 * n and rows.target_NK.shape == (2 * n, 2)
    acceptance = acceptance_by_position(rows)
    assert sorted(acceptance) == [1, 2, 3, 4]
    assert acceptance[1] > acceptance[4]  # the fixture's acceptance drops with position
    assert (rows.accepted_N == (rows.position_N <= rows.accepted_length_N)).all()


def test_a_table_without_the_contract_is_refused(table):
    with pytest.raises(SnapshotError, match="accepted"):
        load_candidate_rows(table.drop(["accepted"]), "train")


def test_acceptance_schedule_is_measured_and_floored():
    schedule = acceptance_schedule({1: 0.9, 2: 0.01}, floor=0.05)
    assert schedule.table == (1.0, 0.9, 0.05)
    with pytest.raises(ConfigError):
        acceptance_schedule({})


def test_rejected_rows_carry_an_overfetch_cost():
    loss = AcceptanceLoss(acceptance_schedule({1: 0.5}), AcceptanceLossConfig(useful_weight=1.0))
    target = torch.tensor([[0, 1]])
    args = {"layer_B": torch.tensor([0]), "position_B": torch.tensor([1])}
    low, high = torch.full((1, 4), -3.0), torch.full((1, 4), 3.0)
    for scores in (low, high):
        scores[0, :2] += 1.0  # same ranking, different level
    rejected = torch.tensor([False])
    cost_low = loss(low, target, accepted_B=rejected, **args)["total"]
    cost_high = loss(high, target, accepted_B=rejected, **args)["total"]
    assert cost_high > cost_low  # confident hints for a rejected suffix cost more
    accepted = loss(high, target, accepted_B=torch.tensor([True]), **args)["useful"]
    assert accepted < loss(high, target, accepted_B=rejected, **args)["useful"]


def test_model_b_beats_the_fair_controls_at_equal_budget(model_b):
    _, report = model_b
    summary = report["summary"]["validation/all"]
    assert summary["control"] in ("frequency", "position_frequency", "random")
    assert summary["recall"] > summary["control_recall"] + 0.05
    best, theirs = strongest_fair_control(report["lines"], split="validation", budget=2)
    assert (best, theirs) == (summary["control"], summary["control_recall"])
    assert report["acceptance"]["1"] > report["acceptance"]["4"]


def test_figure_lines_name_the_product_and_positions(model_b, tmp_path):
    _, report = model_b
    path = write_candidate_figures(report, tmp_path)
    lines = read_figures(path)
    assert {line["product"] for line in lines} == {"candidate_path"}
    groups = {line["group"] for line in lines if line["model"] == report["model"]}
    assert {"overall", "layer=0", "position=1", "position=4"} <= groups
    budgets = {line["budget"] for line in lines if line["figure"] == "recall_at_budget"}
    assert budgets == {2, 4, 6, 8}
    ece = [line for line in lines if line["figure"] == "ece" and line["model"] == report["model"]]
    assert ece and {line["subset"] for line in ece} == {"all", "accepted"}
    union = [line for line in lines if line["figure"] == "union_growth"
             and line["group"] == "overall" and line["subset"] == "all"]
    assert union and all(line["window"] == 4 for line in union)
    assert np.isfinite([line["value"] for line in lines]).all()


def test_a_clean_path_snapshot_is_not_read_as_candidates(tmp_path):
    from hebrus_flywheel.train.candidates.rows import read_candidate_table
    from tests.support.planted import PlantedConfig, write_planted_snapshot

    planted = write_planted_snapshot(tmp_path, PlantedConfig(
        threads={"train": 2, "validation": 1}, tokens_per_thread=8))
    with pytest.raises(SnapshotError, match="clean_path"):
        read_candidate_table(planted.directory)
