"""``flywheel evaluate``: every Gate 3 method × metric on a snapshot's evaluation splits.

Methods, at equal candidate count (every one ranks all E experts):
``random``; ``frequency`` (per-layer counts fitted on the snapshot's ``train`` split
only); ``lru``, ``previous_token``, ``adjacent_layer`` (each thread's committed
history); ``native_gate`` (the teacher's router of layer l applied to the pre-attention
feature, lifted to width H with the pseudo-inverse of the recorded projection) when a
teacher or router weights are given; and the learned checkpoint (its ``(0, 0)`` head).
A P1 checkpoint's next-layer head is reported separately under ``auxiliary`` (its rows
differ, so it is not compared with the controls).

Order. Evaluation rows are streamed single-process in manifest order without
shuffling: shards hold rows sorted by source offset and ordinal, and a thread's windows
sit at increasing offsets of one partition, so each thread's tokens arrive in ordinal
order, as the history controls and route-union growth require (they raise otherwise).

The JSON report's ``offline`` node is what :class:`train.qualify.OfflineEvidence`
takes: ``candidate``, ``features`` and one :meth:`MetricsAccumulator.result` per method.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write_json, make_dirs
from hebrus_flywheel.streams.consent import ConsentCheck
from hebrus_flywheel.train.baselines import (
    BaselineConfig,
    FrequencyTable,
    HistoryBaselines,
    NativeGateBaseline,
    RandomBaseline,
    frequency_scores,
)
from hebrus_flywheel.train.checkpoint import LoadedCheckpoint, load_checkpoint
from hebrus_flywheel.train.consent import check_ledger
from hebrus_flywheel.train.data import Snapshot, SnapshotDataset, StreamConfig, batch_splits
from hebrus_flywheel.train.exceptions import (
    BaselineError,
    CheckpointError,
    NoNativeGateError,
    SnapshotError,
)
from hebrus_flywheel.train.metrics import (
    EVALUATION_SPLITS,
    TRAIN_SPLIT,
    MetricsAccumulator,
    MetricsConfig,
)
from hebrus_flywheel.train.projection import ReplayThroughput, projection

log = logging.getLogger(__name__)
REPORT_SCHEMA = "flywheel.train.evaluation.v1"


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """What ``flywheel evaluate`` measures."""

    splits: tuple[str, ...] = ()
    """Evaluation splits to score; empty means every evaluation split the snapshot has."""
    batch_size: int = 8192
    """(token, layer) rows per batch."""
    budgets: tuple[int, ...] | None = None
    """Candidate budgets of recall and precision; None: the teacher's k, 2k, 3k, 4k."""
    union_max_window: int = 8
    """Largest token window of route-union growth; 0 turns it off."""
    calibration_bins: int = 10
    """Bins of the reliability table behind ECE."""
    seed: int = 0
    """Seed of the random control."""
    lru_capacity: int = 64
    """Experts remembered per (thread, layer) by the LRU control."""
    progress: bool = True
    """Show progress bars."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "splits", tuple(self.splits))
        if self.budgets is not None:
            object.__setattr__(self, "budgets", tuple(self.budgets))
        if TRAIN_SPLIT in self.splits or set(self.splits) - set(EVALUATION_SPLITS):
            raise ConfigError(f"EvaluateConfig.splits {self.splits!r}: evaluate only "
                              f"{', '.join(EVALUATION_SPLITS)}, never {TRAIN_SPLIT}")
        if self.batch_size < 1 or self.seed < 0:
            raise ConfigError("EvaluateConfig.batch_size must be >= 1 and .seed >= 0")


@dataclass(frozen=True, eq=False)
class RouterWeights:
    """The teacher's gates ``(L, E, H)``, the RMSNorm gain ``(L, H)`` before them and the
    gates' logit biases ``(L, E)`` (None where the routers' linears have none)."""

    router_LEH: np.ndarray
    norm_gain_LH: np.ndarray | None
    source: str
    bias_LE: np.ndarray | None = None


def router_weights(teacher: Any) -> RouterWeights:
    """Every routed layer's gate matrix, its logit bias (GPT-OSS) and the gain of the norm
    that feeds it (:mod:`train.router_input`: found by running the teacher, ones where the
    router reads an un-normalised stream)."""
    from hebrus_flywheel.train.router_input import router_input_gains

    adapter, layers = teacher.adapter, teacher.adapter.decoder_layers(teacher.model)
    weights, biases = [], []
    for index in teacher.geometry.routed_layers:
        try:
            gate = adapter.router(layers[index])
            weight, bias = adapter.router_weight(gate), adapter.router_logit_bias(gate)
        except AttributeError:
            weight, bias = None, None
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise NoNativeGateError(
                f"the {teacher.geometry.family} router of layer {index} is not one (E, H) "
                "weight matrix on the layer's input, so there is no native-gate control "
                "for this teacher")
        weights.append(weight.detach())
        biases.append(None if bias is None else bias.detach().float().cpu().numpy())
    routers = [w.float().cpu().numpy() for w in weights]
    gains = router_input_gains(teacher, routers[0].shape[1], weights[0].dtype)
    return RouterWeights(router_LEH=np.stack(routers), norm_gain_LH=np.stack(gains),
                         source=str(teacher.path), bias_LE=_stacked_biases(biases))


def _stacked_biases(biases: list[np.ndarray | None]) -> np.ndarray | None:
    """``(L, E)`` logit biases, None when no router has one (a family either has a bias in
    every router's linear or in none)."""
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise BaselineError("some routed layers' routers have a logit bias and some do not")
    return np.stack([b for b in biases if b is not None])


def teacher_router(teacher_dir: Path, snapshot: Snapshot) -> RouterWeights:
    """Router weights of the snapshot's own teacher (BaselineError for another one).
    Loaded once per checkpoint state: qualification asks for them for the clean and the
    candidate evaluation."""
    identity = snapshot.manifest.get("identity") or {}
    root = Path(teacher_dir).resolve()
    stamp = max((f.stat().st_mtime_ns for f in root.iterdir() if f.is_file()), default=0)
    return _router(root, stamp, str(identity.get("model_artifact_digest")))


@functools.lru_cache(maxsize=2)
def _router(root: Path, stamp: int, want_digest: str) -> RouterWeights:
    del stamp  # part of the cache key only: a rewritten checkpoint loads again
    from hebrus_flywheel.replay.teacher import load_teacher

    teacher = load_teacher(root)
    if teacher.artifact_digest != want_digest:
        raise BaselineError(
            f"teacher {root} has artifact digest {teacher.artifact_digest}, the snapshot "
            f"was replayed with {want_digest}; pass that teacher")
    return router_weights(teacher)


class NativeGate:
    """The native-gate control on the snapshot's stored features.

    The baseline lifts the stored features with the pseudo-inverse of the projection
    recorded in the snapshot's feature contract before the router sees them.
    """

    def __init__(self, router: RouterWeights, snapshot: Snapshot,
                 fill: FrequencyTable | None) -> None:
        from hebrus_flywheel.replay.features import check_contract

        H, D = router.router_LEH.shape[2], int(snapshot.geometry["feature_dim"])
        contract = snapshot.feature_contract
        reduction_HD: np.ndarray | None = None
        if contract is not None:
            try:
                reduction_HD = check_contract(contract).matrix_HD
            except ConfigError as exc:
                raise SnapshotError(f"snapshot {snapshot.snapshot_id}: {exc}") from exc
            if reduction_HD.shape != (H, D):
                raise BaselineError(f"the feature projection is {reduction_HD.shape}, the "
                                    f"router needs ({H}, {D}); the teacher is not the snapshot's")
        elif D != H:
            raise BaselineError("the snapshot records no feature contract and its features are "
                                f"reduced ({D} != {H}); the native gate cannot lift them")
        self.baseline = NativeGateBaseline(router.router_LEH, fill=fill,
                                           reduction_HD=reduction_HD,
                                           norm_weight_LH=router.norm_gain_LH,
                                           bias_LE=router.bias_LE)

    def scores(self, feature_BD: torch.Tensor, layer_B: torch.Tensor) -> np.ndarray:
        """Router scores ``(B, E)`` of the lifted features."""
        return self.baseline.scores(feature_BD.double().numpy(), layer_B)


def check_compatible(checkpoint: LoadedCheckpoint, snapshot: Snapshot) -> None:
    """CheckpointError unless the model fits the snapshot's geometry and features."""
    c, g = checkpoint.model.config, snapshot.geometry
    want = (int(g["feature_dim"]), int(g["layers"]), snapshot.expert_count)
    have = (c.feature_dim, c.layer_count, c.expert_count)
    if have != want:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} expects (D, L, E) = {have}, the snapshot has "
            f"{want}; evaluate it on a snapshot of its teacher geometry")
    trained = (checkpoint.lineage.get("feature_contract") or {}).get("projection")
    here = snapshot.feature_contract
    digests = [None if x is None else x.get("projection_digest") for x in (trained, here)]
    if digests[0] != digests[1]:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was trained on features of projection "
            f"{digests[0]}, the snapshot's are {digests[1]}; the features are not comparable")
    if (0, 0) not in c.offsets:
        raise CheckpointError(f"checkpoint {checkpoint.path} has no (0, 0) head to evaluate")


