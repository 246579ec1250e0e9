"""``flywheel train --model per_layer_mlp|shared_lowrank|gate_adapter``: the checkpoint
of a learned predictor, trained by the ablation's own recipe.

:func:`fit_checkpoint` runs :func:`train.recipe.fit_predictor` (the function
``flywheel predictors`` trains every ablation cell with) once per head of the
:class:`train.predictor_model.RoutePredictor`, on the snapshot's train rows held in
memory, chooses and calibrates on the validation rows, and saves the result as a normal
checkpoint with its lineage. Given the bench's settings (:func:`train.predictor_bench.
train_arguments`), the checkpoint's parameters are the ablation winner's.

The :class:`train.config.TrainConfig` maps onto the :class:`train.recipe.Recipe`:
``optim.max_steps`` -> steps, ``data.batch_size``, ``optim.lr`` (already the
control-started rate: ``train_arguments`` folds the bench's prior factor in),
``optim.weight_decay``, ``schedule.eval_every``, ``schedule.patience``, ``seed``,
``loss``. Under ``torchrun`` every rank runs the same deterministic recipe on all rows
(the predictors are small) and rank 0 writes the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train import ddp
from hebrus_flywheel.train.checkpoint import save_checkpoint
from hebrus_flywheel.train.config import TrainConfig
from hebrus_flywheel.train.predictor_data import GateWeights, load_rows
from hebrus_flywheel.train.predictor_model import RoutePredictor
from hebrus_flywheel.train.recipe import Recipe, Trained, fit_predictor


def recipe_of(config: TrainConfig) -> Recipe:
    """The recipe a training config asks for (see the module docstring)."""
    if config.schedule.monitor != "recall":
        raise ConfigError("schedule.monitor must be recall for a predictor: the recipe "
                          "chooses its state on validation recall@k")
    o = config.optim
    return Recipe(steps=o.max_steps, batch_size=config.data.batch_size, lr=o.lr,
                  prior_lr_factor=1.0, weight_decay=o.weight_decay,
                  eval_every=config.schedule.eval_every, patience=config.schedule.patience,
                  select_on="recall", seed=config.seed, loss=config.loss)


def fit_heads(model: RoutePredictor, config: TrainConfig, snapshot: Any,
              gate: GateWeights | None, *, resumed: bool) -> list[Trained]:
    """Fit every head of ``model`` in place (parameters and calibration)."""
    d = config.data
    train_rows = load_rows(snapshot, d.train_split)
    validation_rows = load_rows(snapshot, d.validation_split)
    recipe = recipe_of(config)
    fitted = []
    for slot, (_, dl) in enumerate(model.config.offsets):
        head = model.heads[slot]
        item = fit_predictor(
            model.config.spec(dl), train_rows, validation_rows, gate, recipe,
            layer_count=model.config.layer_count, expert_count=model.config.expert_count,
            initial={k: v.detach().clone() for k, v in head.state_dict().items()}
            if resumed else None)
        head.load_state_dict(item.model.state_dict())
        model.set_calibration(slot, item.calibration)
        fitted.append(item)
    return fitted


def _float64(array: np.ndarray | None) -> np.ndarray | None:
    return None if array is None else np.asarray(array, np.float64)


def fit_checkpoint(trainer: Any, gate: GateWeights | None) -> tuple[dict[str, Any],
                                                                   list[dict[str, Any]]]:
    """Train ``trainer.model`` (a RoutePredictor) by the recipe and save it (rank 0).
    Returns (lineage, the own-layer head's validation history)."""
    model: RoutePredictor = trainer.model
    if gate is None and model.gate is not None:  # the checkpoint's own buffers
        buffers = model.gate.arrays()
        gate = GateWeights(router_LEH=np.asarray(buffers.router_LEH, np.float64),
                           norm_gain_LH=_float64(buffers.gain_LH),
                           lift_DH=_float64(buffers.lift_DH), bias_LE=_float64(buffers.bias_LE))
    fitted = fit_heads(model, trainer.config, trainer.snapshot, gate,
                       resumed=trainer.parent is not None)
    own = fitted[model.config.offsets.index((0, 0))]
    history = [{"step": r["step"], "train_loss": r.get("train_loss"),
                "validation": {"recall": r["recall"], "exact_match": r["exact_match"]}}
               for r in own.history]
    outcome = {"recipe": "train.recipe.fit_predictor",
               "best_step": max(own.best_step.values()), "best_step_per_layer": own.best_step,
               "best_validation": own.validation, "steps": own.steps_run,
               "stopped": "early_stopping" if own.steps_run < trainer.config.optim.max_steps
               else "max_steps", "validation_split": trainer.config.data.validation_split,
               "heads": {item.spec.name: {"best_step": item.best_step,
                                          "validation": item.validation,
                                          "calibration": vars(item.calibration)}
                         for item in fitted}}
    lineage: dict[str, Any] = {}
    if trainer.ctx.is_main:
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        for record in history:
            trainer._write_history(record)
        lineage = save_checkpoint(Path(trainer.out_dir), model.config, state,
                                  trainer.lineage(outcome))
    ddp.barrier(trainer.ctx)
    return lineage, history
