"""Learned route predictors beside the shared sidecar, and their calibration.

* :class:`PerLayerMLP`: the published pre-attention predictor: for every source layer
  its own LayerNorm and two linear layers (``feature -> GELU(hidden) -> E scores``),
  trained with the ranking loss of :mod:`train.losses`.
* :class:`SharedLowRank`: the shared low-rank sidecar (:class:`train.models.RouteSidecar`)
  for one head offset.
* Both can add a *gate prior*: the native router of the target layer applied to the
  same pre-attention feature (the native-gate control's raw logits), scaled by a learned
  per-layer factor. The network then only learns the residual the control misses
  (what attention adds to the residual stream before the router reads it).
* ``target_offset`` 0 predicts the row's own layer; 1 is the P1 (next-layer) variant.
* :class:`PlattCalibration`: ``sigmoid(a * x + b)`` per model, ``x`` the score or its
  distance from the row's top-k edge, fitted on the
  validation split only (a temperature ``1/a`` plus a bias) on the pairs the ECE
  judges: each row's ``2k`` best-ranked candidates and whether each is in the native
  top-k set (:func:`calibration_candidates`), then an isotonic map on top when it
  lowers the BCE of held-out validation pairs (:mod:`train.isotonic`). It does not
  change the ranking, only what the membership probabilities mean.

Legend: B rows, D feature width, L routed layers, E experts, K native top-k, M MLP width.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.isotonic import fit_knots, held_out_gain, interpolate
from hebrus_flywheel.train.models import RouteSidecar, SidecarConfig

ARCHITECTURES = ("per_layer_mlp", "shared_lowrank", "gate_adapter")


class GateArrays(NamedTuple):
    """The teacher's routers as a predictor's buffers."""

    router_LEH: np.ndarray
    lift_DH: np.ndarray | None
    """The feature lift ``(D, H)``; None: features are the hidden states."""
    gain_LH: np.ndarray | None
    """The RMSNorm gain before each router; None: ones."""
    bias_LE: np.ndarray | None = None
    """The routers' logit biases (GPT-OSS); None: their linears have none."""


