"""``flywheel train``: fit one route model on a sealed snapshot's ``train`` split.

The model is the shared route sidecar (``model.architecture = "sidecar"``, the
default) or a predictor of the ablation (:mod:`train.predictor_model`: per-layer MLP,
shared low-rank, gate adapter, each optionally on the native-gate prior), the one
``flywheel predictors`` chose on validation. A predictor that starts at the native-gate
control is validated before its first step too (step 0 is a valid choice), and after
training each head's calibration is fitted on the validation split and saved with it.

nanoGPT-style loop over optimiser steps: an endless, seeded stream of training batches
(:mod:`train.data`), AdamW with warm-up and cosine decay, the design note's objective
(:class:`train.losses.SidecarLoss`), validation on the validation split every
``eval_every`` steps (split guards make a training row there, or a validation row in
training, raise SplitMixingError), early stopping on validation recall@K or loss, and
the best checkpoint with its lineage (:mod:`train.checkpoint`). Under ``torchrun`` the
model is wrapped in DistributedDataParallel; ranks read disjoint units, validation sums
are all-reduced, so every rank takes the same early-stopping decision.

Reproducibility: the model is initialised from ``seed``, the data order is a function of
``(seed, epoch, rank, worker)``, so the same seed, snapshot, world size, worker count and
thread count give the same checkpoint id on CPU.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import append_file, make_dirs
from hebrus_flywheel.core.taint import refuse_tainted
from hebrus_flywheel.streams.consent import ConsentCheck
from hebrus_flywheel.train import ddp
from hebrus_flywheel.train.checkpoint import (
    HISTORY_FILE,
    code_version,
    load_checkpoint,
    save_checkpoint,
)
from hebrus_flywheel.train.config import TrainConfig, config_to_dict
from hebrus_flywheel.train.consent import check_ledger
from hebrus_flywheel.train.data import (
    Snapshot,
    SnapshotDataset,
    StreamConfig,
    batch_splits,
    make_loader,
)
from hebrus_flywheel.train.exceptions import CheckpointError, SnapshotError
from hebrus_flywheel.train.losses import SidecarLoss
from hebrus_flywheel.train.metrics import check_evaluation_rows, check_train_rows
from hebrus_flywheel.train.models import RouteSidecar, SidecarConfig, rank_candidates
from hebrus_flywheel.train.predictor_data import GateWeights, load_gate
from hebrus_flywheel.train.predictor_model import PredictorConfig, RoutePredictor
from hebrus_flywheel.train.predictors import GateArrays

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    """Where the best checkpoint went and how training went."""

    checkpoint_dir: Path
    lineage: dict[str, Any]
    history: list[dict[str, Any]]


def sidecar_config(config: TrainConfig, snapshot: Snapshot) -> SidecarConfig:
    """The model geometry: options from the config, D/L/E from the snapshot."""
    g, m = snapshot.geometry, config.model
    return SidecarConfig(feature_dim=int(g["feature_dim"]), layer_count=int(g["layers"]),
                         expert_count=snapshot.expert_count, rank=m.rank, hidden=m.hidden,
                         offsets=m.offsets, dropout=m.dropout,
                         layer_expert_bias=m.layer_expert_bias)


def predictor_config(config: TrainConfig, snapshot: Snapshot,
                     gate: GateArrays | None) -> PredictorConfig:
    """The geometry of a predictor of the ablation (``model.architecture`` not sidecar)."""
    g, m = snapshot.geometry, config.model
    return PredictorConfig(architecture=m.architecture, gate_prior=m.gate_prior, width=m.rank,
                           feature_dim=int(g["feature_dim"]), layer_count=int(g["layers"]),
                           expert_count=snapshot.expert_count, offsets=m.offsets,
                           hidden_dim=0 if gate is None else int(gate[0].shape[2]))


def build_model(config: TrainConfig, snapshot: Snapshot,
                gate: GateArrays | None = None) -> RouteSidecar | RoutePredictor:
    """The sidecar, or the predictor ``config.model`` names (``gate``: the teacher's
    routers, feature lift and RMSNorm gains, for a gate prior or a gate adapter)."""
    if config.model.architecture == "sidecar":
        return RouteSidecar(sidecar_config(config, snapshot))
    if config.model.needs_teacher and gate is None:
        raise ConfigError(f"model.architecture {config.model.architecture!r} with gate_prior="
                          f"{config.model.gate_prior} needs the snapshot's teacher: pass "
                          "--teacher DIR")
    return RoutePredictor(predictor_config(config, snapshot, gate),
                          gate if config.model.needs_teacher else None)


def load_gate_arrays(teacher_dir: Path, snapshot: Snapshot) -> GateArrays:
    """The snapshot's own teacher's routers ``(L, E, H)``, the lift of its feature
    contract ``(D, H)`` and the RMSNorm gains ``(L, H)`` (float32)."""
    return gate_arrays(load_gate(teacher_dir, snapshot), snapshot)


def gate_arrays(gate: GateWeights, snapshot: Snapshot) -> GateArrays:
    """:class:`GateWeights` as the float32 buffers of a checkpoint."""
    import numpy as np

    L, _, H = gate.router_LEH.shape
    D = int(snapshot.geometry["feature_dim"])
    lift = np.eye(D, H) if gate.lift_DH is None else gate.lift_DH
    gain = np.ones((L, H)) if gate.norm_gain_LH is None else gate.norm_gain_LH
    bias = None if gate.bias_LE is None else gate.bias_LE.astype(np.float32)
    return GateArrays(gate.router_LEH.astype(np.float32), lift.astype(np.float32),
                      gain.astype(np.float32), bias)


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``max_steps``."""
    o = config.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(o.max_steps - o.warmup_steps, 1)
    ratio = min((step - o.warmup_steps) / span, 1.0)
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (o.lr - o.min_lr)


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms, biases or embedding tables)."""
    decay: list[torch.nn.Parameter] = []
    keep: list[torch.nn.Parameter] = []
    for name, parameter in model.named_parameters():
        table = bool({"layer_film", "offset_film", "expert_bias"} & set(name.split(".")))
        (decay if parameter.ndim >= 2 and not table else keep).append(parameter)
    o = config.optim
    return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                              {"params": keep, "weight_decay": 0.0}], lr=o.lr,
                             betas=(o.beta1, o.beta2))


class Trainer:
    """One training run; :meth:`run` trains, validates, stops early and checkpoints."""

    def __init__(self, snapshot: Snapshot, out_dir: Path, config: TrainConfig,
                 ctx: ddp.DistContext, gate: GateArrays | None = None) -> None:
        self.snapshot, self.out_dir, self.config, self.ctx = snapshot, Path(out_dir), config, ctx
        self._check_snapshot()
        torch.manual_seed(config.seed)
        self.model = build_model(config, snapshot, gate).to(ctx.device)
        torch.manual_seed(config.seed + 7919 * ctx.rank)  # dropout differs across ranks
        self.ddp_model: torch.nn.Module = (
            DistributedDataParallel(self.model, device_ids=[ctx.device.index]
                                    if ctx.device.type == "cuda" else None,
                                    broadcast_buffers=False)  # buffers are constants
            if ctx.distributed else self.model)
        self.loss_fn = SidecarLoss(config.loss).to(ctx.device)
        self.optimizer = make_optimizer(self.model, config)
        self.own = self.model.config.offsets.index((0, 0))
        self.parent: str | None = None
        self.layer_offsets = tuple(dl for _, dl in self.model.config.offsets)

    def _check_snapshot(self) -> None:
        d = self.config.data
        for split in (d.train_split, d.validation_split):
            if self.snapshot.split_rows(split) == 0:
                raise SnapshotError(
                    f"snapshot {self.snapshot.snapshot_id} has no {split!r} rows; training "
                    "needs train rows and validation rows for early stopping")
        units = len(self.snapshot.units([d.train_split]))
        if units < self.ctx.world_size:
            raise SnapshotError(
                f"the train split has {units} shard row groups but {self.ctx.world_size} ranks; "
                "every rank needs at least one: use fewer ranks or a larger snapshot")

    def stream(self, split: str, *, train: bool) -> SnapshotDataset:
        d = self.config.data
        return SnapshotDataset(self.snapshot, StreamConfig(
            splits=(split,), batch_size=d.batch_size, shuffle=train,
            shuffle_buffer=d.shuffle_buffer, seed=self.config.seed, epochs=None if train else 1,
            layer_offsets=self.layer_offsets, lineage=False))

    def loss_terms(self, batch: dict[str, Any], *, train: bool = True
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The loss terms of one batch and its own-layer scores ``(B, E)``. Validation
        (``train=False``) bypasses DDP: ranks may hold different numbers of batches."""
        dev = self.ctx.device
        feature_BD = batch["feature_BD"].to(dev, torch.float32, non_blocking=True)
        layer_B = batch["layer_B"].to(dev, non_blocking=True)
        scores_BOE = (self.ddp_model if train else self.model)(feature_BD, layer_B)
        target_BO, in_range_BO = self.model.target_layers(layer_B)
        valid_BO = batch["offset_valid_BO"].to(dev) & in_range_BO
        terms = self.loss_fn(
            scores_BOE[valid_BO], batch["offset_target_ids_BOK"].to(dev)[valid_BO],
            layer_B=target_BO[valid_BO],
            target_weights_BK=batch["offset_target_weights_BOK"].to(dev)[valid_BO])
        return terms, scores_BOE[:, self.own]

    def step(self, batch: dict[str, Any], step: int) -> float:
        """One optimiser step on a training batch; returns its loss."""
        check_train_rows(batch_splits(batch), len(batch["layer_B"]))
        lr = learning_rate(step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.ddp_model.train()
        terms, _ = self.loss_terms(batch)
        self.optimizer.zero_grad(set_to_none=True)
        terms["total"].backward()
        if self.config.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
        self.optimizer.step()
        return float(terms["total"].detach())

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss, recall@K and exact top-K match on the validation split (all ranks)."""
        self.model.eval()
        sums = torch.zeros(4, dtype=torch.float64)  # loss*rows, hits, exact, rows
        limit = self.config.schedule.eval_max_batches
        loader = make_loader(self.stream(self.config.data.validation_split, train=False),
                             num_workers=self.config.data.num_workers)
        for index, batch in enumerate(loader):
            if limit and index >= limit:
                break
            rows = len(batch["layer_B"])
            check_evaluation_rows(batch_splits(batch), rows)
            terms, scores_BE = self.loss_terms(batch, train=False)
            targets_BK = batch["target_ids_BK"].to(self.ctx.device)
            k = targets_BK.shape[1]
            picked_BK = rank_candidates(scores_BE.float(), k)
            hits_B = (picked_BK[:, :, None] == targets_BK[:, None, :]).any(-1).sum(-1)
            sums += torch.tensor([float(terms["total"]) * rows, float(hits_B.sum()) / k,
                                  float((hits_B == k).sum()), rows], dtype=torch.float64)
        total = ddp.all_reduce_sum(sums, self.ctx)
        seen = max(float(total[3]), 1.0)
        return {"loss": float(total[0]) / seen, "recall": float(total[1]) / seen,
                "exact_match": float(total[2]) / seen, "rows": int(total[3])}

    def lineage(self, outcome: dict[str, Any]) -> dict[str, Any]:
        return {"format": "hebrus-flywheel-lineage/v1", "method": self.config.method,
                "snapshot": self.snapshot.lineage(),
                "feature_contract": {"dim": int(self.snapshot.geometry["feature_dim"]),
                                     "dtype": self.snapshot.geometry.get("feature_dtype"),
                                     "projection": self.snapshot.feature_contract},
                "geometry": {"layers": self.model.config.layer_count,
                             "experts": self.model.config.expert_count,
                             "top_k": int(self.snapshot.geometry["top_k"]),
                             "offsets": [list(o) for o in self.model.config.offsets]},
                "config": config_to_dict(self.config), "seed": self.config.seed,
                "code": code_version(), "world_size": self.ctx.world_size,
                "training": outcome, "parent": self.parent}

    def run(self, gate: GateWeights | None = None) -> TrainResult:
        """Train. A predictor of the ablation (:class:`RoutePredictor`) is trained by
        the ablation's own recipe (:func:`train.predictor_train.fit_checkpoint`, with
        ``gate`` for its prior); the sidecar by the streaming loop below."""
        if isinstance(self.model, RoutePredictor):
            from hebrus_flywheel.train.predictor_train import fit_checkpoint

            fitted, records = fit_checkpoint(self, gate)
            return TrainResult(checkpoint_dir=self.out_dir, lineage=fitted, history=records)
        s, o = self.config.schedule, self.config.optim
        self._best: dict[str, Any] | None = None
        self._stale = 0
        history: list[dict[str, Any]] = []
        losses: list[float] = []
        started, stopped = time.perf_counter(), "max_steps"
        batches = iter(make_loader(self.stream(self.config.data.train_split, train=True),
                                   num_workers=self.config.data.num_workers,
                                   pin_memory=self.ctx.device.type == "cuda"))
        bar = tqdm(total=o.max_steps, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (s.progress and self.ctx.is_main))
        for step in range(o.max_steps):
            losses.append(self.step(next(batches), step))
            bar.update(1)
            if (step + 1) % s.eval_every and step + 1 < o.max_steps:
                continue
            record = self._record(step + 1, losses, started)
            losses = []
            self._consider(record, history)
            bar.set_postfix(loss=f"{record['train_loss']:.3f}",
                            val_recall=f"{record['validation']['recall']:.3f}")
            if s.patience and self._stale >= s.patience:
                stopped = "early_stopping"
                break
        bar.close()
        del batches
        lineage: dict[str, Any] = {}
        if self._best is not None:
            lineage = self._checkpoint(self._best, history, stopped)
        return TrainResult(checkpoint_dir=self.out_dir, lineage=lineage, history=history)

    def _consider(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Keep ``record``'s parameters when they beat the best validation so far."""
        s = self.config.schedule
        sign = 1.0 if s.monitor == "recall" else -1.0
        history.append(record)
        value = sign * record["validation"][s.monitor]
        best = self._best
        if best is None or value > sign * best["validation"][s.monitor] + s.min_delta:
            self._best, self._stale = record, 0
            self._best_state = {k: v.detach().cpu().clone()
                                for k, v in self.model.state_dict().items()}
            self._checkpoint(record, history, "running")
        else:
            self._stale += 1
        self._write_history(record)

    def _record(self, step: int, losses: list[float], started: float) -> dict[str, Any]:
        validation = self.validate()
        summed = ddp.all_reduce_sum(torch.tensor([sum(losses), len(losses)],
                                                 dtype=torch.float64), self.ctx)
        # None at step 0 (validated before any training step)
        mean_loss = float(summed[0]) / float(summed[1]) if float(summed[1]) else None
        record = {"step": step, "train_loss": mean_loss,
                  "lr": learning_rate(max(step - 1, 0), self.config), "validation": validation,
                  "rows_seen": step * self.config.data.batch_size * self.ctx.world_size,
                  "elapsed_s": round(time.perf_counter() - started, 3)}
        if self.ctx.is_main:
            log.info("step %d: train loss %s, validation %s", step,
                     "—" if mean_loss is None else f"{mean_loss:.4f}", json.dumps(validation))
        return record

    def _checkpoint(self, best: dict[str, Any], history: list[dict[str, Any]],
                    stopped: str) -> dict[str, Any]:
        """Write the best parameters with the lineage of the run so far (rank 0)."""
        outcome = {"best_step": best["step"], "best_validation": best["validation"],
                   "steps": history[-1]["step"], "stopped": stopped,
                   "validation_split": self.config.data.validation_split}
        lineage: dict[str, Any] = {}
        if self.ctx.is_main:
            lineage = save_checkpoint(self.out_dir, self.model.config, self._best_state,
                                      self.lineage(outcome))
        ddp.barrier(self.ctx)
        return lineage

    def _write_history(self, record: dict[str, Any]) -> None:
        if self.ctx.is_main:
            with append_file(self.out_dir / HISTORY_FILE) as handle:
                handle.write((json.dumps(record, sort_keys=True) + "\n").encode("utf-8"))


