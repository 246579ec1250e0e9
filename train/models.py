"""Route sidecars: compact predictors of the native MoE router's top-k experts.

One model is shared across all routed layers (design note, "What feature should the
sidecar see?")::

    opaque feature -> shared low-rank trunk + target-layer embedding
                   -> shared expert-head embeddings -> one score per expert

A head predicts one or more *offsets* ``(dposition, dlayer)`` from a single feature:
``((0, 0),)`` scores the feature's own layer, the P1 near-term predictor uses
``((0, 0), (0, 1))`` (layers l and l+1 of the same token), and the candidate-path
sidecar uses later positions and layers. Scores are logits: their ranking gives
prefetch priority and ``sigmoid(score)`` is the per-expert membership probability
that the calibration term of :mod:`train.losses` trains. The native router still
makes every execution decision; these scores only move bytes early.

Legend: B batch rows, O head offsets, L routed layers, E experts, D feature width,
R low-rank width, H conditioning-MLP width, C candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.exceptions import BatchError

Offset = tuple[int, int]
P1_OFFSETS: tuple[Offset, ...] = ((0, 0), (0, 1))
"""The P1 near-term head: the pre-attention feature of layer l predicts layers l, l+1."""


@dataclass(frozen=True, kw_only=True)
class SidecarConfig:
    """Geometry and capacity of a :class:`RouteSidecar`."""

    feature_dim: int = 64
    """D: width of the opaque input feature (e.g. the reduced pre-attention state)."""
    rank: int = 64
    """R: width of the shared low-rank trunk and of the shared expert embeddings."""
    hidden: int = 256
    """H: hidden width of the layer-conditioned residual MLP between trunk and head."""
    layer_count: int = 48
    """L: routed layers of the target model; target layers index ``0..L-1``."""
    expert_count: int = 512
    """E: experts per routed layer; the head emits one score per expert."""
    offsets: tuple[Offset, ...] = ((0, 0),)
    """``(dposition, dlayer)`` pairs predicted from one feature, each pointing forward
    (``dposition > 0``, or ``dposition == 0`` and ``dlayer >= 0``), without repeats."""
    dropout: float = 0.0
    """Dropout probability inside the conditioning MLP, in ``[0, 1)``."""
    layer_expert_bias: bool = True
    """Learn a per-(target layer, expert) score bias: L*E parameters that capture each
    layer's expert popularity, which a shared head cannot express on its own."""

    def __post_init__(self) -> None:
        for name in ("feature_dim", "rank", "hidden", "layer_count", "expert_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"SidecarConfig.{name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"SidecarConfig.dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "offsets", tuple(tuple(o) for o in self.offsets))
        _check_offsets(self.offsets, self.layer_count)


def _check_offsets(offsets: tuple[Offset, ...], layer_count: int) -> None:
    if not offsets:
        raise ConfigError("SidecarConfig.offsets is empty; give at least one, e.g. ((0, 0),)")
    if len(set(offsets)) != len(offsets):
        raise ConfigError(f"SidecarConfig.offsets repeats an offset: {offsets!r}")
    for offset in offsets:
        if len(offset) != 2 or not all(isinstance(v, int) for v in offset):
            raise ConfigError(
                f"SidecarConfig.offsets entry {offset!r} must be a (dposition, dlayer) int pair"
            )
        dposition, dlayer = offset
        if dposition < 0 or (dposition == 0 and dlayer < 0) or abs(dlayer) >= layer_count:
            raise ConfigError(
                f"SidecarConfig.offsets entry {offset!r} does not point forward within "
                f"{layer_count} layers; use dposition > 0, or dposition == 0 and dlayer >= 0"
            )


def p1_config(**fields: Any) -> SidecarConfig:
    """Config of the P1 near-term predictor: feature of layer l -> layers l and l+1."""
    return SidecarConfig(offsets=P1_OFFSETS, **fields)


def candidate_path_config(
    *, position_offsets: tuple[int, ...], layer_offsets: tuple[int, ...] = (0,), **fields: Any
) -> SidecarConfig:
    """Config of the generic head: feature at position p -> routes at ``p + dposition``
    and ``l + dlayer`` for every pair of the two offset lists (candidate-path sidecar)."""
    offsets = tuple((p, dl) for p in position_offsets for dl in layer_offsets)
    return SidecarConfig(offsets=offsets, **fields)


class ConditionedMLP(nn.Module):
    """Residual MLP over the layer-conditioned trunk state."""

    def __init__(self, config: SidecarConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.rank)
        self.up = nn.Linear(config.rank, config.hidden)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(config.dropout)
        self.down = nn.Linear(config.hidden, config.rank)

    def forward(self, x_BOR: torch.Tensor) -> torch.Tensor:
        h_BOH = self.dropout(self.act(self.up(self.norm(x_BOR))))  # (B, O, H)
        return x_BOR + self.down(h_BOH)  # (B, O, R)


class RouteSidecar(nn.Module):
    """The compact shared sidecar; ``forward`` returns scores for every head offset."""

    position_offset_O: torch.Tensor
    layer_offset_O: torch.Tensor

    def __init__(self, config: SidecarConfig) -> None:
        super().__init__()
        self.config = config
        R, L, E = config.rank, config.layer_count, config.expert_count
        self.trunk = nn.Sequential(nn.LayerNorm(config.feature_dim),
                                   nn.Linear(config.feature_dim, R))
        # FiLM conditioning (scale, shift) from the target layer and the head offset;
        # zero-initialised so that training starts from the unconditioned trunk.
        self.layer_film = nn.Embedding(L, 2 * R)
        self.offset_film = nn.Embedding(len(config.offsets), 2 * R)
        self.mlp = ConditionedMLP(config)
        self.head_norm = nn.LayerNorm(R)
        self.expert_embedding = nn.Parameter(torch.randn(E, R) / math.sqrt(R))  # (E, R)
        self.expert_bias = nn.Embedding(L, E) if config.layer_expert_bias else None
        for table in (self.layer_film, self.offset_film, self.expert_bias):
            if table is not None:
                nn.init.zeros_(table.weight)
        offsets_O2 = torch.tensor(config.offsets, dtype=torch.long).reshape(-1, 2)
        self.register_buffer("position_offset_O", offsets_O2[:, 0].clone(), persistent=False)
        self.register_buffer("layer_offset_O", offsets_O2[:, 1].clone(), persistent=False)

    def target_layers(self, source_layer_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target layer of every head offset and whether it exists: ``(B, O)`` each.

        Out-of-range targets (layer l+1 of the last layer) are clamped so that they can
        be scored; their rows must be dropped with the returned mask before the loss.
        """
        target_BO = source_layer_B[:, None] + self.layer_offset_O[None, :]  # (B, O)
        valid_BO = (target_BO >= 0) & (target_BO < self.config.layer_count)  # (B, O)
        return target_BO.clamp(0, self.config.layer_count - 1), valid_BO

    def target_positions(self, position_B: torch.Tensor) -> torch.Tensor:
        """Proposal position of every head offset's target ``(B, O)`` (for w_accept)."""
        return position_B[:, None] + self.position_offset_O[None, :]  # (B, O)

    def forward(self, feature_BD: torch.Tensor, source_layer_B: torch.Tensor) -> torch.Tensor:
        """Scores ``(B, O, E)`` of every expert at every head offset's target layer
        (``[:, 0]`` for a single-offset head)."""
        self._check_inputs(feature_BD, source_layer_B)
        target_BO, _ = self.target_layers(source_layer_B)
        h_BR = self.trunk(feature_BD)  # (B, R)
        film_BO2R = self.layer_film(target_BO) + self.offset_film.weight[None]  # (B, O, 2R)
        scale_BOR, shift_BOR = film_BO2R.chunk(2, dim=-1)  # (B, O, R) each
        x_BOR = self.mlp(h_BR[:, None, :] * (1.0 + scale_BOR) + shift_BOR)  # (B, O, R)
        scores_BOE = self.head_norm(x_BOR) @ self.expert_embedding.T  # (B, O, E)
        if self.expert_bias is not None:
            scores_BOE = scores_BOE + self.expert_bias(target_BO)  # (B, O, E)
        return scores_BOE

    def _check_inputs(self, feature_BD: torch.Tensor, source_layer_B: torch.Tensor) -> None:
        D, L = self.config.feature_dim, self.config.layer_count
        if feature_BD.ndim != 2 or feature_BD.shape[1] != D:
            raise BatchError(
                f"feature has shape {tuple(feature_BD.shape)}, expected (B, {D}); "
                "check SidecarConfig.feature_dim against the snapshot's feature contract"
            )
        if source_layer_B.shape != feature_BD.shape[:1] or source_layer_B.dtype != torch.long:
            raise BatchError(
                f"layer has shape {tuple(source_layer_B.shape)} and dtype "
                f"{source_layer_B.dtype}; expected int64 of shape ({feature_BD.shape[0]},)"
            )
        if source_layer_B.numel():
            low, high = int(source_layer_B.min()), int(source_layer_B.max())
            if low < 0 or high >= L:
                raise BatchError(
                    f"layer ids span [{low}, {high}] but must lie in [0, {L}); "
                    "check SidecarConfig.layer_count against the snapshot geometry"
                )


def select_valid(valid_BO: torch.Tensor, *tensors_BO: torch.Tensor) -> list[torch.Tensor]:
    """Flatten ``(B, O, ...)`` tensors to ``(N, ...)`` rows whose target exists."""
    return [t[valid_BO] for t in tensors_BO]


def membership_probability(scores: torch.Tensor) -> torch.Tensor:
    """Per-expert probability of belonging to the native top-k (what calibration trains)."""
    return torch.sigmoid(scores)


def rank_candidates(scores_BE: torch.Tensor, budget: int) -> torch.Tensor:
    """The ``budget`` best experts per row ``(B, C)``, ties broken by the lower expert id
    (the router's rule), so the result is deterministic."""
    if not 1 <= budget <= scores_BE.shape[-1]:
        raise BatchError(f"budget {budget} must lie in [1, {scores_BE.shape[-1]}] experts")
    order_BE = torch.sort(scores_BE, dim=-1, descending=True, stable=True).indices  # (B, E)
    return order_BE[:, :budget]  # (B, C)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Trainable parameters per top-level submodule/parameter, plus ``"total"``."""
    counts: dict[str, int] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            top = name.split(".", 1)[0]
            counts[top] = counts.get(top, 0) + parameter.numel()
    counts["total"] = sum(counts.values())
    return counts
