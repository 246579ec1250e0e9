"""Evidence about the predictor, built from a checkpoint and a sealed snapshot.

* offline (Gate 3): :func:`train.evaluate.evaluate` unchanged; its ``offline`` node;
* shadow I/O (Gate 5): the ``runtime_holdout`` split as a decode trace, the
  checkpoint's own scores on the same rows as timed P1 predictions, the simulator;
* decode (Gate 4): the candidate's recalls from the offline node plus the simulator's
  timely recall of the same predictions.

**The trace.** Rows are the runtime_holdout anchor tokens. Each thread generation
(``owner/thread#generation``) is one sequence, its anchors in token-ordinal order;
threads run one after another, in the order they first appear in the sealed shards
(partition, then offset), one token per forward step: a single-stream runtime whose
expert cache carries over from one thread to the next. Tokens between anchors (prompts,
tool output) are prefill, not decode, and are not in the trace.

**The predictions.** The feature of layer ``l`` exists at the start of layer ``l``
(boundary ``l``): the own-layer head's ranked candidates for layer ``l`` are ready at
boundary ``l``; a next-layer head (P1 checkpoints) gives candidates for layer ``l+1``
ready at boundary ``l``. Both are priority 1. A candidate budget ``b`` keeps the top
``b`` of each list, so with two heads a layer may be offered up to ``2b`` distinct
experts (the byte figures count every read).

torch is imported only inside the functions that run the model or the evaluator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hebrus_flywheel.core.geometry import teacher_budgets
from hebrus_flywheel.core.snapshot import read_parquet
from hebrus_flywheel.train.qualify.collect_data import HOLDOUT_SPLIT, SnapshotInfo
from hebrus_flywheel.train.qualify.data_evidence import ParityEvidence
from hebrus_flywheel.train.qualify.errors import InputError
from hebrus_flywheel.train.qualify.model_evidence import OfflineEvidence, ShadowEvidence
from hebrus_flywheel.train.sim import (
    DecodeTrace,
    PredictionSet,
    SimConfig,
    break_even,
    oracle_predictions,
    previous_token_predictions,
    shadow_io,
    sweep,
)

SWEEP_BANDWIDTHS: tuple[float, ...] = (1.5e9, 3e9, 6e9, 12e9)
"""SSD bandwidths (bytes/s) of the shadow sweep."""
_HOLDOUT_COLUMNS = ("owner", "thread", "generation", "token_ordinal", "features", "expert_ids")


def parity_is_exact(parity: ParityEvidence | None) -> bool:
    """Replayed runtime_holdout labels equal the captured decode routes: the parity run
    compared routes, found no id/rank mismatch, and was authoritative (or overridden)."""
    return (parity is not None and parity.compared > 0 and parity.mismatches == 0
            and (parity.authoritative or parity.override_reason is not None))


def holdout_label_note(info: SnapshotInfo, parity: ParityEvidence | None) -> str:
    """What the runtime_holdout labels are, for the report."""
    labels = info.split_rows(HOLDOUT_SPLIT) * int((info.manifest.get("geometry") or {})
                                                 .get("layers", 0))
    covered = "" if parity is None or not labels else (
        f" The parity run compared {parity.compared} of the {labels} runtime_holdout "
        f"(token, layer) labels ({parity.compared / labels:.1%}).")
    if parity_is_exact(parity):
        return ("runtime_holdout labels in the shards are the REPLAYED labels; they equal the "
                "captured decode routes only because replay/decode parity was exact "
                "(0 id/rank mismatches)." + covered)
    return ("runtime_holdout labels in the shards are the REPLAYED labels and replay/decode "
            "parity was not shown exact, so they are treated as regenerated: real-decode "
            "recall is not evidence about decode." + covered)



@dataclass(frozen=True, eq=False)
class HoldoutRows:
    """runtime_holdout anchor tokens in decode order (see the module doc)."""

    features_NLD: np.ndarray
    """Stored sidecar features per token and routed layer."""
    routes_NLK: np.ndarray
    """Native top-k ids per token and layer, rank 0 first."""
    sequence_N: np.ndarray
    """Sequence (thread generation) index of each token."""
    ordinal_N: np.ndarray
    """Token ordinal of each token in its thread."""
    threads: tuple[str, ...]
    """``owner/thread#generation`` of each sequence index."""

    @property
    def tokens(self) -> int:
        return int(self.routes_NLK.shape[0])


