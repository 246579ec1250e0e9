"""Gate 3: offline predictor value, every method at equal candidate count and equal byte
budget (``budget * expert_bytes`` per token and layer), on evaluation splits only."""

from __future__ import annotations

from typing import Any

from hebrus_flywheel.train.metrics import EVALUATION_SPLITS
from hebrus_flywheel.train.qualify.config import OfflineGateConfig
from hebrus_flywheel.train.qualify.fmt import fmt_bytes
from hebrus_flywheel.train.qualify.gates_figures import figures_checks
from hebrus_flywheel.train.qualify.inputs import QualificationInputs
from hebrus_flywheel.train.qualify.model_evidence import OfflineEvidence
from hebrus_flywheel.train.qualify.verdict import (
    Check,
    GateVerdict,
    gate_verdict,
    judged,
    unmeasured,
)

GATE3_NAME = "offline predictor value"


def strongest_control(offline: OfflineEvidence, split: str,
                      budget: int) -> tuple[str | None, float | None]:
    """The training-free control with the highest recall@budget on ``split``."""
    scored = [(offline.recall(m, split, budget), m) for m in offline.controls]
    present = [(r, m) for r, m in scored if r is not None]
    if not present:
        return None, None
    recall, method = max(present, key=lambda rm: (rm[0], -offline.controls.index(rm[1])))
    return method, recall


def _split_check(offline: OfflineEvidence, split: str, budget: int, margin: float,
                 byte_budget: int, required: tuple[str, ...]) -> Check:
    name, cand = f"beats_controls_{split}", offline.candidate
    at = f"{budget} experts = {fmt_bytes(byte_budget)} per token-layer"
    threshold = f"recall@{budget} >= strongest control + {margin:.3f} (OfflineGateConfig.margin)"
    mine = offline.recall(cand, split, budget)
    if mine is None:
        return unmeasured(name, f"{cand} has no recall@{budget} on {split}; evaluate the "
                          "checkpoint on that split", threshold=threshold)
    absent = [m for m in required if offline.recall(m, split, budget) is None]
    if absent:
        return unmeasured(name, f"{split}: required control(s) {', '.join(absent)} were not "
                          "evaluated; compare every control on the same rows",
                          threshold=threshold)
    rows = {m: offline.rows(m, split) for m in offline.methods
            if offline.summary(m, split) is not None}
    if len(set(rows.values())) > 1:
        return unmeasured(name, f"{split}: methods were evaluated on different row counts "
                          f"{rows}; the comparison is not at equal inputs", threshold=threshold)
    best, best_recall = strongest_control(offline, split, budget)
    if best is None or best_recall is None:
        return unmeasured(name, f"{split}: no training-free control was evaluated",
                          threshold=threshold)
    delta = mine - best_recall
    return judged(name, delta >= margin,
                  figure=f"{split}: {cand} recall@{budget} {mine:.3f} vs strongest control "
                  f"{best} {best_recall:.3f} ({delta:+.3f}) at {at}", threshold=threshold,
                  reason=f"leads by {delta:+.3f}" if delta >= margin else
                  f"leads by only {delta:+.3f}, less than the margin {margin:.3f}")


def _ece_check(offline: OfflineEvidence, split: str, bound: float) -> Check:
    node = offline.summary(offline.candidate, split)
    calibration = None if node is None else node.get("calibration")
    threshold = f"ECE <= {bound:.3f} (OfflineGateConfig.max_ece)"
    if calibration is None:
        return unmeasured(f"calibration_{split}", f"{offline.candidate} reported no "
                          f"calibration on {split} (give membership probabilities)",
                          threshold=threshold)
    ece = float(calibration["ece"])
    return judged(f"calibration_{split}", ece <= bound,
                  figure=f"{split}: {offline.candidate} ECE {ece:.3f}", threshold=threshold,
                  reason="" if ece <= bound else "probabilities are miscalibrated")


def _method_row(offline: OfflineEvidence, method: str, split: str,
                budget: int) -> dict[str, Any] | None:
    node = offline.summary(method, split)
    if node is None:
        return None
    union = node.get("union_growth") or {}
    target = union.get("target") or []
    predicted = (union.get("predicted") or {}).get(str(budget)) or []
    calibration = node.get("calibration")
    return {
        "rows": node.get("rows"), "exact_match": node.get("exact_match"),
        "recall": {b: node["recall"].get(str(b)) for b in offline.common_budgets},
        "precision": {b: node["precision"].get(str(b)) for b in offline.common_budgets},
        "rr_first": node.get("rr_first"), "rr_top1": node.get("rr_top1"),
        "ece": None if calibration is None else calibration.get("ece"),
        "union_window": len(target) or None,
        "union_target": target[-1] if target else None,
        "union_predicted": predicted[-1] if predicted else None,
    }