def fit_frequency(snapshot: Snapshot, config: BaselineConfig,
                  batch_size: int) -> FrequencyTable:
    """The frequency table over the snapshot's train split (empty when there is none)."""
    table = FrequencyTable(config)
    if snapshot.split_rows(TRAIN_SPLIT) == 0:
        return table
    stream = SnapshotDataset(snapshot, StreamConfig(splits=(TRAIN_SPLIT,), shuffle=False,
                                                    batch_size=batch_size, lineage=False))
    for batch in stream:
        table.fit(layer_B=batch["layer_B"], target_ids_BK=batch["target_ids_BK"],
                  split_B=batch_splits(batch).tolist())
    return table


class Evaluation:
    """Accumulates every method over the evaluation stream."""

    def __init__(self, snapshot: Snapshot, checkpoint: LoadedCheckpoint,
                 config: EvaluateConfig, router: RouterWeights | None) -> None:
        self.snapshot, self.checkpoint, self.config = snapshot, checkpoint, config
        g = snapshot.geometry
        self.baseline = BaselineConfig(layer_count=int(g["layers"]),
                                       expert_count=snapshot.expert_count, seed=config.seed,
                                       lru_capacity=config.lru_capacity)
        self.metrics = MetricsConfig(expert_count=snapshot.expert_count, top_k=int(g["top_k"]),
                                     budgets=config.budgets,
                                     union_max_window=config.union_max_window,
                                     calibration_bins=config.calibration_bins)
        self.frequency = fit_frequency(snapshot, self.baseline, config.batch_size)
        self.skipped: dict[str, str] = {}
        self.gate = None if router is None else NativeGate(router, snapshot, self._fill())
        if router is None:
            self.skipped["native_gate"] = "no teacher or router weights given (--teacher DIR)"
        if self.frequency.rows == 0:
            self.skipped["frequency"] = "the snapshot has no train rows to fit it on"
        self.random = RandomBaseline(self.baseline)
        self.history = HistoryBaselines(self.baseline, fill=self._fill())
        names = ["random", "frequency", "lru", "previous_token", "adjacent_layer",
                 "native_gate", checkpoint.method]
        self.accumulators = {m: MetricsAccumulator(self.metrics, method=m) for m in names
                             if m not in self.skipped}
        offsets = checkpoint.model.config.offsets
        self.next_head = offsets.index((0, 1)) if (0, 1) in offsets else None
        self.auxiliary = None if self.next_head is None else MetricsAccumulator(
            self.metrics, method=f"{checkpoint.method}_next_layer")

    def _fill(self) -> FrequencyTable | None:
        return self.frequency if self.frequency.rows else None

    def update(self, batch: dict[str, Any]) -> None:
        common = {"target_ids_BK": batch["target_ids_BK"], "layer_B": batch["layer_B"],
                  "split_B": batch["split"], "domain_B": batch["domain"],
                  "thread_B": batch["thread"], "ordinal_B": batch["ordinal_B"]}
        scores = self.history.score_and_observe(
            thread_B=batch["thread"], ordinal_B=batch["ordinal_B"], layer_B=batch["layer_B"],
            target_ids_BK=batch["target_ids_BK"])
        scores["random"] = self.random.scores(len(batch["split"]))
        if "frequency" in self.accumulators:
            scores["frequency"] = frequency_scores(self.frequency, batch["layer_B"])
        if self.gate is not None:
            scores["native_gate"] = self.gate.scores(batch["feature_BD"], batch["layer_B"])
        with torch.no_grad():
            model_BOE = self.checkpoint.model(batch["feature_BD"].float(), batch["layer_B"])
        own = self.checkpoint.model.config.offsets.index((0, 0))
        own_BE = model_BOE[:, own]
        for name, acc in self.accumulators.items():
            if name == self.checkpoint.method:
                acc.update(scores_BE=own_BE,
                           membership_prob_BE=self.checkpoint.probabilities(own_BE, own),
                           **common)
            else:
                acc.update(scores_BE=scores[name], **common)
        if self.next_head is not None:
            self._update_next(batch, self.next_head, model_BOE[:, self.next_head])

    def _update_next(self, batch: dict[str, Any], head: int, next_BE: torch.Tensor) -> None:
        valid_B = batch["offset_valid_BO"][:, head]
        if self.auxiliary is None or not bool(valid_B.any()):
            return
        pick = valid_B.numpy()
        self.auxiliary.update(
            target_ids_BK=batch["offset_target_ids_BOK"][:, head][valid_B],
            layer_B=batch["layer_B"][valid_B] + 1, scores_BE=next_BE[valid_B],
            membership_prob_BE=self.checkpoint.probabilities(next_BE[valid_B], head),
            split_B=np.asarray(batch["split"], dtype=object)[pick],
            domain_B=np.asarray(batch["domain"], dtype=object)[pick],
            thread_B=np.asarray(batch["thread"], dtype=object)[pick],
            ordinal_B=batch["ordinal_B"][valid_B])