@dataclass(frozen=True, kw_only=True)
class PredictorSpec:
    """One learned predictor of the ablation: architecture x features x target."""

    architecture: str
    """``per_layer_mlp`` or ``shared_lowrank``."""
    gate_prior: bool = False
    """Add the native gate's logits of the target layer (residual learning)."""
    target_offset: int = 0
    """0: the row's own layer; 1: the next layer (P1)."""
    width: int = 64
    """MLP width of ``per_layer_mlp``; low-rank width R of ``shared_lowrank``."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"PredictorSpec.architecture must be one of {ARCHITECTURES}, "
                              f"got {self.architecture!r}")
        if self.target_offset not in (0, 1):
            raise ConfigError("PredictorSpec.target_offset must be 0 (own layer) or 1 (P1), "
                              f"got {self.target_offset!r}")
        if self.architecture == "gate_adapter" and self.gate_prior:
            raise ConfigError("PredictorSpec.gate_prior: a gate_adapter is the gate already")
        if isinstance(self.width, bool) or not isinstance(self.width, int) or self.width < 1:
            raise ConfigError(f"PredictorSpec.width must be a positive integer, got {self.width!r}")

    @property
    def name(self) -> str:
        base = self.architecture + ("+gate_prior" if self.gate_prior else "")
        return ("p1_" if self.target_offset else "") + f"{base}@{self.width}"

    @property
    def features(self) -> str:
        if self.architecture == "gate_adapter":
            return "pre_attention+router_weights"
        return "pre_attention" + ("+gate_logits" if self.gate_prior else "")


class PerLayerMLP(nn.Module):
    """Two linear layers per source layer: ``(B, D) -> (B, E)``."""

    def __init__(self, *, feature_dim: int, width: int, layer_count: int,
                 expert_count: int) -> None:
        super().__init__()
        D, M, L, E = feature_dim, width, layer_count, expert_count
        self.norm_gain_LD = nn.Parameter(torch.ones(L, D))  # a LayerNorm per layer: every
        self.norm_bias_LD = nn.Parameter(torch.zeros(L, D))  # parameter is per layer
        self.w1_LDM = nn.Parameter(torch.randn(L, D, M) / math.sqrt(D))
        self.b1_LM = nn.Parameter(torch.zeros(L, M))
        self.w2_LME = nn.Parameter(torch.randn(L, M, E) / math.sqrt(M))
        self.b2_LE = nn.Parameter(torch.zeros(L, E))

    def forward(self, feature_BD: torch.Tensor, layer_B: torch.Tensor) -> torch.Tensor:
        x_BD = F.layer_norm(feature_BD, feature_BD.shape[1:])
        out_BE = feature_BD.new_empty(feature_BD.shape[0], self.b2_LE.shape[1])
        for layer in torch.unique(layer_B).tolist():  # one pair of matmuls per layer
            rows = layer_B == layer
            x_RD = x_BD[rows] * self.norm_gain_LD[layer] + self.norm_bias_LD[layer]
            h_BM = F.gelu(x_RD @ self.w1_LDM[layer] + self.b1_LM[layer])
            out_BE[rows] = h_BM @ self.w2_LME[layer] + self.b2_LE[layer]
        return out_BE


class SharedLowRank(nn.Module):
    """The shared low-rank sidecar with one head (``(0, 0)`` own layer, ``(0, 1)`` P1)."""

    def __init__(self, *, feature_dim: int, width: int, layer_count: int, expert_count: int,
                 target_offset: int) -> None:
        super().__init__()
        self.sidecar = RouteSidecar(SidecarConfig(
            feature_dim=feature_dim, rank=width, hidden=4 * width, layer_count=layer_count,
            expert_count=expert_count, offsets=((0, target_offset),)))

    def forward(self, feature_BD: torch.Tensor, layer_B: torch.Tensor) -> torch.Tensor:
        return self.sidecar(feature_BD, layer_B)[:, 0]


def zero_bias_if_absent(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                        *args: Any) -> None:
    """Load hook: a state saved before the gate buffers carried the routers' logit bias
    was computed without one, i.e. with zeros, so it loads with zeros."""
    del args
    bias = cast(torch.Tensor, module.bias_LE)
    state_dict.setdefault(prefix + "bias_LE", torch.zeros_like(bias))


def register_gate_buffers(module: nn.Module, gate: GateArrays, feature_dim: int) -> None:
    """``gate`` as ``module``'s float32 buffers ``router_LEH``, ``lift_DH`` (identity if
    None), ``gain_LH`` (ones) and ``bias_LE`` (zeros, also for a state saved without it)."""
    L, E, H = gate.router_LEH.shape
    module.register_buffer("router_LEH", torch.as_tensor(gate.router_LEH).float())
    module.register_buffer("lift_DH", torch.eye(feature_dim, H) if gate.lift_DH is None
                           else torch.as_tensor(gate.lift_DH).float())
    module.register_buffer("gain_LH", torch.ones(L, H) if gate.gain_LH is None
                           else torch.as_tensor(gate.gain_LH).float())
    module.register_buffer("bias_LE", torch.zeros(L, E) if gate.bias_LE is None
                           else torch.as_tensor(gate.bias_LE).float())
    module.register_load_state_dict_pre_hook(zero_bias_if_absent)


class GateAdapter(nn.Module):
    """The native router of the target layer on an adapted state:
    ``router_t(gain_t * rms_norm(lift(x) + x @ delta_l))``, ``delta`` per source layer
    and zero at init, so it starts exactly at the native-gate control and learns a
    linear stand-in for what attention adds before the router reads the state."""

    def __init__(self, gate: GateArrays, *, feature_dim: int, target_offset: int) -> None:
        super().__init__()
        L, _, H = gate.router_LEH.shape
        self.offset = target_offset
        self.router_LEH: torch.Tensor
        self.lift_DH: torch.Tensor
        self.gain_LH: torch.Tensor
        self.bias_LE: torch.Tensor
        register_gate_buffers(self, gate, feature_dim)
        self.delta_LDH = nn.Parameter(torch.zeros(L, feature_dim, H))

    def forward(self, feature_BD: torch.Tensor, layer_B: torch.Tensor) -> torch.Tensor:
        out_BE = feature_BD.new_empty(feature_BD.shape[0], self.router_LEH.shape[1])
        for layer in torch.unique(layer_B).tolist():
            rows = layer_B == layer
            x_BD = feature_BD[rows]
            h_BH = x_BD @ self.lift_DH + x_BD @ self.delta_LDH[layer]
            h_BH = h_BH * torch.rsqrt(h_BH.pow(2).mean(dim=1, keepdim=True) + 1e-6)
            target = layer + self.offset
            out_BE[rows] = ((h_BH * self.gain_LH[target]) @ self.router_LEH[target].T
                            + self.bias_LE[target])
        return out_BE


class Predictor(nn.Module):
    """A network plus, optionally, the scaled gate prior: ``scores (B, E)``."""

    def __init__(self, spec: PredictorSpec, *, feature_dim: int, layer_count: int,
                 expert_count: int, gate: GateArrays | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.net: nn.Module
        if spec.architecture == "gate_adapter":
            if gate is None:
                raise ConfigError(f"{spec.name} needs the teacher's routers; pass --teacher")
            self.net = GateAdapter(gate, feature_dim=feature_dim,
                                   target_offset=spec.target_offset)
        elif spec.architecture == "per_layer_mlp":
            self.net = PerLayerMLP(feature_dim=feature_dim, width=spec.width,
                                   layer_count=layer_count, expert_count=expert_count)
        else:
            self.net = SharedLowRank(feature_dim=feature_dim, width=spec.width,
                                     layer_count=layer_count, expert_count=expert_count,
                                     target_offset=spec.target_offset)
        self.prior_scale_L = nn.Parameter(torch.ones(layer_count)) if spec.gate_prior else None
        if spec.gate_prior:  # start exactly at the control: the residual starts at zero
            with torch.no_grad():
                for name, parameter in self.net.named_parameters():
                    if name.endswith(("w2_LME", "expert_embedding")):
                        parameter.mul_(0.01)

    def forward(self, feature_BD: torch.Tensor, layer_B: torch.Tensor,
                prior_BE: torch.Tensor | None = None) -> torch.Tensor:
        scores_BE = self.net(feature_BD, layer_B)
        if self.prior_scale_L is not None:
            if prior_BE is None:
                raise ConfigError(f"{self.spec.name} needs the gate prior (native-gate logits)")
            scores_BE = scores_BE + self.prior_scale_L[layer_B, None] * prior_BE
        return scores_BE


@dataclass(frozen=True, kw_only=True)
class PlattCalibration:
    """``p = sigmoid(scale * x + bias)``; identity is ``scale=1, bias=0, boundary=0``.

    ``x`` is the raw score (``boundary=0``) or, with ``boundary=k``, the score's distance
    from the edge of the row's predicted top-k set: ``score - (s_(k) + s_(k+1)) / 2``
    with ``s_(i)`` the row's i-th best score. A raw score means different things in rows
    and layers of different score scales; the distance from the row's own top-k edge is
    what decides membership, so one temperature fits every row."""

    scale: float = 1.0
    bias: float = 0.0
    boundary: int = 0
    knot_x: tuple[float, ...] = ()
    """With ``knot_y``: the isotonic map applied to the sigmoid's output
    (:mod:`train.isotonic`); empty when the held-out pairs did not gain from it."""
    knot_y: tuple[float, ...] = ()

    def features(self, scores_BE: torch.Tensor) -> torch.Tensor:
        scores = scores_BE.double()
        if not self.boundary or scores.shape[1] <= self.boundary:
            return scores
        top_BK = scores.topk(self.boundary + 1, dim=1).values
        return scores - 0.5 * (top_BK[:, -2:-1] + top_BK[:, -1:])

    def probabilities(self, scores_BE: torch.Tensor) -> torch.Tensor:
        prob = torch.sigmoid(self.scale * self.features(scores_BE) + self.bias)
        return interpolate(prob, self.knot_x, self.knot_y) if self.knot_x else prob


def calibration_candidates(top_k: int, expert_count: int) -> int:
    """How many best-ranked candidates per row ECE and calibration look at: ``2k``
    (clipped to E). The top-k set's boundary lies inside them: ranks 1..k are the
    prediction, ranks k+1..2k the nearest misses, and whether each of them is in the
    teacher's top-k set is what a prefetcher's probability must get right."""
    return min(2 * top_k, expert_count)


def candidate_pairs(scores_BE: torch.Tensor, target_ids_BK: torch.Tensor,
                    candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``(B, C)`` of each row's ``candidates`` best-ranked experts (ties: lower id)
    and whether each is in the native top-k set ``(B, C)`` (float)."""
    scores = scores_BE.detach().double()
    order_BE = torch.sort(scores, dim=1, descending=True, stable=True).indices
    picked_BC = order_BE[:, :candidates]
    member_BC = (picked_BC[:, :, None] == target_ids_BK[:, None, :].to(picked_BC)).any(-1)
    return scores.gather(1, picked_BC), member_BC.double()


