"""In-memory rows of a snapshot's splits and the training-free controls scored on them.

The predictor bench (:mod:`train.predictor_bench`) trains many small predictors on one
demo-sized snapshot, so every split is read once into numpy arrays. Controls are scored
for both targets: the row's own layer (``same_layer``) and the next layer of the same
token (``next_layer``, the P1 target, on rows whose layer l+1 exists).

Next-layer controls score the *target* row ``(t, l+1)``: previous_token is the route of
``(t-1, l+1)``, adjacent_layer the route of ``(t, l)`` (known only after layer l's router
ran, later than a P1 hint is needed: an optimistic control), and native_gate is the
router of layer l+1 applied to the pre-attention feature of layer l.

Legend: N rows, D feature width, L routed layers, E experts, K native top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hebrus_flywheel.train.baselines import (
    BaselineConfig,
    FrequencyTable,
    HistoryBaselines,
    RandomBaseline,
    frequency_scores,
    ranked_scores,
)
from hebrus_flywheel.train.data import Snapshot, SnapshotDataset, StreamConfig
from hebrus_flywheel.train.exceptions import SnapshotError
from hebrus_flywheel.train.metrics import TRAIN_SPLIT
from hebrus_flywheel.train.predictors import gate_logits


@dataclass(eq=False)
class Rows:
    """Every (token, layer) row of one split, in snapshot order."""

    split: str
    feature_ND: np.ndarray
    layer_N: np.ndarray
    ordinal_N: np.ndarray
    target_NK: np.ndarray
    next_NK: np.ndarray
    next_valid_N: np.ndarray
    domain_N: np.ndarray
    thread_N: np.ndarray

    def __len__(self) -> int:
        return int(self.layer_N.shape[0])

    def take(self, index_N: np.ndarray) -> Rows:
        """The rows at ``index_N`` (a boolean mask or integer index)."""
        fields = {name: getattr(self, name)[index_N] for name in _ARRAYS}
        return Rows(split=self.split, **fields)

    def next_rows(self) -> tuple[Rows, np.ndarray]:
        """Source rows with a next layer, and the index of each one's target row."""
        source_M = np.flatnonzero(self.next_valid_N)
        target_M = source_M + 1
        ok = (target_M < len(self)) & (self.layer_N[np.minimum(target_M, len(self) - 1)]
                                       == self.layer_N[source_M] + 1)
        if not ok.all() or (self.thread_N[target_M] != self.thread_N[source_M]).any():
            raise SnapshotError(f"{self.split}: rows are not laid out token by token, layer "
                                "by layer; the snapshot was written by another version")
        return self.take(source_M), target_M


_ARRAYS = ("feature_ND", "layer_N", "ordinal_N", "target_NK", "next_NK", "next_valid_N",
           "domain_N", "thread_N")


def load_rows(snapshot: Snapshot, split: str, *, batch_size: int = 65536) -> Rows:
    """All rows of ``split`` (SnapshotError when it has none)."""
    if snapshot.split_rows(split) == 0:
        raise SnapshotError(f"snapshot {snapshot.snapshot_id} has no {split!r} rows")
    parts: dict[str, list[Any]] = {name: [] for name in _ARRAYS}
    stream = SnapshotDataset(snapshot, StreamConfig(
        splits=(split,), batch_size=batch_size, shuffle=False, layer_offsets=(0, 1)),
        rank=0, world_size=1)  # every row on every rank (the recipe is single-process)
    for batch in stream:
        parts["feature_ND"].append(batch["feature_BD"].float().numpy())
        parts["layer_N"].append(batch["layer_B"].numpy())
        parts["ordinal_N"].append(batch["ordinal_B"].numpy())
        parts["target_NK"].append(batch["offset_target_ids_BOK"][:, 0].numpy())
        parts["next_NK"].append(batch["offset_target_ids_BOK"][:, 1].numpy())
        parts["next_valid_N"].append(batch["offset_valid_BO"][:, 1].numpy())
        parts["domain_N"].append(np.asarray(batch["domain"], dtype=object))
        parts["thread_N"].append(np.asarray(batch["thread"], dtype=object))
    return Rows(split=split, **{k: np.concatenate(v) for k, v in parts.items()})


@dataclass(frozen=True, eq=False)
class GateWeights:
    """The teacher's routers ``(L, E, H)``, RMSNorm gains, the feature lift and the
    routers' logit biases ``(L, E)`` (None where their linears have none)."""

    router_LEH: np.ndarray
    norm_gain_LH: np.ndarray | None
    lift_DH: np.ndarray | None
    bias_LE: np.ndarray | None = None

    def logits(self, feature_ND: np.ndarray, layer_N: np.ndarray) -> np.ndarray:
        return gate_logits(feature_ND, layer_N, router_LEH=self.router_LEH,
                           lift_DH=self.lift_DH, norm_gain_LH=self.norm_gain_LH,
                           bias_LE=self.bias_LE)


class Controls:
    """Every training-free control on one evaluation split, for both targets."""

    def __init__(self, config: BaselineConfig, frequency: FrequencyTable,
                 gate: GateWeights | None) -> None:
        self.config, self.frequency, self.gate = config, frequency, gate

    def same_layer(self, rows: Rows) -> dict[str, np.ndarray]:
        """Scores ``(N, E)`` per control for the rows' own layers."""
        history = HistoryBaselines(self.config, fill=self.frequency)
        scores = history.score_and_observe(thread_B=rows.thread_N, ordinal_B=rows.ordinal_N,
                                           layer_B=rows.layer_N, target_ids_BK=rows.target_NK)
        scores["random"] = RandomBaseline(self.config).scores(len(rows))
        scores["frequency"] = frequency_scores(self.frequency, rows.layer_N)
        if self.gate is not None:
            logits = self.gate.logits(rows.feature_ND, rows.layer_N)
            scores["native_gate"] = ranked_scores(logits, self.frequency.fill(rows.layer_N))
        return scores

    def next_layer(self, rows: Rows, same: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Scores of the next-layer target for ``rows.next_rows()`` sources."""
        source, target_M = rows.next_rows()
        scores = {f"p1_{m}": same[m][target_M] for m in ("previous_token", "adjacent_layer",
                                                          "lru", "frequency")}
        scores["p1_random"] = RandomBaseline(self.config).scores(len(source))
        if self.gate is not None:
            logits = self.gate.logits(source.feature_ND, source.layer_N + 1)
            scores["p1_native_gate"] = ranked_scores(
                logits, self.frequency.fill(source.layer_N + 1))
        return scores


def fit_frequency_rows(train: Rows, config: BaselineConfig) -> FrequencyTable:
    """The frequency control fitted on train rows only."""
    table = FrequencyTable(config)
    table.fit(layer_B=train.layer_N, target_ids_BK=train.target_NK, split_B=TRAIN_SPLIT)
    return table


def load_gate(teacher_dir: Any, snapshot: Snapshot) -> GateWeights:
    """The snapshot's own teacher's routers and the lift of its feature contract."""
    from hebrus_flywheel.replay.features import check_contract
    from hebrus_flywheel.train.evaluate import teacher_router

    router = teacher_router(teacher_dir, snapshot)
    contract = snapshot.feature_contract
    lift = None
    if contract is not None:
        lift = np.linalg.pinv(check_contract(contract).matrix_HD.astype(np.float64))
    return GateWeights(router_LEH=router.router_LEH.astype(np.float64),
                       norm_gain_LH=router.norm_gain_LH, lift_DH=lift, bias_LE=router.bias_LE)
