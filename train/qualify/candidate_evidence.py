"""Candidate-path evidence (Model B, Model C and the replay's cost) for Gate 3's
candidate row, falsifiers #3 and #6 and the governor plot.

:func:`candidate_evidence` builds it from the rows of a ``candidate_path`` snapshot (a
pyarrow Table): it trains and scores Model B (:func:`train.candidates.bench.run_model_b`)
and calibrates the governor (:func:`train.governor.governor_report`) on the trace
summaries, with Model B's top-k predictions as the predicted route union.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hebrus_flywheel.train.qualify import checks as v
from hebrus_flywheel.train.qualify.errors import InputError


@dataclass(frozen=True, kw_only=True)
class CandidateEvidence:
    """What the candidate-path product measured."""

    model: str
    """Model B's method name."""
    top_k: int
    """The teacher's native top-k (the decision budget)."""
    acceptance: dict[str, float]
    """Measured acceptance by candidate position on train (``w_accept``); its position-1
    value is the drafter's next-token accuracy."""
    summary: dict[str, dict[str, Any]]
    """``"<split>/<subset>"`` -> Model B's and the strongest fair control's recall@k."""
    governor: dict[str, Any] | None = None
    """:func:`train.governor.governor_report` (None: not calibrated)."""
    accepted_tokens: int | None = None
    """Accepted candidate positions the replay produced (every split)."""
    replay_cost_s_per_accepted_token: float | None = None
    """Measured candidate-path replay device seconds per accepted token (bench)."""
    source: str = ""
    """Where the rows came from (the candidate snapshot's id or path)."""
    p2_shadow: dict[str, Any] | None = None
    """Shadow I/O of Model B's top-k as P2 hints on the committed candidate paths of one
    split (``split`` and the simulator's metrics against no prediction); None: not run."""
    parity: dict[str, Any] | None = None
    """The candidate snapshot's parity against step-by-step decode (its manifest's
    ``parity``: ``candidate_ids_exact``, ``candidate_rank_exact``,
    ``accepted_prefix_digest_parity``, ``pairs``, ``paths``, ``authoritative``)."""
    notes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        v.text("candidates.model", self.model)
        v.count("candidates.top_k", self.top_k, positive=True)
        v.mapping("candidates.acceptance", self.acceptance)
        v.mapping("candidates.summary", self.summary)
        for key, value in self.acceptance.items():
            v.number(f"candidates.acceptance[{key}]", value, low=0.0, high=1.0)
        for key, node in self.summary.items():
            if not isinstance(node, dict) or "recall" not in node or "control_recall" not in node:
                raise InputError(f"candidates.summary[{key}] must hold recall and "
                                 "control_recall")
        v.count("candidates.accepted_tokens", self.accepted_tokens, optional=True)
        v.number("candidates.replay_cost_s_per_accepted_token",
                 self.replay_cost_s_per_accepted_token, optional=True)
        if self.parity is not None:
            v.mapping("candidates.parity", self.parity)
        if self.p2_shadow is not None:
            v.mapping("candidates.p2_shadow", self.p2_shadow)

    @property
    def token_accuracy(self) -> float | None:
        """The drafter's next-token accuracy: acceptance at candidate position 1."""
        value = self.acceptance.get("1")
        return None if value is None else float(value)


P2_SHADOW_SPLITS = ("runtime_holdout", "validation")
"""Where Model B's P2 hints are simulated: the first of these the snapshot holds."""


def candidate_evidence(table: Any, *, expert_count: int, expert_bytes: int = 1,
                       train_config: Any = None, governor_config: Any = None,
                       replay_cost_s_per_accepted_token: float | None = None,
                       source: str = "", parity: dict[str, Any] | None = None,
                       sim_config: Any = None, gate: Any = None,
                       ) -> tuple[CandidateEvidence, dict[str, Any]]:
    """Model B and Model C on a candidate-path table; returns the evidence and Model B's
    full report (its ``lines`` are ``candidate-figures.jsonl``). With ``gate`` (the
    teacher's routers, :func:`train.predictor_data.load_gate`) the native gate on the
    candidate positions' features is one of the controls Model B must beat."""
    from hebrus_flywheel.train.candidates.bench import run_model_b
    from hebrus_flywheel.train.candidates.rows import load_candidate_rows
    from hebrus_flywheel.train.candidates.train import predict
    from hebrus_flywheel.train.governor import governor_report, summarize_paths

    trained, report = run_model_b(table, expert_count=expert_count, expert_bytes=expert_bytes,
                                  config=train_config, gate=gate)
    top_k = int(report["top_k"])
    summaries, p2_shadow = {}, None
    splits = sorted(set(table.column("split").to_pylist()))
    shadow_split = next((s for s in P2_SHADOW_SPLITS if s in splits), None)
    for split in splits:
        rows = load_candidate_rows(table, split)
        predicted = predict(trained.model, rows).topk(top_k, dim=1).indices.numpy()
        summaries[split] = summarize_paths(rows, expert_count=expert_count,
                                           predicted_NC=predicted)
        if split == shadow_split and sim_config is not None:
            from hebrus_flywheel.train.sim.candidates import model_b_shadow

            p2_shadow = {"split": split, "budget": top_k, "metrics": model_b_shadow(
                rows, predicted, expert_count=expert_count, config=sim_config)}
    accepted = int(sum(table.column("accepted").to_pylist()))
    evidence = CandidateEvidence(
        model=report["model"], top_k=top_k, acceptance=report["acceptance"],
        summary=report["summary"], governor=governor_report(summaries, governor_config),
        accepted_tokens=accepted, source=source, parity=parity, p2_shadow=p2_shadow,
        replay_cost_s_per_accepted_token=replay_cost_s_per_accepted_token)
    return evidence, report
