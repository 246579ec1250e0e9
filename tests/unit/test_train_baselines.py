"""Baselines on hand-built route sequences whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.baselines import (
    HISTORY_METHODS,
    BaselineConfig,
    FrequencyTable,
    HistoryBaselines,
    NativeGateBaseline,
    RandomBaseline,
    frequency_scores,
    list_scores,
    ranked_scores,
)
from hebrus_flywheel.train.exceptions import BaselineError, BatchError, SplitMixingError
from hebrus_flywheel.train.metrics import ranking

torch.set_num_threads(1)
CONFIG = BaselineConfig(layer_count=2, expert_count=8, lru_capacity=8)
# One thread, tokens 0..2, layers 0..1, native top-2 in rank order.
ROUTES = {
    (0, 0): [3, 1], (0, 1): [5, 2],
    (1, 0): [1, 6], (1, 1): [2, 7],
    (2, 0): [4, 3], (2, 1): [0, 5],
}


def _top(scores_BE: np.ndarray, budget: int) -> list[list[int]]:
    return ranking(scores_BE)[:, :budget].tolist()


def _fitted_table() -> FrequencyTable:
    """Train counts: layer 0 -> 7 (x3), then 0, 2, 5 (x1, by id);
    layer 1 -> 4 and 6 (x2, tie broken by id), then 1, 3."""
    table = FrequencyTable(CONFIG)
    table.fit(layer_B=np.array([0, 0, 1, 1]), split_B=["train"] * 4,
              target_ids_BK=np.array([[7, 0], [7, 2], [6, 4], [6, 3]]))
    table.fit(layer_B=[0, 1], target_ids_BK=[[7, 5], [4, 1]], split_B="train")
    return table


def _history_rows(keys: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    return {"thread_B": np.array(["owner/t"] * len(keys)),
            "ordinal_B": np.array([k[0] for k in keys]),
            "layer_B": np.array([k[1] for k in keys]),
            "target_ids_BK": np.array([ROUTES[k] for k in keys])}


def test_config_rejects_bad_fields() -> None:
    with pytest.raises(ConfigError, match=r"BaselineConfig\.lru_capacity"):
        BaselineConfig(lru_capacity=0)
    with pytest.raises(ConfigError, match=r"BaselineConfig\.seed"):
        BaselineConfig(seed=-1)


def test_ranked_scores_fill_by_frequency_then_id() -> None:
    primary = np.array([[0, 0, 1, 0, 0, 0, 0, 2.0]])
    fill = np.array([0, 5, 0, 0, 5, 0, 0, 0.0])
    assert _top(ranked_scores(primary, fill), 8) == [[7, 2, 1, 4, 0, 3, 5, 6]]
    scores = list_scores([[3, 1, 3], []], np.zeros((2, 8)))  # repeat keeps its best slot
    assert _top(scores, 3) == [[3, 1, 0], [0, 1, 2]]


def test_frequency_fits_train_rows_only() -> None:
    table = FrequencyTable(CONFIG)
    with pytest.raises(BaselineError, match="fit it on train rows"):
        frequency_scores(table, [0])
    with pytest.raises(SplitMixingError, match="train"):
        table.fit(layer_B=[0, 1], target_ids_BK=[[1, 2], [3, 4]], split_B=["train", "validation"])
    assert table.rows == 0
    table = _fitted_table()
    assert _top(frequency_scores(table, [0, 1]), 4) == [[7, 0, 2, 5], [4, 6, 1, 3]]


def test_history_baselines_on_a_hand_built_thread() -> None:
    keys = sorted(ROUTES)
    scores = HistoryBaselines(CONFIG, fill=_fitted_table()).score_and_observe(
        **_history_rows(keys))
    top = {m: dict(zip(keys, _top(scores[m], 4), strict=True)) for m in HISTORY_METHODS}
    # Previous token, same layer; token 0 has no history and is pure fill.
    assert top["previous_token"][(0, 0)] == [7, 0, 2, 5]
    assert top["previous_token"][(1, 0)] == [3, 1, 7, 0]
    assert top["previous_token"][(2, 1)] == [2, 7, 4, 6]
    # Same token, previous layer; layer 0 never has one.
    assert top["adjacent_layer"][(1, 1)] == [1, 6, 4, 3]
    assert top["adjacent_layer"][(2, 0)] == [7, 0, 2, 5]
    assert top["adjacent_layer"][(2, 1)] == [4, 3, 6, 1]
    # LRU per layer, most recent first, rank 0 of a token more recent than rank 1.
    assert top["lru"][(2, 0)] == [1, 6, 3, 7]
    assert top["lru"][(2, 1)] == [2, 7, 5, 4]


def test_history_is_causal_across_shuffled_rows_and_batches() -> None:
    keys = sorted(ROUTES)
    whole = HistoryBaselines(CONFIG).score_and_observe(**_history_rows(keys))
    split = HistoryBaselines(CONFIG)
    first = split.score_and_observe(**_history_rows([(0, 1), (1, 0), (0, 0)]))
    second = split.score_and_observe(**_history_rows([(2, 0), (1, 1), (2, 1)]))
    for method in HISTORY_METHODS:
        np.testing.assert_array_equal(first[method][[2, 0, 1]], whole[method][:3])
        np.testing.assert_array_equal(second[method][[1, 0, 2]], whole[method][3:])
    with pytest.raises(BatchError, match="order"):
        split.score_and_observe(**_history_rows([(1, 0)]))


def test_history_keeps_threads_apart_and_lru_capacity() -> None:
    baselines = HistoryBaselines(BaselineConfig(layer_count=2, expert_count=8, lru_capacity=2))
    rows = _history_rows([(0, 0), (1, 0), (2, 0)])
    rows["thread_B"] = np.array(["a", "a", "b"])
    scores = baselines.score_and_observe(**rows)
    # Thread b has no history at its first row, though thread a routed at an earlier ordinal.
    assert _top(scores["lru"], 2)[2] == [0, 1]
    assert _top(scores["previous_token"], 2)[2] == [0, 1]
    later = baselines.score_and_observe(**_history_rows([(2, 0)]) | {
        "thread_B": np.array(["a"])})
    assert _top(later["lru"], 3) == [[1, 6, 0]]  # capacity 2 forgot expert 3


def test_random_baseline_is_seeded_and_tie_free() -> None:
    first = RandomBaseline(CONFIG).scores(5)
    again = RandomBaseline(CONFIG).scores(5)
    other = RandomBaseline(BaselineConfig(layer_count=2, expert_count=8, seed=1)).scores(5)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert (np.sort(first, axis=1) == np.arange(1, 9)).all()


def _router() -> np.ndarray:
    """Layer 0 scores expert e by h[e]; layer 1 by h[3 - e]. H = E = 4."""
    return np.stack([np.eye(4), np.eye(4)[::-1]])


def test_native_gate_on_full_width_hidden_states() -> None:
    gate = NativeGateBaseline(torch.tensor(_router()))
    hidden = np.array([[0.1, 0.9, 0.5, -1.0], [0.1, 0.9, 0.5, -1.0]])
    assert _top(gate.scores(hidden, [0, 1]), 4) == [[1, 2, 0, 3], [2, 1, 3, 0]]
    norm = np.array([[1.0, 0.1, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    gated = NativeGateBaseline(_router(), norm_weight_LH=norm)
    assert _top(gated.scores(hidden, [0, 1]), 2) == [[2, 0], [2, 1]]


def test_native_gate_breaks_ties_by_frequency_then_id() -> None:
    table = FrequencyTable(BaselineConfig(layer_count=2, expert_count=4))
    table.fit(layer_B=[0], target_ids_BK=[[3, 2]], split_B="train")
    hidden = np.array([[1.0, 0.0, 1.0, 1.0]])
    assert _top(NativeGateBaseline(_router()).scores(hidden, [0]), 3) == [[0, 2, 3]]
    assert _top(NativeGateBaseline(_router(), fill=table).scores(hidden, [0]), 3) == [[2, 3, 0]]


def test_native_gate_lifts_reduced_features() -> None:
    reduction_HD = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    gate = NativeGateBaseline(_router(), reduction_HD=reduction_HD)
    hidden = np.array([[0.2, 0.7, 0.0, 0.0]])
    reduced = hidden @ reduction_HD
    full = NativeGateBaseline(_router())
    np.testing.assert_array_equal(gate.scores(reduced, [0]), full.scores(hidden, [0]))
    # D == H: a square projection still means the features are reduced and get lifted.
    rotation_HH = np.eye(4)[[1, 0, 3, 2]] * 2.0
    square = NativeGateBaseline(_router(), reduction_HD=rotation_HH)
    np.testing.assert_array_equal(square.scores(hidden @ rotation_HH, [0]),
                                  full.scores(hidden, [0]))
    with pytest.raises(BatchError, match="reduction_HD"):
        NativeGateBaseline(_router()).scores(reduced, [0])
    with pytest.raises(BaselineError, match="reduction_HD"):
        NativeGateBaseline(_router(), reduction_HD=np.ones((3, 2)))


def test_every_method_proposes_exactly_budget_candidates() -> None:
    table = _fitted_table()
    keys = sorted(ROUTES)
    rows = _history_rows(keys)
    methods = dict(HistoryBaselines(CONFIG, fill=table).score_and_observe(**rows))
    methods["frequency"] = frequency_scores(table, rows["layer_B"])
    methods["random"] = RandomBaseline(CONFIG).scores(len(keys))
    router = np.random.default_rng(0).normal(size=(2, 8, 4))
    hidden = np.random.default_rng(1).normal(size=(len(keys), 4))
    methods["native_gate"] = NativeGateBaseline(router, fill=table).scores(hidden,
                                                                           rows["layer_B"])
    for name, scores in methods.items():
        assert scores.shape == (len(keys), 8), name
        assert (np.sort(scores, axis=1) == np.arange(1, 9)).all(), name  # a full, tie-free rank
