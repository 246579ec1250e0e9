"""The sidecar objective: every term falls when the prediction improves; weights behave."""

from __future__ import annotations

import math

import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.exceptions import BatchError
from hebrus_flywheel.train.losses import (
    LossConfig,
    SidecarLoss,
    WeightSchedule,
    calibration_loss,
    native_mask,
    order_loss,
    overfetch_loss,
    set_loss,
)

torch.set_num_threads(1)
# One row, E=6 experts, native top-3 in rank order (2, 0, 4).
TARGETS = torch.tensor([[2, 0, 4]])
BASE = torch.tensor([[1.0, 0.5, 1.5, 0.2, 0.8, 0.1]])


def _with(scores: torch.Tensor, **changes: float) -> torch.Tensor:
    out = scores.clone()
    for name, value in changes.items():
        out[0, int(name[1:])] = value
    return out


def test_native_mask() -> None:
    assert native_mask(TARGETS, 6).tolist() == [[True, False, True, False, True, False]]


def test_set_loss_hand_values() -> None:
    # K=1, E=3, all scores equal: -log(1/3).
    assert set_loss(torch.zeros(1, 3), torch.tensor([[0]])).item() == pytest.approx(math.log(3))
    # Natives compete only against non-natives: two equal natives, one non-native.
    assert set_loss(torch.zeros(1, 3), torch.tensor([[0, 1]])).item() == pytest.approx(
        math.log(2))


def test_set_loss_falls_when_natives_rise_or_non_natives_fall() -> None:
    base = set_loss(BASE, TARGETS).item()
    assert set_loss(_with(BASE, e0=3.0), TARGETS).item() < base  # a native rises
    assert set_loss(_with(BASE, e1=-2.0), TARGETS).item() < base  # a non-native falls
    assert set_loss(_with(BASE, e3=3.0), TARGETS).item() > base  # a non-native overtakes
    # Indifferent to the order among natives: swap the scores of natives 2 and 0.
    swapped = _with(BASE, e2=1.0, e0=1.5)
    assert set_loss(swapped, TARGETS).item() == pytest.approx(base)


def test_set_loss_router_weighting_emphasises_heavy_natives() -> None:
    weights = torch.tensor([[0.8, 0.1, 0.1]])
    base = set_loss(BASE, TARGETS, weights).item()
    heavy = set_loss(_with(BASE, e2=2.5), TARGETS, weights).item()  # rank-0 native +1
    light = set_loss(_with(BASE, e4=1.8), TARGETS, weights).item()  # rank-2 native +1
    assert heavy < light < base


def test_order_loss_prefers_native_rank_order() -> None:
    # K=2, natives (0, 1) with scores 1, 0: one ListMLE step, log(1 + e^-1).
    hand = order_loss(torch.tensor([[1.0, 0.0, 5.0]]), torch.tensor([[0, 1]])).item()
    assert hand == pytest.approx(math.log(1 + math.exp(-1)))
    ordered = torch.tensor([[2.0, 0.0, 3.0, 0.0, 1.0, 0.0]])  # natives scored 3 > 2 > 1
    reversed_ = torch.tensor([[2.0, 0.0, 1.0, 0.0, 3.0, 0.0]])  # natives scored 1 < 2 < 3
    assert order_loss(ordered, TARGETS).item() < order_loss(reversed_, TARGETS).item()
    # Indifferent to non-native scores.
    assert order_loss(_with(ordered, e1=9.0), TARGETS).item() == pytest.approx(
        order_loss(ordered, TARGETS).item())


def test_overfetch_falls_when_mass_leaves_non_natives() -> None:
    base = overfetch_loss(BASE, TARGETS).item()
    assert overfetch_loss(_with(BASE, e3=-3.0), TARGETS).item() < base
    assert overfetch_loss(_with(BASE, e2=4.0), TARGETS).item() < base
    # Uniform scores: half the softmax mass (3 of 6 experts) is wasted.
    assert overfetch_loss(torch.zeros(1, 6), TARGETS).item() == pytest.approx(0.5)


def test_overfetch_byte_weighting_charges_heavy_experts_more() -> None:
    bytes_BE = torch.tensor([[1.0, 1.0, 1.0, 10.0, 1.0, 1.0]])
    heavy_wrong = _with(BASE, e3=2.0, e5=0.2)  # same scores, experts 3 and 5 swapped
    light_wrong = _with(BASE, e3=0.2, e5=2.0)
    assert overfetch_loss(heavy_wrong, TARGETS, bytes_BE).item() > overfetch_loss(
        light_wrong, TARGETS, bytes_BE).item()
    assert overfetch_loss(heavy_wrong, TARGETS).item() == pytest.approx(
        overfetch_loss(light_wrong, TARGETS).item())


def test_calibration_falls_as_probabilities_approach_membership() -> None:
    assert calibration_loss(torch.zeros(1, 6), TARGETS).item() == pytest.approx(math.log(2))
    member = native_mask(TARGETS, 6).float() * 2 - 1  # +1 natives, -1 others
    mild, sharp = calibration_loss(member, TARGETS), calibration_loss(3 * member, TARGETS)
    wrong = calibration_loss(-member, TARGETS)
    assert sharp.item() < mild.item() < math.log(2) < wrong.item()


