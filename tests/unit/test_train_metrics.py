"""Metrics against hand-computed values, a golden result file, and split separation."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.exceptions import BatchError, SplitMixingError
from hebrus_flywheel.train.metrics import (
    EVALUATION_SPLITS,
    SPLITS,
    MetricsAccumulator,
    MetricsConfig,
    check_train_rows,
    ranking,
    reliability_counts,
    row_metrics,
)

torch.set_num_threads(1)
GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "train_metrics_golden.json"
CONFIG = MetricsConfig(expert_count=8, top_k=2, budgets=(2, 3, 20), calibration_bins=4,
                       union_max_window=3)
# (split, thread, ordinal, layer, domain, full ranking best first, native top-2)
ROWS = [
    ("validation", "a", 0, 0, "code", [1, 2, 3, 4, 5, 6, 7, 0], [1, 2]),
    ("validation", "a", 1, 0, "code", [3, 5, 2, 0, 1, 4, 6, 7], [5, 0]),
    ("validation", "a", 2, 0, "chat", [0, 1, 2, 3, 4, 5, 6, 7], [7, 6]),
    ("validation", "a", 0, 1, "chat", [4, 6, 0, 1, 2, 3, 5, 7], [6, 4]),
    ("temporal_holdout", "b", 5, 1, "chat", [0, 1, 2, 3, 4, 5, 6, 7], [0, 3]),
]


def _batch(indices: list[int]) -> dict[str, Any]:
    rows = [ROWS[i] for i in indices]
    order_BE = np.array([r[5] for r in rows])
    scores_BE = np.zeros((len(rows), 8))
    np.put_along_axis(scores_BE, order_BE, np.arange(8.0, 0.0, -1.0)[None], axis=1)
    prob_BE = np.where(scores_BE >= 7, 0.9, 0.1)  # 0.9 for each row's top two
    return {"split_B": [r[0] for r in rows], "thread_B": [r[1] for r in rows],
            "ordinal_B": np.array([r[2] for r in rows]), "layer_B": np.array([r[3] for r in rows]),
            "domain_B": [r[4] for r in rows], "target_ids_BK": np.array([r[6] for r in rows]),
            "scores_BE": scores_BE, "membership_prob_BE": prob_BE}


def _result() -> dict[str, Any]:
    accumulator = MetricsAccumulator(CONFIG, method="hand")
    accumulator.update(**_batch([1, 3, 0]))  # shuffled within the batch
    accumulator.update(**_batch([2, 4]))
    return accumulator.result()


def test_overall_values_match_hand_computation() -> None:
    overall = _result()["splits"]["validation"]["overall"]
    assert overall["rows"] == 4
    assert overall["exact_match"] == pytest.approx(2 / 4)
    assert overall["recall"] == pytest.approx({"2": 2.5 / 4, "3": 2.5 / 4, "8": 1.0})
    assert overall["precision"] == pytest.approx({"2": 2.5 / 4, "3": (5 / 3) / 4, "8": 0.25})
    assert overall["rr_first"] == pytest.approx((1 + 1 / 2 + 1 / 7 + 1) / 4)
    assert overall["rr_top1"] == pytest.approx((1 + 1 / 2 + 1 / 8 + 1 / 2) / 4)


def test_calibration_matches_hand_computation() -> None:
    calibration = _result()["splits"]["validation"]["overall"]["calibration"]
    # ECE over each row's 2K = 4 best-ranked candidates: ranks 1-2 at p=0.9 (8 pairs, 5
    # native), ranks 3-4 at p=0.1 (8 pairs, 1 native: expert 0 of row 1). The other 16
    # (row, expert) pairs, confidently out, do not dilute it.
    assert calibration["ece"] == pytest.approx((abs(5 - 7.2) + abs(1 - 0.8)) / 16)
    top, bottom = calibration["reliability"][3], calibration["reliability"][0]
    assert (top["count"], bottom["count"]) == (8, 8)
    assert top["frequency"] == pytest.approx(5 / 8)
    assert bottom["mean_probability"] == pytest.approx(0.1)
    assert calibration["reliability"][1]["count"] == 0
    assert calibration["reliability"][1]["frequency"] is None


def test_union_growth_matches_hand_computation() -> None:
    validation = _result()["splits"]["validation"]
    union = validation["overall"]["union_growth"]
    assert union["windows"] == [1, 2, 3]
    assert union["target"] == [2.0, 4.0, 6.0]
    assert union["predicted"] == {"2": [2.0, 4.0, 5.0], "3": [3.0, 4.5, 5.0],
                                  "8": [8.0, 8.0, 8.0]}
    assert validation["by_layer"]["1"]["union_growth"]["target"] == [2.0, None, None]
    assert validation["by_domain"]["code"]["union_growth"]["target"] == [2.0, 4.0, None]
    assert validation["by_domain"]["chat"]["union_growth"]["target"] == [2.0, 4.0, 6.0]


def test_breakdowns_by_layer_domain_and_split() -> None:
    result = _result()
    validation = result["splits"]["validation"]
    assert list(validation["by_layer"]) == ["0", "1"]
    assert validation["by_layer"]["0"]["exact_match"] == pytest.approx(1 / 3)
    assert validation["by_layer"]["0"]["rr_first"] == pytest.approx((1.5 + 1 / 7) / 3)
    assert validation["by_domain"]["code"]["recall"]["2"] == pytest.approx(0.75)
    holdout = result["splits"]["temporal_holdout"]["overall"]
    assert holdout["rows"] == 1
    assert holdout["recall"] == pytest.approx({"2": 0.5, "3": 0.5, "8": 1.0})
    # ranks 1-2 (0, 1) at 0.9 hold one native, ranks 3-4 (2, 3) at 0.1 hold one
    assert holdout["calibration"]["ece"] == pytest.approx((abs(1 - 1.8) + abs(1 - 0.2)) / 4)
    assert list(result["splits"]) == ["validation", "temporal_holdout"]


def _assert_close(actual: Any, expected: Any, where: str = "$") -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            _assert_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_close(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert actual == pytest.approx(expected, rel=1e-12, abs=1e-12), where
    else:
        assert actual == expected, where


def test_result_matches_golden_file_and_is_json() -> None:
    result = json.loads(json.dumps(_result(), allow_nan=False))
    _assert_close(result, json.loads(GOLDEN.read_text()))


def test_candidates_give_the_same_result_as_scores() -> None:
    batch = _batch([0, 1, 2, 3])
    from_scores = MetricsAccumulator(CONFIG, method="m")
    from_scores.update(**{k: v for k, v in batch.items() if k != "membership_prob_BE"})
    candidates = {k: v for k, v in batch.items() if k not in ("scores_BE", "membership_prob_BE")}
    from_lists = MetricsAccumulator(CONFIG, method="m")
    from_lists.update(**candidates, candidates_BC=ranking(batch["scores_BE"]))
    assert from_lists.result() == from_scores.result()


def test_short_candidate_lists_score_missing_experts_as_absent() -> None:
    per_row = row_metrics(np.array([[4, 5, 6], [1, 0, 6]]), np.array([[0, 1], [0, 1]]), (2, 3))
    assert per_row["rr_first"].tolist() == [0.0, 1.0]
    assert per_row["rr_top1"].tolist() == [0.0, 0.5]
    assert per_row["recall@3"].tolist() == [0.0, 1.0]


def test_train_rows_never_reach_the_evaluator() -> None:
    accumulator = MetricsAccumulator(CONFIG, method="m")
    batch = _batch([0, 1])
    with pytest.raises(SplitMixingError, match="train row"):
        accumulator.update(**batch | {"split_B": ["validation", "train"]})
    with pytest.raises(SplitMixingError):
        accumulator.update(**batch | {"split_B": "train"})
    with pytest.raises(BatchError, match="unknown split"):
        accumulator.update(**batch | {"split_B": "holdout"})
    assert accumulator.result()["splits"] == {}
    with pytest.raises(SplitMixingError, match="train rows"):
        check_train_rows(["train", "validation"], 2)
    assert ("train", *EVALUATION_SPLITS) == SPLITS


def test_split_names_agree_with_the_stream_catalogue() -> None:
    topics = pytest.importorskip("hebrus_flywheel.streams.topics")
    assert topics.SPLITS == SPLITS


def test_bad_batches_are_refused() -> None:
    accumulator = MetricsAccumulator(CONFIG, method="m")
    batch = _batch([0, 1])
    without_scores = {k: v for k, v in batch.items() if k != "scores_BE"}
    with pytest.raises(BatchError, match="exactly one"):
        accumulator.update(**without_scores)
    with pytest.raises(BatchError, match="C >= 8"):
        accumulator.update(**without_scores, candidates_BC=np.array([[0, 1, 2]] * 2))
    with pytest.raises(BatchError, match="repeats"):
        accumulator.update(**without_scores, candidates_BC=np.tile(np.arange(8), (2, 1)) * 0)
    with pytest.raises(BatchError, match="expert ids"):
        accumulator.update(**batch | {"target_ids_BK": np.array([[0, 8], [1, 2]])})
    with pytest.raises(BatchError, match="NaN"):
        accumulator.update(**batch | {"scores_BE": np.full((2, 8), math.nan)})


def test_union_growth_requires_ordinal_order_and_probabilities_all_or_none() -> None:
    accumulator = MetricsAccumulator(CONFIG, method="m")
    accumulator.update(**_batch([1]))
    with pytest.raises(BatchError, match="ordinal order"):
        accumulator.update(**_batch([0]))
    mixed = MetricsAccumulator(CONFIG, method="m")
    mixed.update(**_batch([0]))
    with pytest.raises(BatchError, match="every batch or none"):
        mixed.update(**{k: v for k, v in _batch([1]).items() if k != "membership_prob_BE"})


def test_optional_inputs_and_torch_tensors() -> None:
    batch = _batch([0, 1, 3])
    accumulator = MetricsAccumulator(MetricsConfig(expert_count=8, top_k=2, budgets=(2,)),
                                     method="m")
    accumulator.update(target_ids_BK=torch.tensor(batch["target_ids_BK"]),
                       layer_B=torch.tensor(batch["layer_B"]), split_B="stress_holdout",
                       scores_BE=torch.tensor(batch["scores_BE"]))
    overall = accumulator.result()["splits"]["stress_holdout"]["overall"]
    assert overall["calibration"] is None and overall["union_growth"] is None
    assert list(accumulator.result()["splits"]["stress_holdout"]["by_domain"]) == [
        "unspecified"]


def test_budgets_clip_to_expert_count_and_config_is_checked() -> None:
    # the default budgets follow the teacher's k: k, 2k, 3k, 4k, clipped to E
    assert MetricsConfig(expert_count=512, top_k=10).effective_budgets == (10, 20, 30, 40)
    assert MetricsConfig(expert_count=64, top_k=8).effective_budgets == (8, 16, 24, 32)
    assert MetricsConfig(expert_count=10, top_k=4).effective_budgets == (4, 8, 10)
    assert MetricsConfig(expert_count=16, top_k=4, budgets=(10, 12, 20)).effective_budgets \
        == (10, 12, 16)
    with pytest.raises(ConfigError, match="budgets"):
        MetricsConfig(budgets=())
    with pytest.raises(ConfigError, match="top_k"):
        MetricsConfig(expert_count=4, top_k=5)
    with pytest.raises(ConfigError, match="union_max_window"):
        MetricsConfig(union_max_window=-1)


def test_reliability_counts_per_row() -> None:
    counts = reliability_counts(np.array([[0.05, 0.3, 0.95, 1.0]]), np.array([[2, 1]]), bins=2)
    assert counts[0].tolist() == [[2, 2], [0.35, 1.95], [1, 1]]
    only = reliability_counts(np.array([[0.05, 0.3, 0.95, 1.0]]), np.array([[2, 1]]), bins=2,
                              candidates_BC=np.array([[3, 2, 1]]))
    assert only[0].tolist() == [[1, 2], [0.3, 1.95], [1, 1]]
    with pytest.raises(BatchError):
        reliability_counts(np.array([[1.5, 0.0]]), np.array([[0]]), bins=2)


def test_calibration_needs_the_ece_candidates() -> None:
    assert MetricsConfig(expert_count=8, top_k=2).calibration_width == 4
    assert MetricsConfig(expert_count=3, top_k=2).calibration_width == 3
    assert MetricsConfig(expert_count=8, top_k=2, calibration_candidates=6).calibration_width == 6
    with pytest.raises(ConfigError, match="calibration_candidates"):
        MetricsConfig(calibration_candidates=-1)
    batch = _batch([0])
    accumulator = MetricsAccumulator(MetricsConfig(expert_count=8, top_k=2, budgets=(2, 3)),
                                     method="m")
    with pytest.raises(BatchError, match="best-ranked candidates"):
        accumulator.update(target_ids_BK=batch["target_ids_BK"], layer_B=batch["layer_B"],
                           split_B=batch["split_B"], membership_prob_BE=batch["membership_prob_BE"],
                           candidates_BC=np.array([[1, 2, 3]]))
