"""Verdicts on the design note's ten falsifiers ("What would falsify the whole approach?").

Each is ``falsified`` (this evidence falsifies the approach: stop or redesign),
``not_falsified`` or ``not_measurable`` (with the precise reason). Falsifiers are judged on
the same evidence as the gates, never on training rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hebrus_flywheel.train.qualify.config import HEURISTIC_METHODS, QualificationConfig
from hebrus_flywheel.train.qualify.data_evidence import drill_summary
from hebrus_flywheel.train.qualify.falsifiers_candidates import (
    falsifier3_verdict,
    falsifier6_verdict,
)
from hebrus_flywheel.train.qualify.falsifiers_io import (
    Outcome,
    f4_amplification,
    f5_late,
    f9_roofline,
    f10_loader,
    outcome,
)
from hebrus_flywheel.train.qualify.gates_offline import strongest_control
from hebrus_flywheel.train.qualify.inputs import QualificationInputs
from hebrus_flywheel.train.qualify.verdict import (
    FALSIFIED,
    NOT_FALSIFIED,
    NOT_MEASURABLE,
    FalsifierVerdict,
)

STATEMENTS: dict[int, str] = {
    1: "prefill replay and real decode do not produce exact route-label parity",
    2: "a previous-token or adjacent-layer heuristic matches the learned predictor at the "
       "same byte budget",
    3: "DFlash features predict tokens but not target routes",
    4: "useful recall requires reading so many experts that byte amplification rises",
    5: "predictions arrive too late to hide a meaningful portion of SSD wait",
    6: "candidate-path replay costs more than the expected deployment savings can justify",
    7: "real agent traffic drifts too quickly for checkpointed predictors",
    8: "privacy constraints make production transcript replay unacceptable",
    9: "the exact cold-byte roofline dominates even with perfect prediction",
    10: "two 3090s spend more time waiting for feature shards than training",
}

Judge = Callable[[QualificationInputs, QualificationConfig], Outcome]


def f1_parity(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    p = inputs.parity
    threshold = "0 mismatching routes, authoritative parity run"
    if p is None or p.compared == 0:
        return outcome(NOT_MEASURABLE, "no replay/decode route comparison was made; run "
                       "`flywheel parity`" if p is None else "the parity run compared no routes",
                       threshold=threshold)
    figure = f"{p.mismatches:,} of {p.compared:,} routes differ"
    figures = {"compared": p.compared, "mismatches": p.mismatches,
               "authoritative": p.authoritative}
    if p.mismatches:
        return outcome(FALSIFIED, f"{p.mismatches} of {p.compared} replayed routes differ "
                       "from decode in top-k ids or rank order", figures, measured=figure,
                       threshold=threshold)
    if not p.authoritative:
        return outcome(NOT_MEASURABLE, f"0 mismatches on {p.compared} routes, but the parity "
                       "run did not declare itself authoritative (see its details)", figures,
                       measured=figure + " (not authoritative)", threshold=threshold)
    return outcome(NOT_FALSIFIED, f"exact top-k id and rank parity on {p.compared} routes",
                   figures, measured=figure, threshold=threshold)


def f2_heuristic(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    off = inputs.offline
    budget = config.offline.budget or inputs.geometry.top_k
    tol = config.falsifiers.match_tolerance
    threshold = (f"best heuristic recall@{budget} < candidate - {tol:.3f} "
                 "(FalsifierConfig.match_tolerance)")
    present = [] if off is None else [m for m in HEURISTIC_METHODS if m in off.methods]
    if off is None or not present:
        return outcome(NOT_MEASURABLE, "no offline metrics; run the evaluator" if off is None
                       else "neither previous_token nor adjacent_layer was evaluated",
                       threshold=threshold)
    per_split: dict[str, dict] = {}
    matched = []
    for split in config.offline.decision_splits:
        mine = off.recall(off.candidate, split, budget)
        scored = [(r, m) for m in present if (r := off.recall(m, split, budget)) is not None]
        if mine is None or not scored:
            continue
        best_recall, best = max(scored)
        per_split[split] = {"candidate": mine, "heuristic": best, "heuristic_recall": best_recall}
        if best_recall >= mine - tol:
            matched.append(f"{split}: {best} {best_recall:.3f} vs {off.candidate} {mine:.3f}")
    figures = {"budget": budget, "byte_budget": budget * inputs.expert_bytes,
               "tolerance": tol, "splits": per_split}
    if not per_split:
        return outcome(NOT_MEASURABLE, f"no decision split has recall@{budget} for both the "
                  "candidate and a heuristic", figures, threshold=threshold)
    figure = "; ".join(f"{s}: {v['heuristic']} {v['heuristic_recall']:.3f} vs "
                       f"{off.candidate} {v['candidate']:.3f}" for s, v in per_split.items())
    if matched:
        return outcome(FALSIFIED, f"at recall@{budget} (equal byte budget) a heuristic is within "
                  f"{tol:.3f} of the learned predictor: " + "; ".join(matched), figures,
                  measured=figure, threshold=threshold)
    return outcome(NOT_FALSIFIED, f"the learned predictor leads every history heuristic by more "
              f"than {tol:.3f} recall@{budget} on {', '.join(per_split)}", figures,
              measured=figure, threshold=threshold)


def _from_verdict(result: dict[str, Any], threshold: str, measured: str = "") -> Outcome:
    return outcome(result["verdict"], result["reason"], result["figures"], measured=measured,
                   threshold=threshold)


def f3_candidates(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    """#3 on Model B (the route sidecar on candidate positions)."""
    margin = config.offline.margin
    floor = config.falsifiers.min_token_accuracy
    result = falsifier3_verdict(inputs.candidates, margin=margin, min_token_accuracy=floor)
    f = result["figures"]
    measured = "" if "route_recall" not in f else (
        f"token accuracy {f['token_accuracy']:.3f}; route recall@{f['budget']} "
        f"{f['route_recall']:.3f} vs {f['control']} {f['control_recall']:.3f}")
    return _from_verdict(result, f"candidate-position recall >= strongest fair control + "
                         f"{margin:.3f} (OfflineGateConfig.margin) while token accuracy >= "
                         f"{floor:.2f} (FalsifierConfig.min_token_accuracy)", measured)


