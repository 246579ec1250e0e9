"""The one training recipe of a learned route predictor (issue 17).

``flywheel predictors`` (the ablation, :mod:`train.predictor_bench`) and ``flywheel
train --model ...`` (:mod:`train.trainer`, the checkpoint that is qualified) both call
:func:`fit_predictor`, so the checkpoint is the ablation's winner, not a cousin trained
another way: given the same rows, seed and :class:`Recipe`, both produce the same
parameters.

The recipe:

* rows in memory (:class:`train.predictor_data.Rows`), uniform random batches drawn from
  a generator seeded with ``seed``; model initialised from ``seed``;
* the ranking objective of :mod:`train.losses` (``LossConfig``, calibration term off:
  calibration is fitted after training);
* AdamW, cosine decay from ``lr`` to ``lr/10``; models that start at the native-gate
  control (gate prior, gate adapter) use ``lr * prior_lr_factor``;
* every ``eval_every`` steps, and before the first (for a control-started model step 0
  is the control itself), the model is scored on the validation rows. For every source
  layer the state with the best validation score on that layer's rows is kept
  (:class:`BestStates`); a model whose parameters all have a leading layer axis (the
  per-layer MLP, the gate adapter, the prior scale) is stitched from those per-layer
  states; a model with parameters shared across layers (the shared low-rank sidecar)
  keeps the state with the best score over all validation rows;
* early stopping: after ``patience`` validations without any improvement;
* Platt calibration fitted on the validation split only
  (:func:`train.predictors.fit_platt`, on the candidate pairs the ECE judges).

Nothing here reads a holdout split. Legend: N rows, D feature width, L routed layers,
E experts, K native top-k.
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
from hebrus_flywheel.train.losses import LossConfig, SidecarLoss
from hebrus_flywheel.train.predictor_data import GateWeights, Rows
from hebrus_flywheel.train.predictors import (
    GateArrays,
    PlattCalibration,
    Predictor,
    PredictorSpec,
    calibration_candidates,
    candidate_pairs,
    fit_platt,
)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How one learned predictor is trained, selected and calibrated."""

    steps: int = 300
    """Most optimiser steps (fewer when early stopping ends the run)."""
    batch_size: int = 512
    """Rows per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (cosine decay to lr/10 over ``steps``)."""
    prior_lr_factor: float = 0.3
    """Learning-rate factor of models that start at the native-gate control."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    eval_every: int = 25
    """Steps between validation checks of the best-state selection."""
    patience: int = 4
    """Validations without any improvement before stopping; 0 never stops early."""
    select_on: str = "recall"
    """Validation criterion: ``recall`` (recall@k) or ``recall+exact``."""
    seed: int = 0
    """Seed of initialisation and batch order."""
    loss: LossConfig = field(default_factory=lambda: LossConfig(calibration_weight=0.0))
    """The ranking objective."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Recipe.{name} must be a positive integer, got {value!r}")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or (
                self.patience < 0):
            raise ConfigError(f"Recipe.patience must be an integer >= 0, got {self.patience!r}")
        if self.select_on not in ("recall", "recall+exact"):
            raise ConfigError(f"Recipe.select_on must be recall or recall+exact, got "
                              f"{self.select_on!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"Recipe.lr must be a positive number, got {self.lr!r}")
        if self.weight_decay < 0 or not 0 < self.prior_lr_factor <= 1:
            raise ConfigError("Recipe.weight_decay must be >= 0 and Recipe.prior_lr_factor "
                              "in (0, 1]")

    def learning_rate(self, spec: PredictorSpec) -> float:
        """The peak learning rate of ``spec`` (lower for control-started models)."""
        return self.lr * (self.prior_lr_factor if starts_at_control(spec) else 1.0)


def starts_at_control(spec: PredictorSpec) -> bool:
    """A gate-prior model or a gate adapter starts exactly at the native gate."""
    return spec.gate_prior or spec.architecture == "gate_adapter"


@dataclass(eq=False)
class Trained:
    """One fitted predictor: the chosen model, its calibration and how it was chosen."""

    spec: PredictorSpec
    model: Predictor
    calibration: PlattCalibration
    seconds: float
    best_step: dict[str, int] = field(default_factory=dict)
    steps_run: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    validation: dict[str, float] = field(default_factory=dict)


Inputs = tuple[Rows, np.ndarray, np.ndarray | None]
"""(source rows, target ids ``(N, K)``, gate-prior logits ``(N, E)`` or None)."""


def spec_inputs(rows: Rows, spec: PredictorSpec, gate: GateWeights | None) -> Inputs:
    """(source rows, target ids, gate prior logits) of one spec on one split."""
    if spec.target_offset == 0:
        source, targets = rows, rows.target_NK
    else:
        source, _ = rows.next_rows()
        targets = source.next_NK
    prior = None
    if spec.gate_prior:
        if gate is None:
            raise ConfigError(f"{spec.name} needs the teacher's routers; pass --teacher")
        prior = gate.logits(source.feature_ND, source.layer_N + spec.target_offset)
    return source, targets, prior


def model_scores(model: torch.nn.Module, source: Rows, prior: np.ndarray | None,
                 chunk: int = 8192) -> torch.Tensor:
    """Scores ``(N, E)`` of ``model`` on every row of ``source`` (eval mode, no grad)."""
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(source), chunk):
            stop = start + chunk
            p = None if prior is None else torch.from_numpy(prior[start:stop])
            out.append(model(torch.from_numpy(source.feature_ND[start:stop]),
                             torch.from_numpy(source.layer_N[start:stop]), p))
    return torch.cat(out)