def _resume(trainer: Trainer, resume: Path) -> None:
    """Start from the parameters of the checkpoint ``resume`` (refused when tainted)."""
    refuse_tainted(resume, action="resume from")
    loaded = load_checkpoint(resume, device=trainer.ctx.device)
    try:
        trainer.model.load_state_dict(loaded.model.state_dict())
    except RuntimeError as exc:
        raise CheckpointError(f"cannot resume from {loaded.path}: its model does not fit this "
                              f"snapshot and config ({exc})") from exc
    trainer.parent = str(loaded.lineage.get("checkpoint_id"))


def train(snapshot: Path, out_dir: Path, config: TrainConfig, *,
          expected_id: str | None = None, resume: Path | None = None,
          consent: ConsentCheck | None = None, teacher_dir: Path | None = None) -> TrainResult:
    """Train on ``snapshot`` into ``out_dir`` (single process, or a torchrun rank),
    starting from the checkpoint ``resume`` if given (never from a tainted one).
    ``teacher_dir``: the snapshot's own teacher, whose routers a gate-prior predictor or
    a gate adapter leans on (refused when its artifact digest is not the snapshot's).

    Rows the seal refused for lack of consent are always skipped; with ``consent`` (the
    CLI passes the consent ledger) every owner of the train and validation splits is
    checked again now and those without a live grant are skipped too; the counts go
    into the checkpoint's lineage (``snapshot.consent``)."""
    if resume is not None:
        refuse_tainted(resume, action="resume from")
    refuse_tainted(Path(out_dir), action="write over")
    if config.threads:
        torch.set_num_threads(config.threads)
    ctx = ddp.init_distributed(config.device)
    trainer: Trainer | None = None
    try:
        opened = Snapshot(snapshot, expected_id=expected_id, verify=config.data.verify)
        if consent is not None:
            check_ledger(opened, (config.data.train_split, config.data.validation_split),
                         consent)
        out_dir = Path(out_dir)
        if ctx.is_main:
            make_dirs(out_dir)
            (out_dir / HISTORY_FILE).unlink(missing_ok=True)
        ddp.barrier(ctx)
        weights = None
        if config.model.needs_teacher:
            if teacher_dir is None:
                raise ConfigError(f"model {config.model.architecture} with gate_prior="
                                  f"{config.model.gate_prior} needs the snapshot's teacher: "
                                  "pass --teacher DIR")
            weights = load_gate(Path(teacher_dir), opened)
        trainer = Trainer(opened, out_dir, config, ctx,
                          None if weights is None else gate_arrays(weights, opened))
        if resume is not None:
            _resume(trainer, resume)
        return trainer.run(weights)
    finally:
        # The trainer outlives this call in a reference cycle (the optimizer's construction
        # leaves frames that reach it), so its model, a DDP wrapper bound to the process
        # group, would otherwise be freed whenever the collector next runs, possibly while
        # the interpreter shuts down, after the group is gone: free it while both stand.
        trainer = None
        gc.collect()
        ddp.shutdown(ctx)
