"""The report's figures as deterministic PNG bytes (matplotlib's Agg canvas, no pyplot
state, no timestamp metadata): recall@budget curves per method, a per-layer recall
heatmap, a reliability diagram, byte amplification against budget, and timely recall
and exposed wait against SSD bandwidth. A figure whose data is missing is left out."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hebrus_flywheel.train.metrics import EVALUATION_SPLITS
from hebrus_flywheel.train.qualify.config import QualificationConfig
from hebrus_flywheel.train.qualify.falsifiers_io import reference_rows
from hebrus_flywheel.train.qualify.gates_io import amplification_ratio
from hebrus_flywheel.train.qualify.inputs import QualificationInputs

PLOT_TITLES: dict[str, str] = {
    "recall_curves": "Recall at equal candidate (byte) budgets, per method",
    "layer_heatmap": "Recall per routed layer at the decision budget",
    "reliability": "Reliability diagram of predicted expert-membership probabilities",
    "byte_amplification": "Physical bytes read with / without predictions, by budget",
    "bandwidth": "Timely recall and exposed wait against SSD bandwidth",
    "governor": "Block size: route union U_B against k x tau(B) (Model C)",
}
"""Every figure the report may hold, in report order."""

_STYLE: dict[str, Any] = {
    "font.size": 8, "axes.titlesize": 9, "figure.dpi": 100, "savefig.dpi": 100,
    "axes.grid": True, "grid.alpha": 0.3, "font.family": "DejaVu Sans",
}


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _splits(inputs: QualificationInputs) -> list[str]:
    off = inputs.offline
    if off is None:
        return []
    return [s for s in EVALUATION_SPLITS if off.summary(off.candidate, s) is not None]


def recall_curves(inputs: QualificationInputs, config: QualificationConfig) -> bytes | None:
    off, splits = inputs.offline, _splits(inputs)
    if off is None or not splits or not off.common_budgets:
        return None
    budgets, eb = off.common_budgets, inputs.expert_bytes
    fig = Figure(figsize=(3.2 * len(splits) + 1.2, 3.2), layout="constrained")
    axes = fig.subplots(1, len(splits), squeeze=False)[0]
    for ax, split in zip(axes, splits, strict=True):
        for method in off.methods:
            ys = [off.recall(method, split, b) for b in budgets]
            if all(y is None for y in ys):
                continue
            ys_plot = [np.nan if y is None else y for y in ys]
            bold = method == off.candidate
            ax.plot(budgets, ys_plot, marker="o", ms=3, lw=2.2 if bold else 1.0,
                    label=method + (" (candidate)" if bold else ""))
        ax.set_title(split)
        ax.set_xlabel("candidates per token-layer")
        ax.set_ylim(0, 1.02)
        top = ax.secondary_xaxis("top", functions=(lambda x: x * eb / 2**20,
                                                   lambda y: y * 2**20 / eb))
        top.set_xlabel("byte budget per token-layer (MiB)")
    axes[0].set_ylabel("recall@budget")
    axes[-1].legend(loc="lower right", fontsize=6)
    return _png(fig)


def layer_heatmap(inputs: QualificationInputs, config: QualificationConfig) -> bytes | None:
    off = inputs.offline
    budget = config.offline.budget or inputs.geometry.top_k
    split = next((s for s in (*config.offline.decision_splits, *_splits(inputs))
                  if off is not None and off.summary(off.candidate, s) is not None), None)
    if off is None or split is None:
        return None
    node = off.result(off.candidate)["splits"][split].get("by_layer", {})
    layers = sorted(node, key=lambda x: int(x) if x.lstrip("-").isdigit() else x)
    if not layers:
        return None
    grid = np.array([[np.nan if (r := off.recall(m, split, budget, "by_layer", layer)) is None
                      else r for layer in layers] for m in off.methods])
    fig = Figure(figsize=(min(2.0 + 0.25 * len(layers), 14), 1.2 + 0.3 * len(off.methods)),
                 layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(grid, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_yticks(range(len(off.methods)), off.methods)
    step = max(1, math.ceil(len(layers) / 24))
    ax.set_xticks(range(0, len(layers), step), layers[::step])
    ax.set_xlabel(f"routed layer ({split}, recall@{budget})")
    ax.grid(False)
    if grid.size <= 200:
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if value < 0.6 else "black")
    fig.colorbar(image, ax=ax, label="recall")
    return _png(fig)


def reliability(inputs: QualificationInputs, config: QualificationConfig) -> bytes | None:
    off = inputs.offline
    if off is None:
        return None
    series = []
    for split in _splits(inputs):
        for method in off.methods:
            node = off.summary(method, split)
            cal = None if node is None else node.get("calibration")
            if cal:
                series.append((f"{method} / {split} (ECE {cal['ece']:.3f})", cal["reliability"]))
    if not series:
        return None
    fig = Figure(figsize=(4.2, 3.6), layout="constrained")
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="perfect calibration")
    for label, table in series:
        points = [(b["mean_probability"], b["frequency"]) for b in table if b["count"]]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", ms=3, lw=1, label=label)
    ax.set_xlabel("mean predicted membership probability")
    ax.set_ylabel("observed membership frequency")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6, loc="upper left")
    return _png(fig)


def _budget_axis(rows: list[dict[str, Any]]) -> tuple[list[float], list[str]]:
    numeric = [r["candidate_budget"] for r in rows if r["candidate_budget"] is not None]
    top = (max(numeric) if numeric else 0) + 1
    xs = [float(top if r["candidate_budget"] is None else r["candidate_budget"]) for r in rows]
    return xs, ["all" if r["candidate_budget"] is None else str(r["candidate_budget"])
                for r in rows]


def byte_amplification(inputs: QualificationInputs,
                       config: QualificationConfig) -> bytes | None:
    shadow = inputs.shadow_io
    if shadow is None or not shadow.sweep:
        return None
    fig = Figure(figsize=(4.6, 3.4), layout="constrained")
    ax = fig.subplots()
    bandwidths = sorted({float(r["ssd_bandwidth_bytes_per_s"]) for r in shadow.sweep})
    for bw in bandwidths:
        rows = sorted((r for r in shadow.sweep if float(r["ssd_bandwidth_bytes_per_s"]) == bw),
                      key=lambda r: (r["candidate_budget"] is None, r["candidate_budget"] or 0))
        xs, labels = _budget_axis(rows)
        ys = [np.nan if (a := amplification_ratio(r)) is None or math.isinf(a) else a
              for r in rows]
        ax.plot(xs, ys, marker="o", ms=3, lw=1, label=f"{bw / 1e9:.3g} GB/s")
        ax.set_xticks(xs, labels)
    ax.axhline(config.shadow.max_byte_amplification_ratio, ls="--", color="red", lw=1,
               label="Gate 5 bound")
    ax.set_xlabel("candidate budget (experts per token-layer)")
    ax.set_ylabel("physical bytes: with / without predictions")
    ax.legend(fontsize=6)
    return _png(fig)


def bandwidth(inputs: QualificationInputs, config: QualificationConfig) -> bytes | None:
    shadow = inputs.shadow_io
    if shadow is None or not shadow.sweep:
        return None
    fig = Figure(figsize=(7.6, 3.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    budgets = sorted({r["candidate_budget"] for r in shadow.sweep},
                     key=lambda b: (b is None, b or 0))
    baseline: dict[float, float] = {}
    for budget in budgets:
        rows = sorted((r for r in shadow.sweep if r["candidate_budget"] == budget),
                      key=lambda r: float(r["ssd_bandwidth_bytes_per_s"]))
        xs = [float(r["ssd_bandwidth_bytes_per_s"]) / 1e9 for r in rows]
        label = f"budget {'all' if budget is None else budget}"
        left.plot(xs, [np.nan if r["timely_recall"] is None else r["timely_recall"]
                       for r in rows], marker="o", ms=3, lw=1, label=label)
        right.plot(xs, [_per_token(r, "exposed_wait_s") for r in rows], marker="o", ms=3,
                   lw=1, label=label)
        for x, r in zip(xs, rows, strict=True):
            if (value := _per_token(r, "baseline_exposed_wait_s")) is not None:
                baseline[x] = value
    if baseline:
        xs = sorted(baseline)
        right.plot(xs, [baseline[x] for x in xs], ls="--", color="black", lw=1.2,
                   label="no prediction")
    reference, _ = reference_rows(shadow)
    for ax, ylabel in ((left, "timely recall"), (right, "exposed wait per token (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("SSD bandwidth (GB/s)")
        ax.set_ylabel(ylabel)
        if reference is not None:
            ax.axvline(reference / 1e9, color="grey", lw=0.8, ls=":")
    left.set_ylim(0, 1.02)
    right.legend(fontsize=6)
    return _png(fig)


def governor(inputs: QualificationInputs, config: QualificationConfig) -> bytes | None:
    """k·τ(B) and U_B (native, and Model B's predicted union) per block size on
    validation, the recommended B marked; the break-even is U_B below k·τ(B)."""
    c = inputs.candidates
    table = None if c is None or c.governor is None else (
        c.governor["tables"].get("validation"))
    if not table:
        return None
    blocks = [r["block"] for r in table]
    fig = Figure(figsize=(4.6, 3.2), layout="constrained")
    ax = fig.subplots()
    ax.plot(blocks, [r["k_tau"] for r in table], marker="o", label="k x tau(B)")
    ax.plot(blocks, [r["union"] for r in table], marker="s", label="U_B (native routes)")
    if all(r["predicted_union"] is not None for r in table):
        ax.plot(blocks, [r["predicted_union"] for r in table], marker="^", linestyle="--",
                label="U_B (Model B top-k)")
    chosen = c.governor.get("recommended_block") if c is not None and c.governor else None
    if chosen is not None:
        ax.axvline(chosen, color="grey", linestyle=":", label=f"recommended B = {chosen}")
    ax.set_xlabel("block size B (candidate positions)")
    ax.set_ylabel("experts per layer per block")
    ax.set_xticks(blocks)
    ax.set_title("validation: speculation breaks even where U_B < k x tau(B)")
    ax.legend(fontsize=6)
    return _png(fig)


def _per_token(row: dict[str, Any], key: str) -> float | None:
    value, tokens = row.get(key), row.get("accepted_tokens")
    return None if value is None or not tokens else 1e3 * float(value) / float(tokens)


_RENDERERS: dict[str, Callable[[QualificationInputs, QualificationConfig], bytes | None]] = {
    "recall_curves": recall_curves, "layer_heatmap": layer_heatmap, "reliability": reliability,
    "byte_amplification": byte_amplification, "bandwidth": bandwidth, "governor": governor,
}


def render_plots(inputs: QualificationInputs,
                 config: QualificationConfig | None = None) -> dict[str, bytes]:
    """Every figure the inputs support, as PNG bytes keyed by name (report order)."""
    config = QualificationConfig() if config is None else config
    out: dict[str, bytes] = {}
    with matplotlib.rc_context(_STYLE):  # type: ignore[arg-type]
        for name, render in _RENDERERS.items():
            png = render(inputs, config)
            if png is not None:
                out[name] = png
    return out