def _stability(offline: OfflineEvidence, split: str, budget: int, dim: str) -> dict[str, Any]:
    """Per layer/domain: the candidate and the split's strongest control, and the delta."""
    best, _ = strongest_control(offline, split, budget)
    node = offline.result(offline.candidate)["splits"].get(split) or {}
    labels = list(node.get(dim, {}))
    out: dict[str, Any] = {"control": best, "groups": {}, "lost": 0}
    for label in labels:
        mine = offline.recall(offline.candidate, split, budget, dim, label)
        theirs = None if best is None else offline.recall(best, split, budget, dim, label)
        delta = None if mine is None or theirs is None else mine - theirs
        out["groups"][label] = {"candidate": mine, "control": theirs, "delta": delta}
        out["lost"] += int(delta is not None and delta < 0)
    return out


def _gate3_figures(offline: OfflineEvidence, budget: int, expert_bytes: int) -> dict[str, Any]:
    splits = [s for s in EVALUATION_SPLITS if any(
        offline.summary(m, s) is not None for m in offline.methods)]
    return {
        "candidate": offline.candidate, "controls": list(offline.controls),
        "learned": list(offline.learned), "features": dict(offline.features),
        "budget": budget, "byte_budget": budget * expert_bytes, "expert_bytes": expert_bytes,
        "budgets": [{"candidates": b, "bytes": b * expert_bytes}
                    for b in offline.common_budgets],
        "splits": splits,
        "strongest_control": {s: dict(zip(("method", "recall"),
                                           strongest_control(offline, s, budget), strict=True))
                              for s in splits},
        "methods": {s: {m: _method_row(offline, m, s, budget) for m in offline.methods}
                    for s in splits},
        "by_layer": {s: _stability(offline, s, budget, "by_layer") for s in splits},
        "by_domain": {s: _stability(offline, s, budget, "by_domain") for s in splits},
    }


def gate3_offline(inputs: QualificationInputs, config: OfflineGateConfig) -> GateVerdict:
    """Gate 3: the candidate must beat the strongest training-free control by
    ``config.margin`` recall@budget on every decision split, all at the same budget."""
    offline = inputs.offline
    if offline is None:
        return gate_verdict(3, GATE3_NAME, [unmeasured(
            "offline", "no offline metrics: the learned predictor was not compared with any "
            "control; run the evaluator on the checkpoint and the snapshot's evaluation splits",
            threshold=f"recall@budget >= strongest control + {config.margin:.3f}")], {})
    budget = config.budget or inputs.geometry.top_k
    if budget not in offline.common_budgets:
        return gate_verdict(3, GATE3_NAME, [unmeasured(
            "budget", f"budget {budget} is not among the budgets every method was measured "
            f"at {list(offline.common_budgets)}; add it to MetricsConfig.budgets",
            threshold=f"budget among the measured ones {list(offline.common_budgets)}")],
            {"budget": budget, "budgets": list(offline.common_budgets)})
    byte_budget = budget * inputs.expert_bytes
    checks = [_split_check(offline, split, budget, config.margin, byte_budget,
                           config.required_controls) for split in config.decision_splits]
    if config.max_ece is not None:
        checks += [_ece_check(offline, split, config.max_ece) for split in config.decision_splits]
    figures = _gate3_figures(offline, budget, inputs.expert_bytes)
    if inputs.predictor_figures is not None:
        extra, figures["predictor_figures"] = figures_checks(
            inputs.predictor_figures, splits=_figure_splits(config), top_k=budget,
            margin=config.margin, max_ece=config.max_ece)
        checks += extra
    checks += _candidate_checks(inputs.candidates, config)
    return gate_verdict(3, GATE3_NAME, checks, figures)


def _candidate_checks(candidates: Any, config: OfflineGateConfig) -> list[Check]:
    """Model B (the route sidecar on candidate positions) against the strongest fair
    control at the teacher's k, on the accepted candidate rows of each decision split and
    the runtime holdout. No candidate snapshot: one unrequired, unmeasured check."""
    threshold = f"recall@k on accepted candidate rows >= strongest control + {config.margin:.3f}"
    if candidates is None:
        return [unmeasured("candidate_sidecar", "no candidate-path snapshot was given: Model B "
                           "was not trained (`flywheel replay candidates`, then qualify "
                           "--candidate-snapshot)", threshold=threshold, required=False)]
    checks = []
    for split in _figure_splits(config):
        node = candidates.summary.get(f"{split}/accepted") or {}
        recall, control = node.get("recall"), node.get("control_recall")
        name = f"candidate_sidecar_{split}"
        if recall is None or control is None:
            checks.append(unmeasured(name, f"no {split} candidate rows (or no fair control) "
                                     "to score Model B on", threshold=threshold))
            continue
        lead = float(recall) - float(control)
        checks.append(judged(name, lead >= config.margin, threshold=threshold,
                             figure=f"{split}: {candidates.model} recall@{candidates.top_k} "
                             f"{float(recall):.3f} vs {node.get('control')} "
                             f"{float(control):.3f} ({lead:+.3f}) on accepted candidate rows",
                             reason="" if lead >= config.margin else
                             f"leads by only {lead:+.3f}"))
    return checks


def _figure_splits(config: OfflineGateConfig) -> tuple[str, ...]:
    """The decision splits and, as issue 17 asks, the runtime holdout."""
    return tuple(dict.fromkeys((*config.decision_splits, "runtime_holdout")))
