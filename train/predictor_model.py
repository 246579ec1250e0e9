"""A checkpointable learned route predictor: the predictor ablation's architectures
(:mod:`train.predictors`) behind the interface of :class:`train.models.RouteSidecar`.

``flywheel train --model per_layer_mlp --gate-prior --width 64`` trains this module;
:mod:`train.checkpoint` saves and restores it, so ``flywheel evaluate``, qualification
and the shadow I/O simulator score the very model the predictor bench chose. It:

* holds one :class:`train.predictors.Predictor` per head offset ``(0, dlayer)``
  (``((0, 0),)`` own layer; ``((0, 0), (0, 1))`` adds the P1 next-layer head);
* carries the teacher's routers, RMSNorm gains and the feature lift as buffers
  (:class:`GatePrior`) when a head needs them (gate prior or gate adapter), so a
  checkpoint is self-contained: it needs no teacher to be scored, and the buffers are
  part of its checkpoint id;
* carries its calibration (:class:`train.predictors.PlattCalibration` per head, fitted
  on validation only, see :func:`train.predictors.fit_platt`) as a buffer.

``forward(feature_BD, layer_B)`` returns scores ``(B, O, E)``; a head whose target
layer does not exist (layer l+1 of the last layer) scores 0 there: the trainer masks
those rows out, exactly as for the sidecar.

Legend: B rows, D feature width, H router width, L routed layers, E experts, O heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.exceptions import BatchError
from hebrus_flywheel.train.isotonic import KNOTS
from hebrus_flywheel.train.predictors import (
    ARCHITECTURES,
    GateArrays,
    PlattCalibration,
    Predictor,
    PredictorSpec,
    register_gate_buffers,
)

MODEL_KIND = "route_predictor"


@dataclass(frozen=True, kw_only=True)
class PredictorConfig:
    """Geometry and architecture of a :class:`RoutePredictor`."""

    architecture: str = "per_layer_mlp"
    """One of :data:`train.predictors.ARCHITECTURES`."""
    gate_prior: bool = False
    """Add the target layer's native-gate logits, scaled per layer (residual learning)."""
    width: int = 64
    """MLP width of ``per_layer_mlp``; low-rank width of ``shared_lowrank``."""
    feature_dim: int = 64
    """D: width of the stored feature."""
    layer_count: int = 48
    """L: routed layers."""
    expert_count: int = 512
    """E: experts per routed layer."""
    hidden_dim: int = 0
    """H: the router's input width; 0 when no head needs the teacher's gate."""
    offsets: tuple[tuple[int, int], ...] = ((0, 0),)
    """Head offsets ``(0, dlayer)``; must include ``(0, 0)``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(tuple(o) for o in self.offsets))
        for name in ("width", "feature_dim", "layer_count", "expert_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PredictorConfig.{name} must be a positive integer, "
                                  f"got {value!r}")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"PredictorConfig.architecture must be one of {ARCHITECTURES}, "
                              f"got {self.architecture!r}")
        if (0, 0) not in self.offsets or any(o[0] != 0 or o[1] not in (0, 1)
                                             for o in self.offsets):
            raise ConfigError(f"PredictorConfig.offsets {self.offsets!r} must include (0, 0) "
                              "and hold only (0, 0) and (0, 1)")
        if self.needs_gate and self.hidden_dim < 1:
            raise ConfigError("PredictorConfig.hidden_dim must be the router width (> 0) for "
                              f"{self.architecture} with gate_prior={self.gate_prior}")
        for offset in self.offsets:  # the spec checks the architecture x features pair
            self.spec(offset[1])

    @property
    def needs_gate(self) -> bool:
        return self.gate_prior or self.architecture == "gate_adapter"

    def spec(self, target_offset: int) -> PredictorSpec:
        return PredictorSpec(architecture=self.architecture, gate_prior=self.gate_prior,
                             target_offset=target_offset, width=self.width)

    @property
    def name(self) -> str:
        """The ablation's name of the own-layer head, e.g. ``per_layer_mlp+gate_prior@64``."""
        return self.spec(0).name


class GatePrior(nn.Module):
    """The native router of a target layer on the lifted, RMS-normalised feature:
    :func:`train.predictors.gate_logits` in torch, with the weights as buffers."""

    router_LEH: torch.Tensor
    lift_DH: torch.Tensor
    gain_LH: torch.Tensor
    bias_LE: torch.Tensor

    def __init__(self, config: PredictorConfig, gate: GateArrays | None) -> None:
        super().__init__()
        L, E, D, H = (config.layer_count, config.expert_count, config.feature_dim,
                      config.hidden_dim)
        gate = gate if gate is not None else GateArrays(np.zeros((L, E, H), np.float32),
                                                        None, None)
        if tuple(gate.router_LEH.shape) != (L, E, H):
            raise ConfigError(f"the teacher's routers are {tuple(gate.router_LEH.shape)}, the "
                              f"model needs {(L, E, H)}; pass the snapshot's own teacher")
        register_gate_buffers(self, gate, D)

    def arrays(self) -> GateArrays:
        return GateArrays(self.router_LEH.cpu().numpy(), self.lift_DH.cpu().numpy(),
                          self.gain_LH.cpu().numpy(), self.bias_LE.cpu().numpy())

    def forward(self, feature_BD: torch.Tensor, target_B: torch.Tensor) -> torch.Tensor:
        h_BH = feature_BD.float() @ self.lift_DH
        h_BH = h_BH * torch.rsqrt(h_BH.pow(2).mean(dim=1, keepdim=True) + 1e-6)
        h_BH = h_BH * self.gain_LH[target_B]
        out_BE = h_BH.new_empty(h_BH.shape[0], self.router_LEH.shape[1])
        for layer in torch.unique(target_B).tolist():
            rows = target_B == layer
            out_BE[rows] = h_BH[rows] @ self.router_LEH[layer].T + self.bias_LE[layer]
        return out_BE


