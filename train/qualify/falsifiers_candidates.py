"""Falsifiers #3 and #6 on candidate-path evidence, as plain verdict dicts
``{"verdict": ..., "reason": ..., "figures": {...}}`` with the report's vocabulary
(``not_falsified`` is "supported": the evidence does not falsify the approach).

* #3 "draft features predict tokens but not target routes": the drafter's token
  accuracy (acceptance at candidate position 1) against Model B's route recall@k on
  accepted candidate rows, compared with the strongest control a P2 hint could really
  use (at equal budget). Falsified when the drafter predicts tokens (accuracy >=
  ``min_token_accuracy``) but Model B does not beat that control by ``margin``.
* #6 "candidate-path replay costs more than the expected deployment savings": the
  measured replay seconds per accepted token x accepted tokens replayed, against the
  saving per served token x the expected deployment volume. Without a volume the
  verdict is not measurable and reports the break-even volume.
"""

from __future__ import annotations

from typing import Any

from hebrus_flywheel.train.qualify.candidate_evidence import CandidateEvidence
from hebrus_flywheel.train.qualify.verdict import FALSIFIED, NOT_FALSIFIED, NOT_MEASURABLE


def _verdict(verdict: str, reason: str, **figures: Any) -> dict[str, Any]:
    return {"verdict": verdict, "reason": reason, "figures": figures}


def falsifier3_verdict(evidence: CandidateEvidence | None, *, margin: float = 0.02,
                       min_token_accuracy: float = 0.3,
                       split: str = "validation") -> dict[str, Any]:
    """#3 from Model B's evidence (None: no candidate snapshot was given)."""
    if evidence is None:
        return _verdict(NOT_MEASURABLE, "no candidate-path snapshot was given: Model B (the "
                        "route sidecar on candidate positions) was not trained, and the "
                        "drafter's token accuracy was not measured")
    accuracy = evidence.token_accuracy
    node = evidence.summary.get(f"{split}/accepted") or evidence.summary.get(f"{split}/all")
    if accuracy is None or node is None or node.get("recall") is None \
            or node.get("control_recall") is None:
        return _verdict(NOT_MEASURABLE, f"no {split} recall@{evidence.top_k} for Model B and a "
                        "fair control, or no acceptance at candidate position 1",
                        token_accuracy=accuracy)
    recall, control = float(node["recall"]), float(node["control_recall"])
    figures = {"token_accuracy": accuracy, "route_recall": recall, "control": node["control"],
               "control_recall": control, "advantage": recall - control, "margin": margin,
               "budget": evidence.top_k, "split": split, "model": evidence.model,
               "min_token_accuracy": min_token_accuracy}
    said = (f"drafter token accuracy {accuracy:.3f}; {evidence.model} recall@{evidence.top_k} "
            f"{recall:.3f} vs {node['control']} {control:.3f} on {split} accepted rows")
    if recall - control >= margin:
        return _verdict(NOT_FALSIFIED, f"candidate-position features predict target routes: "
                        f"{said} (lead >= {margin:.3f})", **figures)
    if accuracy < min_token_accuracy:
        return _verdict(NOT_MEASURABLE, f"the drafter does not predict tokens either ({said}; "
                        f"accuracy < {min_token_accuracy:.2f}): the premise of #3 fails, "
                        "measure with a stronger drafter", **figures)
    return _verdict(FALSIFIED, f"the drafter predicts tokens but its features do not predict "
                    f"target routes better than a training-free control: {said} (lead < "
                    f"{margin:.3f})", **figures)


def falsifier6_verdict(*, replay_cost_s_per_accepted_token: float | None,
                       accepted_tokens: int | None, saving_s_per_token: float | None,
                       deployment_tokens: float | None,
                       saving_source: str = "declared") -> dict[str, Any]:
    """#6 from the measured replay cost and the (simulated or declared) saving."""
    if replay_cost_s_per_accepted_token is None or not accepted_tokens:
        return _verdict(NOT_MEASURABLE, "no measured candidate-path replay cost per accepted "
                        "token (bench/candidates.py) or no accepted candidate tokens")
    cost = replay_cost_s_per_accepted_token * accepted_tokens
    figures: dict[str, Any] = {
        "replay_cost_s_per_accepted_token": replay_cost_s_per_accepted_token,
        "accepted_tokens": accepted_tokens, "candidate_replay_cost_s": cost,
        "saving_s_per_token": saving_s_per_token, "saving_source": saving_source,
        "deployment_tokens": deployment_tokens}
    if saving_s_per_token is None:
        return _verdict(NOT_MEASURABLE, f"candidate-path replay cost {cost:.4g} s measured, but "
                        "no saving per served token was simulated or declared", **figures)
    if saving_s_per_token <= 0:
        return _verdict(FALSIFIED, f"the predictions save nothing per served token "
                        f"({saving_s_per_token:.3g} s, {saving_source}); any replay cost "
                        f"({cost:.4g} s) exceeds the savings", **figures)
    figures["break_even_deployment_tokens"] = cost / saving_s_per_token
    if deployment_tokens is None:
        return _verdict(NOT_MEASURABLE, f"replay costs {cost:.4g} s; it pays back after "
                        f"{cost / saving_s_per_token:.4g} served tokens at "
                        f"{saving_s_per_token:.3g} s/token ({saving_source}); declare the "
                        "expected deployment volume ([economics] deployment_tokens)", **figures)
    saving = saving_s_per_token * deployment_tokens
    figures["expected_saving_s"] = saving
    status = FALSIFIED if cost > saving else NOT_FALSIFIED
    return _verdict(status, f"candidate-path replay costs {cost:.4g} s "
                    f"({replay_cost_s_per_accepted_token:.3g} s x {accepted_tokens} accepted "
                    f"tokens) against {saving:.4g} s expected saving ({saving_s_per_token:.3g} "
                    f"s/token from {saving_source} x {deployment_tokens:.4g} tokens)", **figures)