def _fixed(table: pa.Table, name: str) -> np.ndarray:
    """A nested fixed-size-list column as one numpy array ``(rows, ...)``."""
    values: Any = table.column(name).combine_chunks()
    shape = [table.num_rows]
    while pa.types.is_fixed_size_list(values.type):
        shape.append(values.type.list_size)
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False).reshape(shape)


def _holdout_table(info: SnapshotInfo) -> pa.Table | None:
    tables = []
    for entry in info.manifest.get("shards") or []:
        if entry.get("split") != HOLDOUT_SPLIT:
            continue
        path = info.directory / entry["path"]
        try:
            tables.append(read_parquet(path, _HOLDOUT_COLUMNS))
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"cannot read {path}: {exc}; verify the snapshot") from exc
    return pa.concat_tables(tables) if tables else None


def read_holdout(info: SnapshotInfo) -> HoldoutRows | None:
    """The snapshot's runtime_holdout tokens in decode order; None when it has none."""
    table = _holdout_table(info)
    if table is None or table.num_rows == 0:
        return None
    keys = [f"{o}/{t}#{g}" for o, t, g in zip(table.column("owner").to_pylist(),
                                              table.column("thread").to_pylist(),
                                              table.column("generation").to_pylist(),
                                              strict=True)]
    order_of: dict[str, int] = {}
    for key in keys:  # first appearance in manifest (partition, offset) order
        order_of.setdefault(key, len(order_of))
    sequence = np.array([order_of[k] for k in keys], dtype=np.int64)
    ordinal = table.column("token_ordinal").to_numpy().astype(np.int64)
    order = np.lexsort((ordinal, sequence))
    sequence, ordinal = sequence[order], ordinal[order]
    repeated = (np.diff(sequence) == 0) & (np.diff(ordinal) == 0)
    if repeated.any():
        i = int(np.flatnonzero(repeated)[0])
        raise InputError(f"runtime_holdout holds token ordinal {ordinal[i]} of thread "
                         f"{list(order_of)[sequence[i]]} twice; the snapshot is inconsistent")
    return HoldoutRows(features_NLD=_fixed(table, "features")[order],
                       routes_NLK=_fixed(table, "expert_ids").astype(np.int64)[order],
                       sequence_N=sequence, ordinal_N=ordinal, threads=tuple(order_of))


def decode_trace(rows: HoldoutRows, experts: int, skip_expert: int | None = None
                 ) -> DecodeTrace:
    """One row per runtime_holdout token, one sequence per thread generation."""
    return DecodeTrace(routes=rows.routes_NLK, num_experts=experts, sequence=rows.sequence_N,
                       skip_expert=skip_expert)


def _entries(ranked_NLC: np.ndarray, target_offset: int) -> dict[str, np.ndarray]:
    """Prediction columns of one head: the feature of layer ``l`` (boundary ``l``)
    predicts layer ``l + target_offset``."""
    n, layers, c = ranked_NLC.shape
    row = np.repeat(np.arange(n), layers * c)
    source = np.tile(np.repeat(np.arange(layers), c), n)
    return {"target_row": row, "target_layer": source + target_offset,
            "expert": ranked_NLC.reshape(-1), "rank": np.tile(np.arange(c), n * layers),
            "priority": np.ones(row.shape, np.int64), "ready_row": row,
            "ready_boundary": source}


