"""The sidecar objective of the design note ("A loss function that matches the I/O
objective")::

    L(r) = w_accept(p) * w_deadline(l) * L_rank + lambda_overfetch * L_false_positive
           + lambda_cal * L_confidence

* ``L_rank = L_set + order_weight * L_order``. :func:`set_loss` puts every native expert
  above every non-selected one (each native competes in a softmax against the
  non-natives only); :func:`order_loss` is ListMLE (Plackett-Luce) over the native
  experts in native rank order, so rank 0 should score highest.
* ``w_accept`` is a :class:`WeightSchedule` of the proposal position times
  ``rejected_weight`` for rows on a rejected suffix; ``w_deadline`` is a schedule of
  the target layer. Both are strictly positive: rejected-suffix rows keep weight,
  because that is where speculative byte amplification happens. They weight the
  ranking term only, as in the note; the cost terms see every row at full weight.
* :func:`overfetch_loss` is the share of softmax probability (optionally of expected
  bytes) placed outside the native set: the bytes a budgeted prefetch would waste.
* :func:`calibration_loss` is the per-expert binary cross-entropy of
  ``sigmoid(score)`` against native membership, so the scheduler's thresholds on
  :func:`train.models.membership_probability` mean what they say.

Per-row terms are averaged over the rows of the batch (select valid head offsets
first, :func:`train.models.select_valid`).

Legend: B batch rows, L routed layers, E experts, K native top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.exceptions import BatchError


@dataclass(frozen=True, kw_only=True)
class WeightSchedule:
    """A strictly positive weight as a function of a non-negative integer index
    (proposal position for acceptance, target layer for deadlines)."""

    kind: Literal["constant", "exponential", "table"] = "constant"
    """``constant``: ``value``; ``exponential``: ``max(floor, value * decay**i)``;
    ``table``: ``table[i]``, indices past the end use the last entry."""
    value: float = 1.0
    """The constant weight, and the exponential weight at index 0; > 0."""
    decay: float = 1.0
    """Per-step factor of the exponential schedule, in (0, 1]."""
    floor: float = 0.05
    """Lowest exponential weight, > 0, so that no row's weight reaches zero."""
    table: tuple[float, ...] = ()
    """Explicit weights for the ``table`` kind; every entry > 0."""

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "exponential", "table"):
            raise ConfigError(
                f"WeightSchedule.kind is {self.kind!r}; use constant, exponential or table"
            )
        if not self.value > 0:
            raise ConfigError(f"WeightSchedule.value must be > 0, got {self.value!r}")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"WeightSchedule.decay must be in (0, 1], got {self.decay!r}")
        if not self.floor > 0:
            raise ConfigError(
                f"WeightSchedule.floor must be > 0 (rows never lose all weight), got {self.floor!r}"
            )
        object.__setattr__(self, "table", tuple(float(w) for w in self.table))
        if self.kind == "table" and (not self.table or min(self.table) <= 0):
            raise ConfigError("WeightSchedule.table must be non-empty with every entry > 0")

    def weights(self, index_B: torch.Tensor) -> torch.Tensor:
        """The float32 weight of every row's index ``(B,)``."""
        if index_B.numel() and int(index_B.min()) < 0:
            raise BatchError("weight-schedule indices (positions, layers) must be >= 0")
        index_B = index_B.long()
        if self.kind == "constant":
            return torch.full(index_B.shape, self.value, device=index_B.device)
        if self.kind == "exponential":
            w_B = self.value * torch.exp(index_B.double() * math.log(self.decay))
            return w_B.clamp_min(self.floor).float()
        table_T = torch.tensor(self.table, dtype=torch.float32, device=index_B.device)
        return table_T[index_B.clamp_max(len(self.table) - 1)]


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Weights of the terms of :class:`SidecarLoss`."""

    order_weight: float = 0.5
    """Weight of the native-rank-order ListMLE term inside L_rank; 0 ignores the order."""
    overfetch_weight: float = 0.1
    """lambda_overfetch: weight of the false-positive (wasted probability/bytes) term."""
    calibration_weight: float = 0.1
    """lambda_cal: weight of the per-expert membership BCE term."""
    positive_weighting: Literal["uniform", "router"] = "uniform"
    """How the native experts share the set term: equally, or by the router weights."""
    acceptance: WeightSchedule = field(
        default_factory=lambda: WeightSchedule(kind="exponential", decay=0.8, floor=0.1)
    )
    """w_accept as a function of proposal position (0 on the clean path)."""
    rejected_weight: float = 0.25
    """Extra factor of w_accept for rows on a rejected suffix, in (0, 1]."""
    deadline: WeightSchedule = field(default_factory=WeightSchedule)
    """w_deadline as a function of the target layer."""

    def __post_init__(self) -> None:
        for name in ("order_weight", "overfetch_weight", "calibration_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"LossConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.positive_weighting not in ("uniform", "router"):
            raise ConfigError(
                f"LossConfig.positive_weighting is {self.positive_weighting!r}; "
                "use uniform or router"
            )
        if not 0 < self.rejected_weight <= 1:
            raise ConfigError(
                "LossConfig.rejected_weight must be in (0, 1]: rejected suffixes keep weight, "
                f"got {self.rejected_weight!r}"
            )


def native_mask(target_ids_BK: torch.Tensor, expert_count: int) -> torch.Tensor:
    """Boolean ``(B, E)`` membership of each expert in the row's native top-k."""
    mask_BE = torch.zeros(target_ids_BK.shape[0], expert_count, dtype=torch.bool,
                          device=target_ids_BK.device)
    return mask_BE.scatter_(1, target_ids_BK, True)


