"""Model B: the route sidecar on candidate positions (P2 hints), and its
acceptance-aware loss.

Architecture (per routed layer l and candidate position p = 1..B, the Δposition heads)::

    h = gelu(LayerNorm(feature) @ W1[l] + b1[l] + token_embedding[token mod buckets]
             + logprob * w_lp)
    h = h * (1 + film_scale[p]) + film_shift[p]          # the Δposition-p head
    scores = h @ W2[l] + b2[l] + head_bias[p, l]          # (E,)

The inputs are those of :mod:`.rows` (features available at proposal time, candidate
token, drafter log-probability, position); nothing reads the labels.

The loss (:class:`AcceptanceLoss`) is the design note's objective with
``w_accept(p)`` = the acceptance rate at position p *measured on the training split*
(:func:`acceptance_schedule`, floored so that no row's weight reaches zero):

* ``w_accept(p) * L_rank`` on every row, accepted or not (:class:`train.losses.SidecarLoss`
  with ``rejected_weight``: rejected rows keep weight, less of it);
* ``lambda_overfetch * L_false_positive`` on every row at full weight;
* ``lambda_rejected * BCE(sigmoid(score), native & accepted)``: the over-fetch cost of
  rejected rows. Bytes fetched for a rejected suffix are wasted whatever the route, so
  their useful-fetch target is all zero; on accepted rows it is native membership.
  The ranking terms are shift-invariant, so this term sets the level of the scores
  (how much a scheduler should trust a hint) without changing their order much.

Legend: B rows, D feature width, L layers, E experts, K top-k, P candidate positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.losses import LossConfig, SidecarLoss, WeightSchedule, native_mask


@dataclass(frozen=True, kw_only=True)
class CandidateConfig:
    """Geometry and knobs of :class:`CandidateSidecar`."""

    feature_dim: int
    """D: width of the stored candidate-position feature."""
    layer_count: int
    """L: routed layers."""
    expert_count: int
    """E: experts per routed layer."""
    block: int
    """B: candidate positions 1..B, one head each."""
    width: int = 64
    """M: hidden width of the per-layer trunk."""
    token_buckets: int = 256
    """Buckets of the hashed candidate-token embedding (token id mod buckets)."""

    def __post_init__(self) -> None:
        for name in ("feature_dim", "layer_count", "expert_count", "block", "width",
                     "token_buckets"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"CandidateConfig.{name} must be a positive integer, "
                                  f"got {value!r}")

    @property
    def name(self) -> str:
        return f"candidate_sidecar@{self.width}"


class CandidateSidecar(nn.Module):
    """Per-layer trunk shared by the positions, one FiLM + bias head per Δposition."""

    def __init__(self, config: CandidateConfig) -> None:
        super().__init__()
        D, M, L, E, P = (config.feature_dim, config.width, config.layer_count,
                         config.expert_count, config.block)
        self.config = config
        self.norm = nn.LayerNorm(D)
        self.w1_LDM = nn.Parameter(torch.randn(L, D, M) / math.sqrt(D))
        self.b1_LM = nn.Parameter(torch.zeros(L, M))
        self.token = nn.Embedding(config.token_buckets, M)
        nn.init.normal_(self.token.weight, std=0.02)
        self.logprob_M = nn.Parameter(torch.zeros(M))
        self.film_scale_PM = nn.Parameter(torch.zeros(P, M))
        self.film_shift_PM = nn.Parameter(torch.zeros(P, M))
        self.w2_LME = nn.Parameter(torch.randn(L, M, E) / math.sqrt(M))
        self.b2_LE = nn.Parameter(torch.zeros(L, E))
        self.head_bias_PLE = nn.Parameter(torch.zeros(P, L, E))

    def forward(self, feature_BD: torch.Tensor, layer_B: torch.Tensor, position_B: torch.Tensor,
                token_B: torch.Tensor, logprob_B: torch.Tensor) -> torch.Tensor:
        """Scores ``(B, E)``; positions past B use the last head."""
        p_B = position_B.clamp(1, self.config.block) - 1
        x_BD = self.norm(feature_BD.float())
        extra_BM = (self.token(token_B % self.config.token_buckets)
                    + logprob_B.float()[:, None] * self.logprob_M)
        out_BE = x_BD.new_empty(x_BD.shape[0], self.b2_LE.shape[1])
        for layer in torch.unique(layer_B).tolist():
            rows = layer_B == layer
            h_BM = F.gelu(x_BD[rows] @ self.w1_LDM[layer] + self.b1_LM[layer] + extra_BM[rows])
            h_BM = h_BM * (1 + self.film_scale_PM[p_B[rows]]) + self.film_shift_PM[p_B[rows]]
            out_BE[rows] = (h_BM @ self.w2_LME[layer] + self.b2_LE[layer]
                            + self.head_bias_PLE[p_B[rows], layer])
        return out_BE


def acceptance_schedule(acceptance: dict[int, float], *, floor: float = 0.05) -> WeightSchedule:
    """``w_accept`` as a table over positions 0..B (position 0, the clean path, is 1)."""
    if not acceptance:
        raise ConfigError("acceptance_schedule needs the acceptance of at least one position")
    if not 0 < floor <= 1:
        raise ConfigError(f"floor must be in (0, 1], got {floor!r}")
    block = max(acceptance)
    table = [1.0] + [max(floor, acceptance.get(p, floor)) for p in range(1, block + 1)]
    return WeightSchedule(kind="table", table=tuple(table))


@dataclass(frozen=True, kw_only=True)
class AcceptanceLossConfig:
    """Weights of :class:`AcceptanceLoss` beyond the measured ``w_accept``."""

    overfetch_weight: float = 0.1
    """lambda_overfetch: wasted softmax mass on every row."""
    rejected_weight: float = 0.5
    """Factor on the ranking weight of a rejected row, in (0, 1]."""
    useful_weight: float = 0.1
    """lambda_rejected: BCE against useful-fetch membership (0 on rejected rows)."""

    def __post_init__(self) -> None:
        for name in ("overfetch_weight", "useful_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"AcceptanceLossConfig.{name} must be >= 0")
        if not 0 < self.rejected_weight <= 1:
            raise ConfigError("AcceptanceLossConfig.rejected_weight must be in (0, 1]")


class AcceptanceLoss(nn.Module):
    """``SidecarLoss`` with measured ``w_accept`` plus the rejected-row cost term."""

    def __init__(self, acceptance: WeightSchedule, config: AcceptanceLossConfig) -> None:
        super().__init__()
        self.config = config
        self.rank = SidecarLoss(LossConfig(
            overfetch_weight=config.overfetch_weight, calibration_weight=0.0,
            acceptance=acceptance, rejected_weight=config.rejected_weight))

    def forward(self, scores_BE: torch.Tensor, target_BK: torch.Tensor, *,
                layer_B: torch.Tensor, position_B: torch.Tensor,
                accepted_B: torch.Tensor) -> dict[str, torch.Tensor]:
        terms = self.rank(scores_BE, target_BK, layer_B=layer_B, position_B=position_B,
                          accepted_B=accepted_B)
        useful_BE = native_mask(target_BK, scores_BE.shape[1]) & accepted_B.bool()[:, None]
        useful = F.binary_cross_entropy_with_logits(scores_BE, useful_BE.to(scores_BE.dtype))
        rejected = ~accepted_B.bool()
        wasted = (torch.sigmoid(scores_BE[rejected]).sum(1).mean() if bool(rejected.any())
                  else scores_BE.new_zeros(()))
        total = terms["total"] + self.config.useful_weight * useful
        return {**terms, "total": total, "useful": useful,
                "rejected_expected_fetch": wasted.detach()}
