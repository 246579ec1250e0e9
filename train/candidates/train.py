"""Training Model B (:class:`.model.CandidateSidecar`) on a split of candidate rows.

``w_accept(p)`` comes from the *training* rows' measured acceptance; the best state is
chosen on validation recall@k every ``eval_every`` steps; the Platt calibration of
membership probabilities is fitted on validation. Nothing sees the holdouts.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.candidates.model import (
    AcceptanceLoss,
    AcceptanceLossConfig,
    CandidateConfig,
    CandidateSidecar,
    acceptance_schedule,
)
from hebrus_flywheel.train.candidates.rows import CandidateRows, acceptance_by_position
from hebrus_flywheel.train.predictors import (
    PlattCalibration,
    calibration_candidates,
    candidate_pairs,
    fit_platt,
)


@dataclass(frozen=True, kw_only=True)
class CandidateTrainConfig:
    """How Model B is trained."""

    width: int = 64
    """Hidden width of the per-layer trunk."""
    steps: int = 300
    """Optimiser steps."""
    batch_size: int = 512
    """Rows per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (cosine decay to lr/10)."""
    eval_every: int = 25
    """Steps between validation checks of the best-state selection."""
    seed: int = 0
    """Seed of initialisation and batch order."""
    acceptance_floor: float = 0.05
    """Lowest ``w_accept(p)``, > 0: rejected suffixes keep weight."""
    loss: AcceptanceLossConfig = field(default_factory=AcceptanceLossConfig)
    """Cost-term weights."""

    def __post_init__(self) -> None:
        for name in ("width", "steps", "batch_size", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"CandidateTrainConfig.{name} must be a positive integer, "
                                  f"got {value!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"CandidateTrainConfig.lr must be > 0, got {self.lr!r}")
        if not 0 < self.acceptance_floor <= 1:
            raise ConfigError("CandidateTrainConfig.acceptance_floor must be in (0, 1]")


@dataclass(eq=False)
class TrainedCandidate:
    """Model B after training, with what it was trained under."""

    model: CandidateSidecar
    calibration: PlattCalibration
    acceptance: dict[int, float]
    """Measured acceptance by position on the training split (``w_accept``)."""
    best_step: int
    seconds: float


def tensors(rows: CandidateRows) -> dict[str, torch.Tensor]:
    """The model inputs and labels of ``rows`` as tensors."""
    return {"feature": torch.from_numpy(rows.feature_ND), "layer": torch.from_numpy(rows.layer_N),
            "position": torch.from_numpy(rows.position_N), "token": torch.from_numpy(rows.token_N),
            "logprob": torch.from_numpy(rows.logprob_N),
            "accepted": torch.from_numpy(rows.accepted_N),
            "target": torch.from_numpy(rows.target_NK)}


def predict(model: CandidateSidecar, rows: CandidateRows, chunk: int = 8192) -> torch.Tensor:
    """Scores ``(N, E)`` of every row."""
    t = tensors(rows)
    model.eval()
    out = []
    with torch.no_grad():
        for s in range(0, len(rows), chunk):
            cut = slice(s, s + chunk)
            out.append(model(t["feature"][cut], t["layer"][cut], t["position"][cut],
                             t["token"][cut], t["logprob"][cut]))
    return torch.cat(out)


def recall_at_k(scores_NE: torch.Tensor, target_NK: np.ndarray) -> float:
    picked = scores_NE.topk(target_NK.shape[1], dim=1).indices.numpy()
    return float((picked[:, :, None] == target_NK[:, None, :]).any(-1).mean())


def _step(model: CandidateSidecar, loss_fn: AcceptanceLoss, t: dict[str, torch.Tensor],
          pick: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    model.train()
    scores = model(t["feature"][pick], t["layer"][pick], t["position"][pick], t["token"][pick],
                   t["logprob"][pick])
    loss = loss_fn(scores, t["target"][pick], layer_B=t["layer"][pick],
                   position_B=t["position"][pick], accepted_B=t["accepted"][pick])["total"]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def train_candidate(train: CandidateRows, validation: CandidateRows, *, expert_count: int,
                    config: CandidateTrainConfig | None = None) -> TrainedCandidate:
    """Train Model B on ``train``, choose its state and calibration on ``validation``."""
    config = CandidateTrainConfig() if config is None else config
    started = time.perf_counter()
    acceptance = acceptance_by_position(train)
    torch.manual_seed(config.seed)
    model = CandidateSidecar(CandidateConfig(
        feature_dim=train.feature_ND.shape[1], layer_count=int(train.layer_N.max()) + 1,
        expert_count=expert_count, block=max(train.block, validation.block), width=config.width))
    loss_fn = AcceptanceLoss(acceptance_schedule(acceptance, floor=config.acceptance_floor),
                             config.loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    rng, t = np.random.default_rng(config.seed), tensors(train)
    best: tuple[float, int, dict[str, Any]] = (
        recall_at_k(predict(model, validation), validation.target_NK), 0,
        copy.deepcopy(model.state_dict()))
    for step in range(config.steps):
        ratio = step / max(config.steps - 1, 1)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * ratio)))
        _step(model, loss_fn, t, torch.from_numpy(rng.integers(0, len(train), config.batch_size)),
              optimizer)
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            score = recall_at_k(predict(model, validation), validation.target_NK)
            if score > best[0]:
                best = (score, step + 1, copy.deepcopy(model.state_dict()))
    model.load_state_dict(best[2])
    scores = predict(model, validation)
    calibration = fit_platt(*candidate_pairs(scores, torch.from_numpy(validation.target_NK),
                                             calibration_candidates(validation.target_NK.shape[1],
                                                                    expert_count)))
    return TrainedCandidate(model=model, calibration=calibration, acceptance=acceptance,
                            best_step=best[1], seconds=round(time.perf_counter() - started, 2))