def set_loss(
    scores_BE: torch.Tensor, target_ids_BK: torch.Tensor,
    positive_weight_BK: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B,)`` mean over natives k of ``-log softmax`` of ``s_k`` against the
    non-natives: ``softplus(logsumexp(s_non_native) - s_k)``."""
    native_BE = native_mask(target_ids_BK, scores_BE.shape[1])
    negatives_B = torch.logsumexp(scores_BE.masked_fill(native_BE, float("-inf")), dim=1)
    positives_BK = scores_BE.gather(1, target_ids_BK)  # (B, K)
    per_native_BK = F.softplus(negatives_B[:, None] - positives_BK)  # (B, K)
    if positive_weight_BK is None:
        return per_native_BK.mean(dim=1)
    share_BK = positive_weight_BK / positive_weight_BK.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return (per_native_BK * share_BK).sum(dim=1)


def order_loss(scores_BE: torch.Tensor, target_ids_BK: torch.Tensor) -> torch.Tensor:
    """``(B,)`` ListMLE over the natives in rank order, per ranking step (K-1 steps)."""
    positives_BK = scores_BE.gather(1, target_ids_BK)  # (B, K)
    suffix_BK = torch.logcumsumexp(positives_BK.flip(1), dim=1).flip(1)  # (B, K)
    steps = max(target_ids_BK.shape[1] - 1, 1)
    return (suffix_BK - positives_BK)[:, :-1].sum(dim=1) / steps


def overfetch_loss(
    scores_BE: torch.Tensor, target_ids_BK: torch.Tensor, bytes_BE: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B,)`` share of softmax probability, or of expected bytes when ``bytes_BE`` is
    given, that falls on experts outside the native set."""
    mass_BE = torch.softmax(scores_BE, dim=1)  # (B, E)
    if bytes_BE is not None:
        mass_BE = mass_BE * bytes_BE
    outside_BE = ~native_mask(target_ids_BK, scores_BE.shape[1])
    return (mass_BE * outside_BE).sum(dim=1) / mass_BE.sum(dim=1).clamp_min(1e-30)


def calibration_loss(scores_BE: torch.Tensor, target_ids_BK: torch.Tensor) -> torch.Tensor:
    """``(B,)`` mean over experts of BCE(sigmoid(score), native membership)."""
    member_BE = native_mask(target_ids_BK, scores_BE.shape[1]).to(scores_BE.dtype)
    return F.binary_cross_entropy_with_logits(scores_BE, member_BE, reduction="none").mean(1)


