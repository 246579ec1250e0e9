"""Gate 3 from ``predictor-figures.jsonl``: the best learned predictor against the best
training-free control, per metric, at the teacher's k (equal candidate count and bytes).

The best learned model is chosen on ``validation`` (recall@k, then exact-match@k) and
judged as it is on every other split: the runtime holdout is never used to choose.
Only same-layer predictors are judged here; next-layer (P1) figures are reported.
"""

from __future__ import annotations

from typing import Any

from hebrus_flywheel.train.qualify.verdict import Check, judged, unmeasured

TARGET = "same_layer"


def _value(lines: tuple[dict[str, Any], ...], model: str, figure: str, split: str,
           budget: int) -> float | None:
    for line in lines:
        if (line["model"], line["figure"], line["split"], line.get("group", "overall"),
                int(line["budget"])) == (model, figure, split, "overall", budget):
            return float(line["value"])
    return None


def _models(lines: tuple[dict[str, Any], ...], kind: str) -> list[str]:
    return sorted({line["model"] for line in lines if line["kind"] == kind
                   and line.get("target", TARGET) == TARGET})


def best_learned(lines: tuple[dict[str, Any], ...], top_k: int) -> str | None:
    """The learned model with the best validation recall@k (then exact-match@k)."""
    scored = [((_value(lines, m, "recall_at_budget", "validation", top_k) or -1.0,
                _value(lines, m, "exact_match_at_k", "validation", top_k) or -1.0), m)
              for m in _models(lines, "learned")]
    scored = [s for s in scored if s[0][0] >= 0]
    return max(scored)[1] if scored else None


def _best_control(lines: tuple[dict[str, Any], ...], figure: str, split: str,
                  top_k: int) -> tuple[str | None, float | None]:
    found = [(v, m) for m in _models(lines, "control")
             if (v := _value(lines, m, figure, split, top_k)) is not None]
    if not found:
        return None, None
    value, model = max(found)
    return model, value


def figures_checks(lines: tuple[dict[str, Any], ...], *, splits: tuple[str, ...], top_k: int,
                   margin: float, max_ece: float | None) -> tuple[list[Check], dict[str, Any]]:
    """One check per (split, metric) plus ECE; and the table the report shows."""
    best = best_learned(lines, top_k)
    threshold = f"best learned >= best control + {margin:.3f} at k={top_k}"
    if best is None:
        return [unmeasured("figures_learned", "predictor-figures.jsonl has no learned "
                           "same-layer model with validation recall@k; run `flywheel "
                           "predictors`", threshold=threshold)], {}
    checks: list[Check] = []
    table: dict[str, Any] = {"best_learned": best, "chosen_on": "validation", "splits": {}}
    for split in splits:
        row: dict[str, Any] = {}
        for figure in ("recall_at_budget", "exact_match_at_k"):
            name = f"figures_{figure}_{split}"
            mine = _value(lines, best, figure, split, top_k)
            control, theirs = _best_control(lines, figure, split, top_k)
            if mine is None or theirs is None:
                checks.append(unmeasured(name, f"{split}: no {figure} for {best} or for any "
                                         "control", threshold=threshold))
                continue
            delta = mine - theirs
            row[figure] = {"learned": mine, "control": control, "control_value": theirs,
                           "delta": delta}
            checks.append(judged(name, delta >= margin, threshold=threshold,
                                 figure=f"{split}: {best} {figure} {mine:.3f} vs {control} "
                                 f"{theirs:.3f} ({delta:+.3f})",
                                 reason="" if delta >= margin else
                                 f"leads by only {delta:+.3f}, less than {margin:.3f}"))
        ece = _value(lines, best, "ece", split, top_k)
        row["ece"] = ece
        if max_ece is not None:
            checks.append(_ece(best, split, ece, max_ece))
        table["splits"][split] = row
    return checks, table


def _ece(model: str, split: str, ece: float | None, bound: float) -> Check:
    name, threshold = f"figures_ece_{split}", f"ECE <= {bound:.3f}"
    if ece is None:
        return unmeasured(name, f"{split}: {model} has no ECE line", threshold=threshold)
    return judged(name, ece <= bound, figure=f"{split}: {model} ECE {ece:.4f}",
                  threshold=threshold, reason="" if ece <= bound else "miscalibrated")