def test_weight_schedules() -> None:
    index_B = torch.tensor([0, 1, 2, 10])
    assert WeightSchedule().weights(index_B).tolist() == [1.0] * 4
    exponential = WeightSchedule(kind="exponential", value=2.0, decay=0.5, floor=0.1)
    assert exponential.weights(index_B).tolist() == pytest.approx([2.0, 1.0, 0.5, 0.1])
    table = WeightSchedule(kind="table", table=(1.0, 0.5, 0.25))
    assert table.weights(index_B).tolist() == [1.0, 0.5, 0.25, 0.25]
    with pytest.raises(BatchError):
        table.weights(torch.tensor([-1]))


@pytest.mark.parametrize(
    ("fields", "name"),
    [({"kind": "linear"}, "kind"), ({"value": 0.0}, "value"), ({"decay": 0.0}, "decay"),
     ({"decay": 1.5}, "decay"), ({"floor": 0.0}, "floor"),
     ({"kind": "table", "table": ()}, "table"), ({"kind": "table", "table": (1.0, 0.0)}, "table")],
)
def test_weight_schedule_rejects_bad_fields(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=f"WeightSchedule.{name}"):
        WeightSchedule(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "name"),
    [({"order_weight": -1.0}, "order_weight"), ({"rejected_weight": 0.0}, "rejected_weight"),
     ({"positive_weighting": "rank"}, "positive_weighting")],
)
def test_loss_config_rejects_bad_fields(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=f"LossConfig.{name}"):
        LossConfig(**fields)  # type: ignore[arg-type]


def test_row_weights_combine_acceptance_deadline_and_rejection() -> None:
    config = LossConfig(
        acceptance=WeightSchedule(kind="exponential", decay=0.5, floor=0.1),
        deadline=WeightSchedule(kind="table", table=(1.0, 2.0)),
        rejected_weight=0.5,
    )
    weights = SidecarLoss(config).row_weights(
        layer_B=torch.tensor([0, 1, 1, 0]), position_B=torch.tensor([0, 1, 8, 8]),
        accepted_B=torch.tensor([True, True, False, False]))
    assert weights.tolist() == pytest.approx([1.0, 1.0, 0.1, 0.05])
    assert (weights > 0).all()  # rejected suffix rows keep weight


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores_BE = BASE.repeat(2, 1)
    return scores_BE, TARGETS.repeat(2, 1), torch.tensor([0, 1])


def test_sidecar_loss_breakdown_and_total() -> None:
    scores_BE, targets_BK, layer_B = _batch()
    scores_BE.requires_grad_(True)
    config = LossConfig(order_weight=0.5, overfetch_weight=0.2, calibration_weight=0.3)
    terms = SidecarLoss(config)(scores_BE, targets_BK, layer_B=layer_B,
                                position_B=torch.tensor([0, 2]))
    assert set(terms) == {"total", "rank", "rank_set", "rank_order", "overfetch",
                          "calibration", "row_weight"}
    weights = torch.tensor([1.0, 0.64])  # default acceptance: 0.8 ** position
    per_row = set_loss(BASE, TARGETS) + 0.5 * order_loss(BASE, TARGETS)
    assert terms["rank"].item() == pytest.approx((weights * per_row).mean().item())
    expected = terms["rank"] + 0.2 * terms["overfetch"] + 0.3 * terms["calibration"]
    assert terms["total"].item() == pytest.approx(expected.item())
    terms["total"].backward()
    assert scores_BE.grad is not None and torch.isfinite(scores_BE.grad).all()


def test_sidecar_loss_falls_when_prediction_improves() -> None:
    scores_BE, targets_BK, layer_B = _batch()
    loss = SidecarLoss(LossConfig())
    native_BE = native_mask(targets_BK, 6)
    better = scores_BE + 2.0 * native_BE - 1.0 * ~native_BE
    worse = scores_BE - 2.0 * native_BE + 1.0 * ~native_BE
    totals = [loss(s, targets_BK, layer_B=layer_B)["total"].item()
              for s in (better, scores_BE, worse)]
    assert totals[0] < totals[1] < totals[2]


def test_sidecar_loss_per_layer_expert_bytes() -> None:
    scores_BE, targets_BK, layer_B = _batch()
    bytes_LE = torch.ones(2, 6)
    bytes_LE[1, 3] = 100.0  # expert 3 is heavy on layer 1 only
    terms = SidecarLoss(LossConfig(), expert_bytes=bytes_LE)(scores_BE, targets_BK,
                                                             layer_B=layer_B)
    light = overfetch_loss(BASE, TARGETS).item()
    heavy = overfetch_loss(BASE, TARGETS, bytes_LE[1:]).item()
    assert terms["overfetch"].item() == pytest.approx((light + heavy) / 2)


def test_sidecar_loss_rejects_bad_batches() -> None:
    scores_BE, targets_BK, layer_B = _batch()
    loss = SidecarLoss(LossConfig())
    with pytest.raises(BatchError, match="select_valid"):
        loss(scores_BE[:, None], targets_BK, layer_B=layer_B)
    with pytest.raises(BatchError, match="expert ids"):
        loss(scores_BE, targets_BK + 4, layer_B=layer_B)
    with pytest.raises(BatchError, match="empty"):
        loss(scores_BE[:0], targets_BK[:0], layer_B=layer_B[:0])
    with pytest.raises(BatchError, match="expert_bytes"):
        SidecarLoss(LossConfig(), expert_bytes=torch.zeros(6))