class SidecarLoss(nn.Module):
    """The weighted objective; ``forward`` returns ``"total"`` plus a term breakdown.

    ``expert_bytes`` (optional) is ``(E,)`` or ``(L, E)``: the bytes of each expert,
    which turns the over-fetch term into a share of expected bytes.
    """

    expert_bytes: torch.Tensor | None

    def __init__(self, config: LossConfig, expert_bytes: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        if expert_bytes is not None and (expert_bytes.ndim not in (1, 2)
                                         or bool((expert_bytes <= 0).any())):
            raise BatchError("expert_bytes must be (E,) or (L, E) with every entry > 0")
        self.register_buffer("expert_bytes", expert_bytes, persistent=False)

    def forward(
        self, scores_BE: torch.Tensor, target_ids_BK: torch.Tensor, *,
        layer_B: torch.Tensor, position_B: torch.Tensor | None = None,
        accepted_B: torch.Tensor | None = None, target_weights_BK: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Loss terms averaged over rows; ``"total"`` carries the gradient."""
        self._check(scores_BE, target_ids_BK, layer_B)
        c = self.config
        router_BK = target_weights_BK if c.positive_weighting == "router" else None
        set_B = set_loss(scores_BE, target_ids_BK, router_BK)  # (B,)
        order_B = order_loss(scores_BE, target_ids_BK)  # (B,)
        weight_B = self.row_weights(layer_B, position_B, accepted_B)  # (B,)
        rank = (weight_B * (set_B + c.order_weight * order_B)).mean()
        overfetch = overfetch_loss(scores_BE, target_ids_BK, self._bytes(layer_B)).mean()
        calibration = calibration_loss(scores_BE, target_ids_BK).mean()
        total = rank + c.overfetch_weight * overfetch + c.calibration_weight * calibration
        return {"total": total, "rank": rank, "rank_set": set_B.mean(),
                "rank_order": order_B.mean(), "overfetch": overfetch,
                "calibration": calibration, "row_weight": weight_B.mean()}

    def row_weights(
        self, layer_B: torch.Tensor, position_B: torch.Tensor | None = None,
        accepted_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``w_accept(position) * w_deadline(layer)`` per row ``(B,)``; rows with
        ``accepted_B == False`` are multiplied by ``rejected_weight``."""
        position_B = torch.zeros_like(layer_B) if position_B is None else position_B
        weight_B = self.config.acceptance.weights(position_B) * self.config.deadline.weights(
            layer_B)
        if accepted_B is not None:
            rejected_B = torch.where(accepted_B.bool(), 1.0, self.config.rejected_weight)
            weight_B = weight_B * rejected_B.to(weight_B)
        return weight_B.to(layer_B.device)

    def _bytes(self, layer_B: torch.Tensor) -> torch.Tensor | None:
        bytes_E = self.expert_bytes
        if bytes_E is None:
            return None
        return bytes_E[layer_B] if bytes_E.ndim == 2 else bytes_E[None, :]

    def _check(self, scores_BE: torch.Tensor, target_ids_BK: torch.Tensor,
               layer_B: torch.Tensor) -> None:
        if scores_BE.ndim != 2 or target_ids_BK.ndim != 2 or layer_B.ndim != 1 or not (
                scores_BE.shape[0] == target_ids_BK.shape[0] == layer_B.shape[0]):
            raise BatchError(
                f"scores {tuple(scores_BE.shape)}, targets {tuple(target_ids_BK.shape)} and "
                f"layers {tuple(layer_B.shape)} must be (B, E), (B, K), (B,); flatten head "
                "offsets with train.models.select_valid first"
            )
        E, K = scores_BE.shape[1], target_ids_BK.shape[1]
        if scores_BE.shape[0] == 0:
            raise BatchError("the batch is empty; skip empty batches before the loss")
        if not 1 <= K <= E or target_ids_BK.dtype != torch.long:
            raise BatchError(f"targets must be int64 with 1 <= K <= E={E}, got K={K}")
        if int(target_ids_BK.min()) < 0 or int(target_ids_BK.max()) >= E:
            raise BatchError(f"target expert ids must lie in [0, {E}); check expert_count")
        if self.expert_bytes is not None and self.expert_bytes.shape[-1] != E:
            raise BatchError(f"expert_bytes has {self.expert_bytes.shape[-1]} experts, not {E}")