def hits(scores_NE: torch.Tensor, targets_NK: np.ndarray) -> np.ndarray:
    """``(N, K)`` bool: whether each native expert is among the K best-ranked."""
    picked = scores_NE.topk(targets_NK.shape[1], dim=1).indices.numpy()
    return (picked[:, :, None] == targets_NK[:, None, :]).any(-1)


def selection_score(hit_NK: np.ndarray, select_on: str) -> float:
    """Recall@K (plus exact-match@K for ``recall+exact``): the selection criterion."""
    recall = float(hit_NK.mean()) if hit_NK.size else 0.0
    return recall + float(hit_NK.all(1).mean()) if select_on == "recall+exact" else recall


def layered(name: str) -> bool:
    """Whether a parameter has a leading layer axis (its legend suffix starts with L)."""
    return name.rsplit("_", 1)[-1].startswith("L")


class BestStates:
    """Per source layer and overall: the best validation score, its step and state."""

    def __init__(self, inputs: Inputs, select_on: str) -> None:
        self.source, self.targets, self.prior = inputs
        self.select_on = select_on
        self.layers = np.unique(self.source.layer_N).tolist()
        self.best: dict[int, tuple[float, int, dict[str, Any]]] = {}
        self.overall: tuple[float, int, dict[str, Any]] | None = None

    def offer(self, model: Predictor, step: int) -> dict[str, Any]:
        """Score ``model``; keep its state where it is best. Returns the validation
        figures and whether anything improved."""
        hit_NK = hits(model_scores(model, self.source, self.prior), self.targets)
        state: dict[str, Any] | None = None
        improved = False
        for layer in self.layers:
            score = selection_score(hit_NK[self.source.layer_N == layer], self.select_on)
            if layer not in self.best or score > self.best[layer][0]:
                state = state if state is not None else copy.deepcopy(model.state_dict())
                self.best[layer], improved = (score, step, state), True
        total = selection_score(hit_NK, self.select_on)
        if self.overall is None or total > self.overall[0]:
            state = state if state is not None else copy.deepcopy(model.state_dict())
            self.overall, improved = (total, step, state), True
        return {"step": step, "recall": float(hit_NK.mean()),
                "exact_match": float(hit_NK.all(1).mean()), "improved": improved}

    def steps(self, per_layer: bool) -> dict[str, int]:
        if not per_layer:
            assert self.overall is not None
            return {"all": self.overall[1]}
        return {str(layer): b[1] for layer, b in sorted(self.best.items())}

    def chosen(self, model: Predictor) -> bool:
        """Load the chosen state into ``model``; True when it was stitched per layer."""
        assert self.overall is not None
        names = [n for n, _ in model.named_parameters()]
        if not all(layered(n) for n in names):
            model.load_state_dict(self.overall[2])
            return False
        state = copy.deepcopy(self.overall[2])  # buffers: constants, the same in every state
        for name in names:
            for layer, (_, _, layer_state) in self.best.items():
                state[name][layer] = layer_state[name][layer]
        model.load_state_dict(state)
        return True