def ranked_predictions(own_NLC: np.ndarray, next_NLC: np.ndarray | None = None
                       ) -> PredictionSet:
    """P1 predictions from ranked candidates: ``own_NLC[n, l]`` for layer ``l`` ready at
    boundary ``l``; ``next_NLC[n, l]`` (when given) for layer ``l+1`` ready at ``l``."""
    own = np.asarray(own_NLC, dtype=np.int64)
    if own.ndim != 3:
        raise InputError(f"own-layer candidates must be (tokens, layers, C), got {own.shape}")
    parts = [_entries(own, 0)]
    if next_NLC is not None and own.shape[1] > 1:
        parts.append(_entries(np.asarray(next_NLC, dtype=np.int64)[:, :-1], 1))
    return PredictionSet(**{k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


def sidecar_ranked(checkpoint: Any, rows: HoldoutRows, candidates: int,
                   batch_size: int = 8192) -> tuple[np.ndarray, np.ndarray | None]:
    """The checkpoint's top-``candidates`` experts per (token, layer): own-layer head and,
    when the model has one, its next-layer head (rows of the last layer are unused)."""
    import torch

    model = checkpoint.model
    offsets = model.config.offsets
    n, layers = rows.routes_NLK.shape[:2]
    features = torch.from_numpy(np.ascontiguousarray(rows.features_NLD.reshape(n * layers, -1)))
    layer_B = torch.arange(layers, dtype=torch.long).repeat(n)
    heads = [offsets.index((0, 0))] + ([offsets.index((0, 1))] if (0, 1) in offsets else [])
    out = [np.empty((n * layers, candidates), np.int64) for _ in heads]
    with torch.no_grad():
        for start in range(0, n * layers, batch_size):
            part = slice(start, start + batch_size)
            scores_BOE = model(features[part].float(), layer_B[part])
            for slot, head in enumerate(heads):
                order = torch.argsort(scores_BOE[:, head], dim=-1, descending=True, stable=True)
                out[slot][part] = order[:, :candidates].numpy()
    shaped = [o.reshape(n, layers, candidates) for o in out]
    return shaped[0], shaped[1] if len(shaped) > 1 else None


def native_gate_ranked(snapshot: Path, teacher: Path, rows: HoldoutRows,
                       candidates: int) -> np.ndarray:
    """The native-gate control's top-``candidates`` experts per (token, layer) on the same
    holdout rows (the teacher's router of layer l on the lifted feature of layer l)."""
    import torch

    from hebrus_flywheel.train.data import Snapshot
    from hebrus_flywheel.train.evaluate import NativeGate, teacher_router

    opened = Snapshot(snapshot)
    gate = NativeGate(teacher_router(teacher, opened), opened, None)
    n, layers = rows.routes_NLK.shape[:2]
    features = torch.from_numpy(np.ascontiguousarray(rows.features_NLD.reshape(n * layers, -1)))
    scores_BE = gate.scores(features, torch.arange(layers, dtype=torch.long).repeat(n))
    order = np.argsort(-scores_BE, axis=1, kind="stable")[:, :candidates]
    return order.reshape(n, layers, candidates)


def sweep_budgets(top_k: int, experts: int, extra: Sequence[int] | None = None
                  ) -> tuple[int, ...]:
    """The native top-k and the extra budgets (None: the teacher's k, 2k, 3k, 4k),
    clipped to the expert count, in order."""
    extra = teacher_budgets(top_k) if extra is None else extra
    return tuple(sorted({min(b, experts) for b in (top_k, *extra)}))


def shadow_evidence(trace: DecodeTrace, predictions: PredictionSet, config: SimConfig, *,
                    budget: int, budgets: Sequence[int], bandwidths: Sequence[float],
                    tau: Mapping[int, float] | None, oracle_lead: int,
                    notes: Mapping[str, str],
                    controls: Mapping[str, PredictionSet] | None = None) -> ShadowEvidence:
    """Shadow runs of ``predictions`` at ``budget``, the bandwidth x budget sweep, a
    perfect predictor with ``oracle_lead`` boundaries of lead, the previous-token
    control, every other control of ``controls`` at the same budget (e.g. the native
    gate) and the break-even rows (only when ``tau`` is declared)."""
    extra = {name: shadow_io(trace, p.within_budget(budget), config)
             for name, p in (controls or {}).items()}
    return ShadowEvidence(
        metrics=shadow_io(trace, predictions.within_budget(budget), config), budget=budget,
        sim_config={**config.to_dict(), "expert_bytes": config.expert_bytes,
                    **notes},
        sweep=tuple(sweep(trace, predictions, config, bandwidths=tuple(bandwidths),
                          budgets=tuple(budgets))),
        break_even=tuple(break_even(trace, tau)) if tau else (),
        oracle=shadow_io(trace, oracle_predictions(trace, lead_boundaries=oracle_lead), config),
        controls={"previous_token": shadow_io(trace, previous_token_predictions(trace),
                                              config), **extra})


def evaluation_budgets(top_k: int) -> tuple[int, ...]:
    """The budgets every method is scored at: the teacher's k, 2k, 3k and 4k."""
    return teacher_budgets(top_k)


def offline_evidence(snapshot: Path, checkpoint: Path, *, teacher: Path | None, top_k: int,
                     progress: bool) -> tuple[OfflineEvidence, dict[str, Any]]:
    """:func:`train.evaluate.evaluate` on every evaluation split; its ``offline`` node
    and the full report (skipped controls, frequency fit, ...)."""
    from hebrus_flywheel.train.evaluate import EvaluateConfig, evaluate

    config = EvaluateConfig(budgets=evaluation_budgets(top_k), progress=progress)
    report = evaluate(snapshot, checkpoint, config, teacher_dir=teacher)
    node = report["offline"]
    offline = OfflineEvidence(results=tuple(node["results"]), candidate=str(node["candidate"]),
                              features=dict(node.get("features") or {}))
    return offline, report
