"""Model C, the block-size and admission governor."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.candidates.rows import load_candidate_rows
from hebrus_flywheel.train.governor import (
    GovernorConfig,
    PathSummaries,
    block_table,
    governor_report,
    recommend_block,
    summarize_paths,
)
from tests.support.candidates import candidate_table


def _summaries(corr: float) -> dict[str, PathSummaries]:
    table = candidate_table(proposals=120, experts=16, top_k=2, path_correlation=corr,
                            noise=0.1)
    return {s: summarize_paths(load_candidate_rows(table, s), expert_count=16)
            for s in ("train", "validation")}


def test_tau_and_union_are_measured_per_block():
    rows = load_candidate_rows(candidate_table(proposals=4, block=3, layers=1, experts=8,
                                               top_k=2, validation_share=0.0), "train")
    s = summarize_paths(rows, expert_count=8)
    table = block_table(s, GovernorConfig(expert_bytes=10))
    lengths = np.asarray(s.accepted_P)
    assert [r["tau"] for r in table] == pytest.approx(
        [np.minimum(lengths, b).mean() for b in (1, 2, 3)])
    assert table[0]["union"] == 2.0  # one position: exactly its top-k
    for p, path in enumerate(np.unique(rows.path_N.astype(str))):
        ids = rows.target_NK[rows.path_N.astype(str) == path]
        assert s.union_PB[p].tolist() == [len(set(ids[:b].ravel())) for b in (1, 2, 3)]
    assert all(r["break_even"] == (r["union"] < 2 * r["tau"]) for r in table)
    assert table[1]["missing_bytes"] == pytest.approx(10 * table[1]["union"])


def test_overlapping_routes_break_even_and_independent_ones_do_not():
    apart = governor_report(_summaries(0.0))
    shared = governor_report(_summaries(0.9))
    assert apart["recommended_block"] is None
    assert not any(r["break_even"] for r in apart["tables"]["validation"])
    best = max(shared["tables"]["validation"], key=lambda r: r["net_experts"])
    assert shared["recommended_block"] == best["block"] and best["break_even"]
    json.dumps(shared, allow_nan=False)


def test_admission_is_calibrated_without_the_holdouts():
    summaries = _summaries(0.9)
    summaries["temporal_holdout"] = dataclasses.replace(summaries["validation"],
                                                        split="temporal_holdout")
    result = governor_report(summaries)
    validation = result["admission"]["validation"]
    assert validation["net_experts_governed"] >= validation["net_experts_admit_all"]
    assert 0 < validation["admitted"] < validation["paths"]
    holdout = summaries["temporal_holdout"]
    holdout.accepted_P = np.zeros_like(holdout.accepted_P)  # a hostile holdout
    assert summaries["validation"].accepted_P.any()
    again = governor_report(summaries)
    assert again["admission_threshold"] == result["admission_threshold"]
    assert again["recommended_block"] == result["recommended_block"]
    assert again["admission"]["temporal_holdout"]["net_experts_admit_all"] < 0


def test_deadline_slack_bounds_the_block():
    summaries = _summaries(0.9)
    table = block_table(summaries["validation"], GovernorConfig(
        expert_bytes=100, bandwidth_bytes_per_s=100.0, slack_s=3.0))
    assert [r["fits_deadline"] for r in table] == [r["union"] <= 3.0 for r in table]
    assert recommend_block(table) in [r["block"] for r in table
                                      if r["fits_deadline"] and r["break_even"]] + [None]
    with pytest.raises(ConfigError):
        GovernorConfig(resident_fraction=1.5)
    with pytest.raises(ConfigError):
        governor_report({"validation": summaries["validation"]})


def test_model_b_predictions_give_the_predicted_union():
    rows = load_candidate_rows(candidate_table(proposals=10, experts=16, top_k=2), "train")
    s = summarize_paths(rows, expert_count=16, predicted_NC=rows.target_NK)
    assert np.allclose(s.predicted_union_PB, s.union_PB)
    row = block_table(s, GovernorConfig())[1]
    assert row["predicted_union"] == pytest.approx(row["union"])