def _train_loop(model: Predictor, inputs: Inputs, best: BestStates, recipe: Recipe,
                spec: PredictorSpec) -> tuple[int, list[dict[str, Any]]]:
    source, targets, prior = inputs
    loss_fn = SidecarLoss(recipe.loss)
    lr = recipe.learning_rate(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=recipe.weight_decay)
    rng = np.random.default_rng(recipe.seed)
    x, layer = torch.from_numpy(source.feature_ND), torch.from_numpy(source.layer_N)
    y = torch.from_numpy(targets)
    p = None if prior is None else torch.from_numpy(prior)
    history, stale, step = [best.offer(model, 0)], 0, 0
    for step in range(recipe.steps):
        model.train()
        ratio = step / max(recipe.steps - 1, 1)
        for group in optimizer.param_groups:
            group["lr"] = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * ratio)))
        pick = torch.from_numpy(rng.integers(0, len(source), recipe.batch_size))
        scores = model(x[pick], layer[pick], None if p is None else p[pick])
        loss = loss_fn(scores, y[pick], layer_B=layer[pick] + spec.target_offset)["total"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (step + 1) % recipe.eval_every and step + 1 < recipe.steps:
            continue
        record = best.offer(model, step + 1)
        record["train_loss"] = float(loss.detach())
        history.append(record)
        stale = 0 if record["improved"] else stale + 1
        if recipe.patience and stale >= recipe.patience:
            break
    return step + 1, history


def fit_predictor(spec: PredictorSpec, train: Inputs | Rows, validation: Inputs | Rows,
                  gate: GateWeights | None, recipe: Recipe, *, layer_count: int,
                  expert_count: int, initial: dict[str, Any] | None = None) -> Trained:
    """Train ``spec`` on ``train``, choose its state on ``validation``, calibrate on
    ``validation``. ``initial``: a state to start from (resume) instead of the seeded
    initialisation. Rows or precomputed :func:`spec_inputs` (shared across specs)."""
    started = time.perf_counter()
    train_in = train if isinstance(train, tuple) else spec_inputs(train, spec, gate)
    val_in = validation if isinstance(validation, tuple) else spec_inputs(validation, spec, gate)
    best = BestStates(val_in, recipe.select_on)
    torch.manual_seed(recipe.seed)
    arrays = None if gate is None else GateArrays(gate.router_LEH, gate.lift_DH,
                                                  gate.norm_gain_LH, gate.bias_LE)
    model = Predictor(spec, feature_dim=train_in[0].feature_ND.shape[1],
                      layer_count=layer_count, expert_count=expert_count, gate=arrays)
    if initial is not None:
        model.load_state_dict(initial)
    steps_run, history = _train_loop(model, train_in, best, recipe, spec)
    per_layer = best.chosen(model)
    scores = model_scores(model, best.source, best.prior)
    hit_NK = hits(scores, best.targets)
    top_k = best.targets.shape[1]
    calibration = fit_platt(*candidate_pairs(scores, torch.from_numpy(best.targets),
                                             calibration_candidates(top_k, expert_count)),
                            top_k=top_k)
    return Trained(spec=spec, model=model, calibration=calibration,
                   seconds=round(time.perf_counter() - started, 2),
                   best_step=best.steps(per_layer), steps_run=steps_run, history=history,
                   validation={"recall": float(hit_NK.mean()),
                               "exact_match": float(hit_NK.all(1).mean()),
                               "rows": len(hit_NK)})