def f3_dflash(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    if inputs.candidates is not None:
        return f3_candidates(inputs, config)
    off = inputs.offline
    dflash = [] if off is None else sorted(m for m, f in off.features.items()
                                           if "dflash" in f.lower())
    threshold = (f"DFlash-feature recall >= strongest control + {config.offline.margin:.3f} "
                 "(OfflineGateConfig.margin)")
    if off is None or not dflash:
        return outcome(NOT_MEASURABLE, "no candidate-path snapshot was given (Model B was not "
                       "trained, the drafter's token accuracy not measured) and no learned "
                       "method reads a DFlash candidate-position feature", threshold=threshold)
    budget, split = config.offline.budget or inputs.geometry.top_k, "validation"
    figures: dict = {"budget": budget, "split": split, "methods": {}}
    weak = []
    for method in dflash:
        mine = off.recall(method, split, budget)
        best, theirs = strongest_control(off, split, budget)
        figures["methods"][method] = {"recall": mine, "control": best, "control_recall": theirs}
        if mine is None or theirs is None:
            return outcome(NOT_MEASURABLE, f"{method} or the controls lack recall@{budget} "
                           f"on {split}", figures, threshold=threshold)
        if mine - theirs < config.offline.margin:
            weak.append(f"{method} {mine:.3f} vs {best} {theirs:.3f}")
    figure = "; ".join(f"{m} {v['recall']:.3f} vs {v['control']} {v['control_recall']:.3f}"
                       for m, v in figures["methods"].items())
    if weak:
        return outcome(FALSIFIED, "DFlash-feature predictors do not beat the strongest "
                       f"control by {config.offline.margin:.3f} recall@{budget}: "
                       + "; ".join(weak), figures, measured=figure, threshold=threshold)
    return outcome(NOT_FALSIFIED, "DFlash-feature predictors beat the strongest control "
                   f"on {split}; whether the same features also predict tokens is not "
                   "measured here", figures, measured=figure, threshold=threshold)


def _saving(inputs: QualificationInputs) -> tuple[float | None, str]:
    """Saving per served token: declared, else the shadow simulation's exposed-wait saving."""
    e, m = inputs.economics, None if inputs.shadow_io is None else inputs.shadow_io.metrics
    if e is not None and e.saving_s_per_token is not None:
        return e.saving_s_per_token, "declared"
    if m is not None and m.get("baseline_exposed_wait_s") is not None \
            and m.get("accepted_tokens"):
        return ((m["baseline_exposed_wait_s"] - m["exposed_wait_s"]) / m["accepted_tokens"],
                "shadow simulation (illustrative timings)")
    return None, ""


def f6_candidates(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    """#6 on the measured candidate-path replay cost per accepted token."""
    c = inputs.candidates
    assert c is not None
    saving, source = _saving(inputs)
    result = falsifier6_verdict(
        replay_cost_s_per_accepted_token=c.replay_cost_s_per_accepted_token,
        accepted_tokens=c.accepted_tokens, saving_s_per_token=saving,
        deployment_tokens=None if inputs.economics is None
        else inputs.economics.deployment_tokens, saving_source=source)
    f = result["figures"]
    measured = "" if "expected_saving_s" not in f else (
        f"{f['candidate_replay_cost_s']:.4g} s cost vs {f['expected_saving_s']:.4g} s saving")
    return _from_verdict(result, "measured replay cost <= expected deployment saving", measured)


def f6_economics(inputs: QualificationInputs,
                 config: QualificationConfig) -> Outcome:
    c = inputs.candidates
    if c is not None and c.replay_cost_s_per_accepted_token is not None:
        return f6_candidates(inputs, config)
    e = inputs.economics
    threshold = "replay cost <= expected deployment saving"
    if e is None or e.candidate_replay_cost_s is None:
        return outcome(NOT_MEASURABLE, "no candidate-path replay cost was measured (no "
                       "candidate snapshot with bench/candidates.py's cost per accepted "
                       "token) or declared, and the savings need the expected deployment "
                       "token volume; declare them in the [economics] table",
                       threshold=threshold)
    saving, source = _saving(inputs)
    if saving is None:
        return outcome(NOT_MEASURABLE, "no saving per token was declared or simulated",
                       threshold=threshold)
    total = saving * e.deployment_tokens
    figures = {"candidate_replay_cost_s": e.candidate_replay_cost_s, "saving_s_per_token":
               saving, "saving_source": source, "deployment_tokens": e.deployment_tokens,
               "expected_saving_s": total}
    status = FALSIFIED if e.candidate_replay_cost_s > total else NOT_FALSIFIED
    return outcome(status, f"candidate-path replay costs {e.candidate_replay_cost_s:.4g} s "
                   f"against {total:.4g} s expected saving ({saving:.3g} s/token from "
                   f"{source} x {e.deployment_tokens:.4g} tokens)", figures,
                   measured=f"{e.candidate_replay_cost_s:.4g} s cost vs {total:.4g} s saving",
                   threshold=threshold)


def f7_drift(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    off, split = inputs.offline, "temporal_holdout"
    budget = config.offline.budget or inputs.geometry.top_k
    mine = None if off is None else off.recall(off.candidate, split, budget)
    bound = config.falsifiers.min_temporal_advantage
    threshold = (f"recall@{budget} advantage over the best control >= {bound:+.3f} "
                 "(FalsifierConfig.min_temporal_advantage)")
    if off is None or mine is None:
        return outcome(NOT_MEASURABLE, "no temporal_holdout evaluation of the candidate: "
                       "drift needs the newest period held out (and its rate, several "
                       "checkpoints over time)", threshold=threshold)
    best, theirs = strongest_control(off, split, budget)
    if theirs is None:
        return outcome(NOT_MEASURABLE, "no control was evaluated on temporal_holdout",
                       threshold=threshold)
    advantage = mine - theirs
    validation = off.recall(off.candidate, "validation", budget)
    figures = {"budget": budget, "candidate": mine, "control": best, "control_recall": theirs,
               "advantage": advantage, "validation_recall": validation}
    status = FALSIFIED if advantage < bound else NOT_FALSIFIED
    return outcome(status, f"on the newest period the candidate's recall@{budget} advantage "
                   f"over {best} is {advantage:+.3f} (needs >= {bound:+.3f}); one temporal step "
                   "only, so this bounds drift, it does not measure its rate", figures,
                   measured=f"temporal_holdout: {mine:.3f} vs {best} {theirs:.3f} "
                   f"({advantage:+.3f})", threshold=threshold)


def f8_privacy(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    """Measured, never declared: consent from the seal's ledger check of every row,
    deletion from the erasure drill's receipt. It does not establish legal approval or
    production key management; the reason says so."""
    integrity = inputs.integrity
    a = None if integrity is None else integrity.authorization
    consent = None if integrity is None else integrity.consent
    threshold = ("every row under a live consent grant and an erasure drill that leaves 0 "
                 "owner rows and 0 plaintext canary hits")
    figures = {"policy": None if a is None else a.policy,
               "production_transcripts": None if a is None else a.production_transcripts,
               "deletion_supported": None if a is None else a.deletion_supported,
               "erasure_drill": None if a is None else a.erasure_drill,
               "rows": None if consent is None else consent.rows,
               "rows_granted": None if consent is None else consent.rows_granted}
    deletion = ("no erasure drill" if a is None else
                f"deletion supported: {a.deletion_supported}, {drill_summary(a.erasure_drill)}")
    granted = ("consent not measured" if consent is None
               else f"{consent.rows_granted} of {consent.rows} rows granted")
    measured = f"{granted}; {deletion}"
    production = a is not None and a.production_transcripts
    if consent is not None and consent.rows_granted < consent.rows:
        return outcome(FALSIFIED, f"{consent.rows - consent.rows_granted} rows have no live "
                       "consent grant", figures, measured=measured, threshold=threshold)
    if a is not None and a.deletion_supported is False:
        return outcome(FALSIFIED, f"an owner cannot be erased: {deletion}", figures,
                       measured=measured, threshold=threshold)
    if a is not None and a.approved is False:
        return outcome(FALSIFIED, f"replay is not approved under {a.policy}", figures,
                       measured=measured, threshold=threshold)
    if consent is None or a is None or a.deletion_supported is None:
        # production transcripts fail closed on a missing measurement
        return outcome(FALSIFIED if production else NOT_MEASURABLE, "privacy needs both "
                       "measurements: the seal's consent check and an erasure drill receipt "
                       f"(--erasure-receipt); {measured}", figures, measured=measured,
                       threshold=threshold)
    assert a is not None
    scope = ("production transcripts" if a.production_transcripts
             else f"this run's data ({a.policy}, not production transcripts)")
    return outcome(NOT_FALSIFIED, f"privacy constraints are met for {scope}: consent "
                   "enforced on every row and an owner erased end to end; this does not "
                   "establish legal approval, nor key management and erasure on production "
                   "infrastructure", figures, measured=measured, threshold=threshold)


JUDGES: dict[int, Judge] = {1: f1_parity, 2: f2_heuristic, 3: f3_dflash, 4: f4_amplification,
                            5: f5_late, 6: f6_economics, 7: f7_drift, 8: f8_privacy,
                            9: f9_roofline, 10: f10_loader}


def evaluate_falsifiers(inputs: QualificationInputs,
                        config: QualificationConfig | None = None) -> list[FalsifierVerdict]:
    """All ten falsifier verdicts, in the design note's order."""
    config = QualificationConfig() if config is None else config
    out = []
    for number, judge in JUDGES.items():
        status, reason, figures, measured, threshold = judge(inputs, config)
        out.append(FalsifierVerdict(number=number, statement=STATEMENTS[number], status=status,
                                    reason=reason, figures=figures, measured=measured,
                                    threshold=threshold))
    return out


__all__ = ["FALSIFIED", "JUDGES", "NOT_FALSIFIED", "NOT_MEASURABLE", "STATEMENTS",
           "evaluate_falsifiers"]