class RoutePredictor(nn.Module):
    """One learned predictor per head offset, the gate it may lean on, its calibration."""

    calibration_O3: torch.Tensor
    calibration_knots_O2M: torch.Tensor

    def __init__(self, config: PredictorConfig, gate: GateArrays | None = None) -> None:
        super().__init__()
        if config.needs_gate and gate is None:
            raise ConfigError(f"{config.name} needs the teacher's routers; pass --teacher")
        self.config = config
        self.gate = GatePrior(config, gate) if config.needs_gate else None
        arrays = None if self.gate is None else self.gate.arrays()
        self.heads = nn.ModuleList([
            Predictor(config.spec(dl), feature_dim=config.feature_dim,
                      layer_count=config.layer_count, expert_count=config.expert_count,
                      gate=arrays) for _, dl in config.offsets])
        identity = [[1.0, 0.0, 0.0]] * len(config.offsets)  # scale, bias, boundary
        self.register_buffer("calibration_O3", torch.tensor(identity, dtype=torch.float64))
        # the isotonic map's knots (x, y) per head; all-zero x: none
        self.register_buffer("calibration_knots_O2M", torch.zeros(
            len(config.offsets), 2, KNOTS, dtype=torch.float64))

    def target_layers(self, source_layer_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target layer of every head and whether it exists: ``(B, O)`` each."""
        dl_O = torch.tensor([dl for _, dl in self.config.offsets], device=source_layer_B.device)
        target_BO = source_layer_B[:, None] + dl_O[None, :]
        valid_BO = target_BO < self.config.layer_count
        return target_BO.clamp(0, self.config.layer_count - 1), valid_BO

    def forward(self, feature_BD: torch.Tensor, source_layer_B: torch.Tensor) -> torch.Tensor:
        """Scores ``(B, O, E)`` (0 where a head's target layer does not exist)."""
        self._check_inputs(feature_BD, source_layer_B)
        feature_BD = feature_BD.float()
        target_BO, valid_BO = self.target_layers(source_layer_B)
        heads = []
        for slot, head in enumerate(self.heads):
            valid_B = valid_BO[:, slot]
            scores_BE = feature_BD.new_zeros(feature_BD.shape[0], self.config.expert_count)
            if bool(valid_B.all()):  # the own-layer head: every row
                prior_BE = None if not self.config.gate_prior or self.gate is None else (
                    self.gate(feature_BD, target_BO[:, slot]))
                scores_BE = head(feature_BD, source_layer_B, prior_BE)
            elif bool(valid_B.any()):
                x_BD, layer_B = feature_BD[valid_B], source_layer_B[valid_B]
                prior_BE = None if not self.config.gate_prior or self.gate is None else (
                    self.gate(x_BD, target_BO[valid_B, slot]))
                scores_BE = scores_BE.index_put((valid_B,), head(x_BD, layer_B, prior_BE))
            heads.append(scores_BE)
        return torch.stack(heads, dim=1)

    def calibration(self, head: int = 0) -> PlattCalibration:
        scale, bias, boundary = (float(v) for v in self.calibration_O3[head])
        x_M, y_M = self.calibration_knots_O2M[head]
        knots = bool(x_M.any())
        return PlattCalibration(scale=scale, bias=bias, boundary=int(boundary),
                                knot_x=tuple(x_M.tolist()) if knots else (),
                                knot_y=tuple(y_M.tolist()) if knots else ())

    def set_calibration(self, head: int, calibration: PlattCalibration) -> None:
        with torch.no_grad():
            self.calibration_O3[head] = torch.tensor(
                [calibration.scale, calibration.bias, float(calibration.boundary)],
                dtype=torch.float64)
            self.calibration_knots_O2M[head] = 0.0
            if calibration.knot_x:
                self.calibration_knots_O2M[head] = torch.tensor(
                    [calibration.knot_x, calibration.knot_y], dtype=torch.float64)

    def probabilities(self, scores_BE: torch.Tensor, head: int = 0) -> torch.Tensor:
        """Calibrated probability that an expert is in the native top-k set."""
        return self.calibration(head).probabilities(scores_BE)

    @staticmethod
    def empty_gate(config: PredictorConfig) -> GateArrays | None:
        """Placeholder gate arrays of the right shapes (a checkpoint's buffers replace them)."""
        if not config.needs_gate:
            return None
        L, E, D, H = (config.layer_count, config.expert_count, config.feature_dim,
                      config.hidden_dim)
        return GateArrays(np.zeros((L, E, H), np.float32), np.zeros((D, H), np.float32),
                          np.ones((L, H), np.float32), np.zeros((L, E), np.float32))

    def _check_inputs(self, feature_BD: torch.Tensor, layer_B: torch.Tensor) -> None:
        D, L = self.config.feature_dim, self.config.layer_count
        if feature_BD.ndim != 2 or feature_BD.shape[1] != D:
            raise BatchError(f"feature has shape {tuple(feature_BD.shape)}, expected (B, {D}); "
                             "check the checkpoint against the snapshot's feature contract")
        if layer_B.shape != feature_BD.shape[:1] or layer_B.dtype != torch.long:
            raise BatchError(f"layer has shape {tuple(layer_B.shape)} and dtype {layer_B.dtype};"
                             f" expected int64 of shape ({feature_BD.shape[0]},)")
        if layer_B.numel() and (int(layer_B.min()) < 0 or int(layer_B.max()) >= L):
            raise BatchError(f"layer ids must lie in [0, {L}); check the snapshot geometry")
