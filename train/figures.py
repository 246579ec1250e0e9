"""``predictor-figures.jsonl``: every predictor figure as one JSON line, as the literature
reports them.

One line per (model, split, budget, metric, group)::

    {"figure": "recall_at_budget", "model": "native_gate", "kind": "control",
     "target": "same_layer", "split": "validation", "budget": 10, "bytes": 10 * B,
     "group": "overall", "value": 0.936}

* ``figure``: ``exact_match_at_k`` (the native top-k set exactly, order ignored; the
  anchors' headline metric), ``recall_at_budget``, ``precision_at_budget``, ``mrr``
  (reciprocal rank of the best-ranked native expert), ``ece`` (expected calibration
  error of the per-expert membership probabilities; learned models only) and
  ``union_growth`` (unique experts per layer over ``window`` consecutive tokens, the
  top-``budget`` predictions next to the native routes' ``target_value``).
* ``kind``: ``learned`` or ``control`` (training-free).
* ``target``: ``same_layer`` (the row's own layer) or ``next_layer`` (P1: layer l+1).
* ``budget``: candidate count; every model and control is scored at the same budgets
  (k, 2k, 3k, 4k of the teacher's k) and ``bytes = budget * expert_bytes`` is the same
  byte budget for all of them. Metrics that do not depend on a budget use ``k``.
* ``group``: ``overall``, ``layer=<l>`` or ``domain=<tag>``.

Legend: k the teacher's native top-k.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write_text
from hebrus_flywheel.core.geometry import teacher_budgets
from hebrus_flywheel.train.exceptions import SnapshotError

FIGURES_FILE = "predictor-figures.jsonl"
FIGURES_SCHEMA = "flywheel.train.predictor_figures.v1"
KINDS = ("learned", "control")
TARGETS = ("same_layer", "next_layer")
FIGURES = ("exact_match_at_k", "recall_at_budget", "precision_at_budget", "mrr", "ece",
           "union_growth")
REQUIRED_LEARNED = ("exact_match_at_k", "ece")


def literature_budgets(top_k: int) -> tuple[int, ...]:
    """The budgets k, 2k, 3k and 4k of the teacher's top-k (:func:`teacher_budgets`)."""
    return teacher_budgets(top_k)


def _line(figure: str, value: float | None, **fields: Any) -> dict[str, Any] | None:
    if value is None or not math.isfinite(float(value)):
        return None
    return {"schema": FIGURES_SCHEMA, "figure": figure, **fields, "value": float(value)}


def _group_lines(node: dict[str, Any], base: dict[str, Any], top_k: int,
                 expert_bytes: int) -> Iterator[dict[str, Any]]:
    at_k = {**base, "budget": top_k, "bytes": top_k * expert_bytes}
    candidates = [_line("exact_match_at_k", node["exact_match"], **at_k),
                  _line("mrr", node["rr_first"], **at_k)]
    for budget, value in node["recall"].items():
        b = int(budget)
        where = {**base, "budget": b, "bytes": b * expert_bytes}
        candidates.append(_line("recall_at_budget", value, **where))
        candidates.append(_line("precision_at_budget", node["precision"][budget], **where))
    calibration = node.get("calibration")
    if calibration is not None:
        candidates.append(_line("ece", calibration["ece"], **at_k))
    union = node.get("union_growth")
    if union is not None and union.get("target"):
        window, target = len(union["target"]), union["target"][-1]
        for budget, series in union["predicted"].items():
            b = int(budget)
            candidates.append(_line("union_growth", series[-1], **base, budget=b,
                                    bytes=b * expert_bytes, window=window,
                                    target_value=target))
    yield from (c for c in candidates if c is not None)


def result_lines(result: dict[str, Any], *, kind: str, target: str, expert_bytes: int,
                 features: str = "", groups: bool = True,
                 width: int | None = None) -> list[dict[str, Any]]:
    """Figure lines of one :meth:`~train.metrics.MetricsAccumulator.result`; a learned
    model's lines also carry its ``width`` (the ablation's width axis)."""
    if kind not in KINDS or target not in TARGETS:
        raise ConfigError(f"kind must be one of {KINDS} and target one of {TARGETS}, "
                          f"got {kind!r}, {target!r}")
    top_k = int(result["config"]["top_k"])
    lines: list[dict[str, Any]] = []
    for split, node in result["splits"].items():
        base = {"model": result["method"], "kind": kind, "target": target, "split": split,
                "features": features, **({} if width is None else {"width": width})}
        lines += _group_lines(node["overall"], {**base, "group": "overall"}, top_k,
                              expert_bytes)
        if not groups:
            continue
        for dim, prefix in (("by_layer", "layer"), ("by_domain", "domain")):
            for label, sub in node[dim].items():
                lines += _group_lines(sub, {**base, "group": f"{prefix}={label}"}, top_k,
                                      expert_bytes)
    return lines


def check_lines(lines: list[dict[str, Any]]) -> None:
    """SnapshotError unless every learned model has ``exact_match_at_k`` and ``ece``."""
    have: dict[str, set[str]] = {}
    for line in lines:
        if line["kind"] == "learned" and line["group"] == "overall":
            have.setdefault(line["model"], set()).add(line["figure"])
    missing = {m: sorted(set(REQUIRED_LEARNED) - f) for m, f in have.items()
               if set(REQUIRED_LEARNED) - f}
    if missing:
        raise SnapshotError(f"learned models lack required figures: {missing}; give every "
                            "learned model membership probabilities")


def write_figures(path: Path, lines: Iterable[dict[str, Any]]) -> Path:
    """Write the lines atomically, one JSON object per line (sorted keys)."""
    rows = list(lines)
    check_lines(rows)
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return path


def read_figures(path: Path) -> list[dict[str, Any]]:
    """The lines of a figures file; SnapshotError naming the line that is not valid."""
    rows: list[dict[str, Any]] = []
    for number, text in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SnapshotError(f"{path}:{number} is not JSON ({exc.msg}); regenerate it with "
                                "`flywheel predictors`") from exc
        missing = {"figure", "model", "kind", "split", "budget", "value"} - set(row)
        if missing or row.get("kind") not in KINDS:
            raise SnapshotError(f"{path}:{number} lacks {sorted(missing)} or has an unknown "
                                f"kind {row.get('kind')!r}; regenerate it")
        row.setdefault("group", "overall")
        row.setdefault("target", "same_layer")
        rows.append(row)
    return rows


def figure_value(lines: list[dict[str, Any]], *, model: str, figure: str, split: str,
                 budget: int | None = None, group: str = "overall") -> float | None:
    """One figure's value, or None when the file has no such line."""
    for line in lines:
        if (line["model"], line["figure"], line["split"], line["group"]) == (
                model, figure, split, group) and (budget is None or line["budget"] == budget):
            return float(line["value"])
    return None