def evaluation_splits(snapshot: Snapshot, config: EvaluateConfig) -> tuple[str, ...]:
    splits = config.splits or tuple(s for s in EVALUATION_SPLITS if snapshot.split_rows(s))
    empty = [s for s in splits if snapshot.split_rows(s) == 0]
    if not splits or empty:
        raise SnapshotError(f"snapshot {snapshot.snapshot_id} has no rows in "
                            f"{empty or 'any evaluation split'}; nothing to evaluate")
    return splits


def _batches(snapshot: Snapshot, splits: tuple[str, ...], config: EvaluateConfig,
             layer_offsets: tuple[int, ...]) -> Iterator[dict[str, Any]]:
    stream = SnapshotDataset(snapshot, StreamConfig(
        splits=splits, batch_size=config.batch_size, shuffle=False, layer_offsets=layer_offsets))
    total = sum(snapshot.split_rows(s) for s in splits) * int(snapshot.geometry["layers"])
    bar = tqdm(total=total, desc="evaluate", unit="row", disable=not config.progress,
               dynamic_ncols=True)
    for batch in stream:
        yield batch
        bar.update(len(batch["split"]))
    bar.close()


def evaluate(snapshot_path: Path, checkpoint_path: Path, config: EvaluateConfig, *,
             teacher_dir: Path | None = None, router: RouterWeights | None = None,
             expected_id: str | None = None,
             consent: ConsentCheck | None = None) -> dict[str, Any]:
    """The full report (see the module doc); ``router`` overrides ``teacher_dir``.
    ``consent``: re-check every owner against the consent ledger (train.consent)."""
    snapshot = Snapshot(snapshot_path, expected_id=expected_id)
    checkpoint = load_checkpoint(checkpoint_path)
    check_compatible(checkpoint, snapshot)
    splits = evaluation_splits(snapshot, config)
    if consent is not None:
        check_ledger(snapshot, sorted({*splits, TRAIN_SPLIT}), consent)
    no_gate = None
    if router is None and teacher_dir is not None:
        try:
            router = teacher_router(teacher_dir, snapshot)
        except NoNativeGateError as exc:
            no_gate = str(exc)
    run = Evaluation(snapshot, checkpoint, config, router)
    if no_gate is not None:
        run.skipped["native_gate"] = no_gate
    offsets = tuple(dl for _, dl in checkpoint.model.config.offsets)
    for batch in _batches(snapshot, splits, config, offsets):
        run.update(batch)
    trained_on = (checkpoint.lineage.get("snapshot") or {}).get("snapshot_id")
    method = checkpoint.method
    return {
        "schema": REPORT_SCHEMA,
        "snapshot": {"snapshot_id": snapshot.snapshot_id, "path": str(snapshot.directory),
                     "splits": list(splits), "consent": dict(snapshot.consent)},
        "checkpoint": {"checkpoint_id": checkpoint.lineage.get("checkpoint_id"),
                       "path": str(checkpoint.path), "method": method,
                       "trained_on_snapshot": trained_on,
                       "same_snapshot": trained_on == snapshot.snapshot_id},
        "frequency_fit": {"split": TRAIN_SPLIT, "rows": run.frequency.rows},
        "native_gate": None if router is None else {"source": router.source},
        "skipped": run.skipped,
        "offline": {"candidate": method, "features": {method: model_features(checkpoint)},
                    "results": [acc.result() for acc in run.accumulators.values()]},
        "auxiliary": [] if run.auxiliary is None else [run.auxiliary.result()],
        "collection_projection": projection(ReplayThroughput.from_manifest(snapshot.manifest)),
    }


def model_features(checkpoint: LoadedCheckpoint) -> str:
    """What the learned model reads: the stored pre-attention feature, plus the
    teacher's routers for a gate-prior predictor or a gate adapter."""
    config = checkpoint.model.config
    spec = getattr(config, "spec", None)
    return "pre_attention" if spec is None else str(spec(0).features)


def write_report(report: dict[str, Any], path: Path) -> None:
    make_dirs(path.parent)
    atomic_write_json(path, report)
