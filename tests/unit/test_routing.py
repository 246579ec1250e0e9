"""The exact routing rule: rank order, tie-break by lower expert id, weight rules, margins."""

from __future__ import annotations

import math

import pytest
import torch

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.replay.exceptions import RoutingError
from hebrus_flywheel.replay.routing import (
    TIE_BREAK_RULE,
    WEIGHT_SOFTMAX_TOPK,
    WEIGHT_SOFTMAX_TOPK_RENORMALIZED,
    all_finite,
    margin_beside,
    rank_experts,
    router_margin,
    topk_with_tie_break,
)


def test_rank_order_is_score_descending() -> None:
    logits_TE = torch.tensor([[0.1, 2.0, -1.0, 0.5, 3.0]])
    ids_TK, weights_TK = topk_with_tie_break(logits_TE, 3)
    assert ids_TK.tolist() == [[4, 1, 3]]
    assert ids_TK.dtype == torch.int64 and weights_TK.dtype == torch.float32


def test_ties_are_broken_by_lower_expert_id() -> None:
    logits_TE = torch.tensor([
        [1.0, 3.0, 3.0, 0.0, 3.0, 2.0],
        [5.0, 5.0, 5.0, 5.0, 5.0, 5.0],
        [0.0, 0.0, 1.0, 0.0, 1.0, 0.0],
        [0.5, 0.1, 0.9, 0.3, 0.2, 0.0],  # no ties: the fast path, mixed with tied rows
    ])
    ids_TK, _ = topk_with_tie_break(logits_TE, 4)
    assert ids_TK.tolist() == [[1, 2, 4, 5], [0, 1, 2, 3], [2, 4, 0, 1], [2, 0, 3, 4]]


def test_ties_at_the_boundary_keep_the_lower_id_and_weights_are_equal() -> None:
    logits_TE = torch.tensor([[0.0, 7.0, 2.0, 2.0, 2.0]])
    ids_TK, weights_TK = topk_with_tie_break(logits_TE, 3)
    assert ids_TK.tolist() == [[1, 2, 3]]
    assert weights_TK[0, 1] == weights_TK[0, 2]


def test_large_all_tied_rows_are_deterministic() -> None:
    logits_TE = torch.zeros(8, 512)
    logits_TE[:, 300] = 1.0
    ids_TK, _ = topk_with_tie_break(logits_TE, 10)
    assert ids_TK.tolist() == [[300, *range(9)]] * 8


def test_bfloat16_ties_created_by_rounding_follow_the_rule() -> None:
    logits_TE = torch.tensor([[1.0, 1.001, 1.002, 0.0]]).to(torch.bfloat16)
    ids_TK, _ = topk_with_tie_break(logits_TE, 2)
    assert ids_TK.tolist() == [[0, 1]]


def test_renormalized_weights_are_softmax_over_the_selected_logits() -> None:
    logits_TE = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    ids_TK, weights_TK = topk_with_tie_break(logits_TE, 2)
    expected = torch.softmax(torch.tensor([2.0, 1.0]), dim=-1)
    assert ids_TK.tolist() == [[0, 1]]
    torch.testing.assert_close(weights_TK[0], expected)
    assert math.isclose(float(weights_TK.sum()), 1.0, rel_tol=1e-6)


def test_plain_softmax_topk_weights_are_full_softmax_probabilities() -> None:
    logits_TE = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    _, weights_TK = topk_with_tie_break(logits_TE, 2, weight_rule=WEIGHT_SOFTMAX_TOPK)
    full = torch.softmax(logits_TE, dim=-1)[0, :2]
    torch.testing.assert_close(weights_TK[0], full)
    assert float(weights_TK.sum()) < 1.0


def test_leading_shapes_are_preserved() -> None:
    logits_BTLE = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(0))
    ids, weights = topk_with_tie_break(logits_BTLE, 5)
    assert ids.shape == weights.shape == (2, 3, 4, 5)
    assert torch.equal(ids, rank_experts(logits_BTLE)[..., :5])


def test_rule_agrees_with_topk_when_there_are_no_ties() -> None:
    logits_TE = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    ids_TK, _ = topk_with_tie_break(logits_TE, 10)
    assert torch.equal(ids_TK, torch.topk(logits_TE, 10).indices)


def test_router_margin_is_gap_between_last_selected_and_first_rejected() -> None:
    logits_TE = torch.tensor([[5.0, 1.0, 3.0, 2.5, -1.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    margin_T = router_margin(logits_TE, 2)
    torch.testing.assert_close(margin_T, torch.tensor([0.5, 0.0]))
    assert math.isinf(float(router_margin(logits_TE, 5)[0]))


def test_margin_beside_known_ids_equals_router_margin_bitwise() -> None:
    gen = torch.Generator().manual_seed(3)
    logits_TLE = torch.randn(40, 3, 512, generator=gen)
    logits_TLE[:5] = torch.randint(0, 4, (5, 3, 512), generator=gen).float()  # many ties
    ids_TLK, _ = topk_with_tie_break(logits_TLE, 10)
    assert torch.equal(margin_beside(logits_TLE, ids_TLK), router_margin(logits_TLE, 10))
    everyone = rank_experts(logits_TLE[:2])
    assert torch.isinf(margin_beside(logits_TLE[:2], everyone)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_finds_any_nan_or_infinity(bad: float) -> None:
    values = torch.randn(300, 512)
    assert all_finite(values) and all_finite(torch.empty(0))
    values[123, 45] = bad
    assert not all_finite(values)
    assert not all_finite(values.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("logits", "k"),
    [
        (torch.tensor([[1.0, float("nan"), 0.0]]), 1),
        (torch.tensor([[1.0, float("inf"), 0.0]]), 1),
        (torch.tensor([[1.0, 2.0, 0.0]]), 0),
        (torch.tensor([[1.0, 2.0, 0.0]]), 4),
        (torch.tensor([[1, 2, 0]]), 1),
    ],
)
def test_malformed_requests_raise_routing_error(logits: torch.Tensor, k: int) -> None:
    with pytest.raises(RoutingError) as info:
        topk_with_tie_break(logits, k)
    assert isinstance(info.value, FlywheelError)


def test_unknown_weight_rule_is_rejected() -> None:
    with pytest.raises(RoutingError, match="weight_rule"):
        topk_with_tie_break(torch.zeros(1, 4), 2, weight_rule="sigmoid")


def test_rule_names_are_the_identity_strings() -> None:
    assert TIE_BREAK_RULE == "score_desc_then_expert_id_asc"
    assert WEIGHT_SOFTMAX_TOPK_RENORMALIZED == "softmax_topk_renormalized"
