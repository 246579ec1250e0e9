"""Model B end to end on a candidate-path table: train on ``train``, choose and
calibrate on ``validation``, score every evaluation split against the controls, and
write ``candidate-figures.jsonl`` (the figure lines of ``predictor-figures.jsonl`` with
``product: candidate_path``).

Entry point: :func:`run_model_b` (a pyarrow Table of the candidate-path product's rows,
e.g. every shard of a ``candidate_path`` snapshot concatenated).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from hebrus_flywheel.train.candidates.evaluate import (
    PRODUCT,
    CandidateBoard,
    CandidateControls,
    recall_table,
    score_candidates,
    strongest_fair_control,
)
from hebrus_flywheel.train.candidates.rows import load_candidate_rows
from hebrus_flywheel.train.candidates.train import (
    CandidateTrainConfig,
    TrainedCandidate,
    train_candidate,
)
from hebrus_flywheel.train.figures import write_figures
from hebrus_flywheel.train.metrics import EVALUATION_SPLITS, MetricsConfig
from hebrus_flywheel.train.predictor_data import GateWeights

CANDIDATE_FIGURES_FILE = "candidate-figures.jsonl"


def _splits(table: pa.Table) -> list[str]:
    present = set(table.column("split").to_pylist())
    return [s for s in EVALUATION_SPLITS if s in present]


def run_model_b(table: pa.Table, *, expert_count: int, expert_bytes: int = 1,
                config: CandidateTrainConfig | None = None, gate: GateWeights | None = None,
                ) -> tuple[TrainedCandidate, dict[str, Any]]:
    """Train and evaluate Model B; returns the model and a JSON-able report with
    ``lines`` (figure lines), ``acceptance`` (measured w_accept on train), ``summary``
    (recall@k of Model B and the strongest fair control per evaluation split)."""
    train = load_candidate_rows(table, "train")
    validation = load_candidate_rows(table, "validation")
    top_k = train.target_NK.shape[1]
    trained = train_candidate(train, validation, expert_count=expert_count, config=config)
    controls = CandidateControls.fit(train, expert_count=expert_count, gate=gate)
    board = CandidateBoard(MetricsConfig(expert_count=expert_count, top_k=top_k,
                                         union_max_window=max(train.block, 1)))
    for split in _splits(table):
        rows = validation if split == "validation" else load_candidate_rows(table, split)
        score_candidates(board, rows, controls, trained)
    lines = board.lines(expert_bytes=expert_bytes)
    name = trained.model.config.name
    summary = {}
    for split in _splits(table):
        for subset in ("all", "accepted"):
            best, theirs = strongest_fair_control(lines, split=split, budget=top_k, subset=subset)
            summary[f"{split}/{subset}"] = {
                "model": name, "budget": top_k,
                "recall": recall_table(lines, split=split, budget=top_k, subset=subset).get(name),
                "control": best, "control_recall": theirs}
    report = {"product": PRODUCT, "model": name, "top_k": top_k, "block": train.block,
              "acceptance": {str(p): a for p, a in trained.acceptance.items()},
              "best_step": trained.best_step, "train_seconds": trained.seconds,
              "calibration": {"scale": trained.calibration.scale,
                              "bias": trained.calibration.bias},
              "summary": summary, "lines": lines}
    return trained, report


def write_candidate_figures(report: dict[str, Any], out_dir: Path) -> Path:
    """``candidate-figures.jsonl`` in ``out_dir`` (checked like the clean-path file)."""
    return write_figures(Path(out_dir) / CANDIDATE_FIGURES_FILE, report["lines"])
