"""Gate 3 on the candidate path: Model B against training-free controls at equal budget.

Every model and control is scored on the same evaluation rows at the teacher's budgets
k..4k (:class:`train.metrics.MetricsAccumulator`), on every row (``subset: all``, the
rows a P2 prefetch would fetch for) and on accepted rows only (``subset: accepted``,
the rows whose routes are ever executed). Union growth runs over the candidate
positions of one path: the bytes a block of B candidates would fetch.

Controls (fitted on train rows only):

* ``random``; ``frequency`` (each layer's most frequent training experts);
* ``position_frequency`` (per candidate position and layer: a training-free prior that
  knows the Δposition, as Model B does);
* ``native_gate`` when the teacher's routers are given and the contract's features are
  the teacher's own representation (the caller decides);
* ``previous_position`` (the native route of position p-1 on the same path, frequency
  fill at p = 1). Optimistic: that route is known only once the teacher has run the
  unverified candidate p-1, after a P2 hint is needed.

Figure lines are those of ``predictor-figures.jsonl`` (:func:`train.figures.result_lines`)
with ``product: candidate_path`` and ``subset``; their groups are ``overall``,
``layer=<l>`` and ``position=<p>``.

Legend: N rows, E experts, K top-k.
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
from hebrus_flywheel.train.candidates.rows import CandidateRows
from hebrus_flywheel.train.candidates.train import TrainedCandidate, predict
from hebrus_flywheel.train.figures import result_lines
from hebrus_flywheel.train.metrics import TRAIN_SPLIT, MetricsAccumulator, MetricsConfig
from hebrus_flywheel.train.predictor_data import GateWeights

PRODUCT = "candidate_path"
SUBSETS = ("all", "accepted")
OPTIMISTIC_CONTROLS = ("previous_position",)
"""Controls that read information a P2 hint cannot have: never the strongest control."""


@dataclass(eq=False)
class CandidateControls:
    """The training-free controls, fitted on the training rows."""

    config: BaselineConfig
    frequency: FrequencyTable
    by_position: dict[int, FrequencyTable]
    gate: GateWeights | None = None

    @classmethod
    def fit(cls, train: CandidateRows, *, expert_count: int,
            gate: GateWeights | None = None) -> CandidateControls:
        config = BaselineConfig(layer_count=int(train.layer_N.max()) + 1,
                                expert_count=expert_count, lru_capacity=max(64, expert_count))
        frequency = FrequencyTable(config)
        frequency.fit(layer_B=train.layer_N, target_ids_BK=train.target_NK, split_B=TRAIN_SPLIT)
        by_position = {}
        for p in np.unique(train.position_N).tolist():
            at = train.position_N == p
            table = FrequencyTable(config)
            table.fit(layer_B=train.layer_N[at], target_ids_BK=train.target_NK[at],
                      split_B=TRAIN_SPLIT)
            by_position[int(p)] = table
        return cls(config=config, frequency=frequency, by_position=by_position, gate=gate)

    def scores(self, rows: CandidateRows) -> dict[str, np.ndarray]:
        """Scores ``(N, E)`` of every control on ``rows``."""
        out = {"random": RandomBaseline(self.config).scores(len(rows)),
               "frequency": frequency_scores(self.frequency, rows.layer_N)}
        counts = self.frequency.fill(rows.layer_N).copy()
        for p, table in self.by_position.items():
            at = rows.position_N == p
            counts[at] = table.fill(rows.layer_N[at])
        out["position_frequency"] = ranked_scores(counts, self.frequency.fill(rows.layer_N))
        history = HistoryBaselines(self.config, fill=self.frequency)
        out["previous_position"] = history.score_and_observe(
            thread_B=rows.path_N, ordinal_B=rows.position_N, layer_B=rows.layer_N,
            target_ids_BK=rows.target_NK)["previous_token"]
        if self.gate is not None:
            logits = self.gate.logits(rows.feature_ND, rows.layer_N)
            out["native_gate"] = ranked_scores(logits, self.frequency.fill(rows.layer_N))
        return out


class CandidateBoard:
    """Accumulators per (model, subset); per-position groups ride on a second one."""

    def __init__(self, metrics: MetricsConfig) -> None:
        self.metrics = metrics
        self.acc: dict[tuple[str, str, str], MetricsAccumulator] = {}
        self.kinds: dict[str, tuple[str, str]] = {}

    def add(self, name: str, *, kind: str, features: str, rows: CandidateRows,
            scores_NE: np.ndarray, probabilities_NE: Any = None) -> None:
        self.kinds[name] = (kind, features)
        for subset in SUBSETS:
            keep = np.ones(len(rows), bool) if subset == "all" else rows.accepted_N
            if not keep.any():
                continue
            for grouping in ("domain", "position"):
                key = (name, subset, grouping)
                if key not in self.acc:
                    self.acc[key] = MetricsAccumulator(self.metrics, method=name)
                labels = (rows.domain_N if grouping == "domain"
                          else rows.position_N.astype(str).astype(object))
                self.acc[key].update(
                    target_ids_BK=rows.target_NK[keep], layer_B=rows.layer_N[keep],
                    split_B=rows.split, scores_BE=scores_NE[keep],
                    membership_prob_BE=None if probabilities_NE is None
                    else probabilities_NE[keep], domain_B=labels[keep],
                    thread_B=rows.path_N[keep], ordinal_B=rows.position_N[keep])

    def results(self) -> dict[tuple[str, str, str], dict[str, Any]]:
        return {key: acc.result() for key, acc in self.acc.items()}

    def lines(self, *, expert_bytes: int) -> list[dict[str, Any]]:
        """Figure lines with ``product`` and ``subset``; ``position=<p>`` groups."""
        out = []
        for (name, subset, grouping), result in self.results().items():
            kind, features = self.kinds[name]
            for line in result_lines(result, kind=kind, target="same_layer",
                                     expert_bytes=expert_bytes, features=features):
                group = line["group"]
                if grouping == "position":
                    if not group.startswith("domain="):
                        continue
                    line["group"] = "position=" + group[len("domain="):]
                out.append({**line, "product": PRODUCT, "subset": subset})
        return out


def score_candidates(board: CandidateBoard, rows: CandidateRows, controls: CandidateControls,
                     trained: TrainedCandidate) -> None:
    """Add every control and Model B on one evaluation split."""
    for name, scores in controls.scores(rows).items():
        board.add(name, kind="control", features="history/router" if name != "native_gate"
                  else "router", rows=rows, scores_NE=scores)
    learned = predict(trained.model, rows)
    board.add(trained.model.config.name, kind="learned",
              features="candidate_feature+drafter_token+position", rows=rows,
              scores_NE=learned.double().numpy(),
              probabilities_NE=trained.calibration.probabilities(learned).numpy())


def recall_table(lines: list[dict[str, Any]], *, split: str, budget: int,
                 subset: str = "all") -> dict[str, float]:
    """``{model: recall@budget}`` on the overall group of one split and subset."""
    return {line["model"]: float(line["value"]) for line in lines
            if line["figure"] == "recall_at_budget" and line["group"] == "overall"
            and line["split"] == split and line["budget"] == budget
            and line.get("subset") == subset}


def strongest_fair_control(lines: list[dict[str, Any]], *, split: str, budget: int,
                           subset: str = "all") -> tuple[str | None, float | None]:
    """The control with the best recall@budget that a P2 hint could really use."""
    kinds = {line["model"]: line["kind"] for line in lines}
    table = {m: r for m, r in recall_table(lines, split=split, budget=budget,
                                           subset=subset).items()
             if kinds.get(m) == "control" and m not in OPTIMISTIC_CONTROLS}
    if not table:
        return None, None
    best = max(sorted(table), key=lambda m: table[m])
    return best, table[best]