def _fit_sigmoid(x_BC: torch.Tensor, member_BC: torch.Tensor,
                 iterations: int) -> tuple[float, float, float]:
    """(scale, bias, mean BCE) of ``sigmoid(scale * x + bias)`` against membership."""
    params = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([params], max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(params[0] * x_BC + params[1], member_BC)
        loss.backward()
        return loss

    optimizer.step(closure)
    scale, bias = (float(v) for v in params.detach())
    with torch.no_grad():
        loss = float(F.binary_cross_entropy_with_logits(scale * x_BC + bias, member_BC))
    return scale, bias, loss


def fit_platt(scores_BC: torch.Tensor, member_BC: torch.Tensor, *, top_k: int = 0,
              iterations: int = 100, isotonic: bool = True) -> PlattCalibration:
    """Scale and bias minimising the BCE of candidate membership on the given
    (validation) pairs: :func:`candidate_pairs` of the ECE's candidates, best first.
    With ``top_k`` both forms are fitted (raw score, and distance from the row's top-k
    edge, :class:`PlattCalibration`; the pairs are each row's best-ranked candidates in
    order, so the edge is between columns k-1 and k) and the one with the lower BCE on
    these validation pairs is kept. BCE, a proper scoring rule, not the ECE: a constant
    probability equal to the base rate has an ECE of zero and says nothing. With
    ``isotonic``, the isotonic map of :func:`with_isotonic` on top when it helps."""
    scores, member = scores_BC.detach().double(), member_BC.detach().double()
    fits = []
    for boundary in (0, top_k) if 0 < top_k < scores.shape[1] else (0,):
        form = PlattCalibration(boundary=boundary)
        scale, bias, loss = _fit_sigmoid(form.features(scores), member, iterations)
        if np.isfinite(scale) and np.isfinite(bias) and np.isfinite(loss):
            fitted = PlattCalibration(scale=scale, bias=bias, boundary=boundary)
            fits.append((loss, fitted))
    platt = min(fits, key=lambda f: f[0])[1] if fits else PlattCalibration()
    return with_isotonic(platt, scores, member) if isotonic else platt


def with_isotonic(platt: PlattCalibration, scores_BC: torch.Tensor,
                  member_BC: torch.Tensor) -> PlattCalibration:
    """``platt`` plus the isotonic map of :mod:`train.isotonic` when it lowers the BCE
    of held-out validation pairs, else ``platt`` unchanged."""
    prob_BC = platt.probabilities(scores_BC).numpy()
    member = member_BC.numpy()
    if held_out_gain(prob_BC, member) <= 0.0:
        return platt
    x, y = fit_knots(prob_BC.ravel(), member.ravel())
    return dataclasses.replace(platt, knot_x=x, knot_y=y)


def pair_ece(prob_BC: torch.Tensor, member_BC: torch.Tensor, bins: int = 10) -> float:
    """Binned ECE of probabilities against membership, as :mod:`train.metrics` defines
    it: ``sum_bins |members - sum p| / pairs`` over ``bins`` equal-width bins."""
    index = torch.clamp((prob_BC.double() * bins).long(), 0, bins - 1).flatten()
    gap = torch.zeros(bins, dtype=torch.float64)
    gap.index_add_(0, index, (member_BC.double() - prob_BC.double()).flatten())
    return float(gap.abs().sum() / max(prob_BC.numel(), 1))


def gate_logits(feature_BD: np.ndarray, layer_B: np.ndarray, *, router_LEH: np.ndarray,
                lift_DH: np.ndarray | None, norm_gain_LH: np.ndarray | None,
                bias_LE: np.ndarray | None = None) -> np.ndarray:
    """The native router of ``layer_B`` (with its logit bias, if any) on RMS-normalised
    lifted features: ``(B, E)`` float32 logits at the router's own scale (the prior of
    the residual predictors)."""
    hidden_BH = feature_BD.astype(np.float64)
    if lift_DH is not None:
        hidden_BH = hidden_BH @ lift_DH
    rms_B1 = np.sqrt((hidden_BH**2).mean(axis=1, keepdims=True) + 1e-6)
    hidden_BH = hidden_BH / rms_B1
    if norm_gain_LH is not None:
        hidden_BH = hidden_BH * norm_gain_LH[layer_B]
    out_BE = np.empty((hidden_BH.shape[0], router_LEH.shape[1]), dtype=np.float32)
    for layer in np.unique(layer_B):
        rows = layer_B == layer
        out_BE[rows] = hidden_BH[rows] @ router_LEH[layer].T
        if bias_LE is not None:
            out_BE[rows] += bias_LE[layer]
    return out_BE
