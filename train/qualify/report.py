"""The qualification report: ``report.json`` (every figure and verdict, stable key order)
and a self-contained ``report.html`` (figures embedded as data URIs), plus each figure
as a PNG file beside them.

The HTML is rendered from the same JSON document that is written, so both always agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.files import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    make_dirs,
)
from hebrus_flywheel.core.geometry import teacher_budgets
from hebrus_flywheel.core.kafka.security import INSECURE_WARNING, insecure_plaintext
from hebrus_flywheel.train.projection import ReplayThroughput, projection
from hebrus_flywheel.train.qualify.config import QualificationConfig
from hebrus_flywheel.train.qualify.errors import ReportError
from hebrus_flywheel.train.qualify.inputs import QualificationInputs
from hebrus_flywheel.train.qualify.parse import inputs_to_mapping
from hebrus_flywheel.train.qualify.plots import PLOT_TITLES, render_plots
from hebrus_flywheel.train.qualify.report_html import render_html
from hebrus_flywheel.train.qualify.verdict import (
    FALSIFIED,
    PASS,
    FalsifierVerdict,
    GateVerdict,
    jsonable,
)

REPORT_SCHEMA = "flywheel.qualify.report.v1"

CLAIM_BOUNDARY: tuple[str, ...] = (
    "Replay may manufacture training examples, but it may not manufacture evidence about "
    "decode latency, cache state, proposal acceptance, SSD overlap, or exact runtime parity; "
    "the native router remains authoritative.",
    "Replay makes examples, not evidence: decode latency, cache state, acceptance and SSD "
    "overlap in this report come only from real decode captures and the trace-driven "
    "simulator, whose timings are declared inputs (Gate 5 lists them), not device "
    "measurements.",
    "Offline metrics are computed on evaluation splits only; training rows never reach an "
    "evaluator.",
    "Predictions may only move bytes early (discardable, low-priority reads); the native "
    "router selects every executed expert.",
    "This pipeline is falsifiable by design. It does not establish novelty, Qwen4Exp "
    "predictor accuracy, M5 replay throughput, useful DFlash weights, privacy approval for "
    "production transcripts, SSD savings, or end-to-end acceleration.",
)
"""The design note's claim boundary, printed at the end of every report."""


def decision(verdicts: Sequence[GateVerdict],
             falsifiers: Sequence[FalsifierVerdict]) -> dict[str, Any]:
    """Promote only when every gate passed; train only when Gate 1 passed."""
    by_gate = {v.gate: v for v in verdicts}
    promote = len(by_gate) == 6 and all(v.status == PASS for v in verdicts)
    train = 1 in by_gate and by_gate[1].status == PASS
    reasons = [f"Gate {v.gate} ({v.name}) {v.status.replace('_', ' ')}: {v.headline}"
               for v in sorted(verdicts, key=lambda v: v.gate) if v.status != PASS]
    reasons += [f"Falsifier #{f.number} falsified ({f.statement}): {f.reason}"
                for f in falsifiers if f.status == FALSIFIED]
    summary = "PROMOTE" if promote else "DO NOT PROMOTE"
    if not train:
        summary += "; do not train on this snapshot (Gate 1 did not pass)"
    if any(f.status == FALSIFIED for f in falsifiers):
        summary += "; a falsifier holds: stop or redesign"
    return {"promote": promote, "train_on_snapshot": train, "summary": summary,
            "reasons": reasons}


def simulator_geometry(inputs: QualificationInputs) -> dict[str, Any]:
    """What the shadow simulator and every byte budget were sized with: the teacher's
    routed experts (shared experts and dense layers resident, not streamed)."""
    g = inputs.geometry
    return {
        "family": g.family, "routed_layers": g.routed_layer_count, "layers": g.layer_count,
        "dense_layers": g.layer_count - g.routed_layer_count, "experts": g.expert_count,
        "skip_class": g.skip_expert is not None, "top_k": g.top_k, "hidden_size": g.hidden_size,
        "routed_intermediate_size": g.routed_intermediate_size,
        "dtype_bytes": inputs.dtype_bytes, "expert_bytes": inputs.expert_bytes,
        "streamed_bytes_per_token": g.routed_layer_count * g.top_k * inputs.expert_bytes,
        "budgets": list(teacher_budgets(g.top_k)),
        "source": "the snapshot's runtime identity" if inputs.dtype_bytes is not None
        else "declared expert bytes",
    }


def candidate_throughput(inputs: QualificationInputs) -> ReplayThroughput | None:
    """The candidate path's measured speed: accepted candidate tokens per second of
    candidate replay (None without a measured cost)."""
    c = inputs.candidates
    cost = None if c is None else c.replay_cost_s_per_accepted_token
    if c is None or not cost or not c.accepted_tokens:
        return None
    return ReplayThroughput(
        path="candidate", tokens=c.accepted_tokens, rows=c.accepted_tokens,
        seconds=cost * c.accepted_tokens, tokens_per_s=1.0 / cost, rows_per_s=1.0 / cost,
        shards_measured=0, shards=0,
        measured="candidate replay seconds per accepted candidate token")


def build_report(inputs: QualificationInputs, verdicts: Sequence[GateVerdict],
                 falsifiers: Sequence[FalsifierVerdict], *,
                 config: QualificationConfig | None = None,
                 plots: dict[str, bytes] | None = None,
                 date: str | None = None) -> dict[str, Any]:
    """The report document (JSON types only); ``date`` (ISO day of the run) is left out
    when None, so the same inputs give the same bytes."""
    config = QualificationConfig() if config is None else config
    plots = {} if plots is None else plots
    return jsonable({
        "schema": REPORT_SCHEMA,
        "snapshot_id": inputs.snapshot_id,
        "date": date,
        "checkpoint": inputs.checkpoint,
        "checkpoint_lineage": list(inputs.checkpoint_lineage),
        "identity": dataclasses.asdict(inputs.identity),
        "geometry": inputs.geometry.to_dict(),
        "expert_bytes": inputs.expert_bytes,
        "simulator_geometry": simulator_geometry(inputs),
        "collection_projection": projection(inputs.collection, candidate_throughput(inputs)),
        "decision": decision(verdicts, falsifiers),
        "gates": [v.to_dict() for v in sorted(verdicts, key=lambda v: v.gate)],
        "falsifiers": [f.to_dict() for f in sorted(falsifiers, key=lambda f: f.number)],
        "objective": None if inputs.objective is None else inputs.objective.statement(),
        "config": dataclasses.asdict(config),
        "claim_boundary": list(CLAIM_BOUNDARY),
        "plots": {name: {"file": f"{name}.png", "title": PLOT_TITLES[name],
                         "sha256": hashlib.sha256(png).hexdigest()}
                  for name, png in plots.items()},
        "inputs": inputs_to_mapping(inputs),
    })


def write_report(inputs: QualificationInputs, verdicts: Sequence[GateVerdict],
                 falsifiers: Sequence[FalsifierVerdict], out_dir: str | Path, *,
                 config: QualificationConfig | None = None,
                 date: str | None = None) -> tuple[Path, Path]:
    """Write ``report.json``, ``report.html`` and one PNG per figure into ``out_dir``
    (created if needed); returns ``(report.json, report.html)``. Same inputs, same bytes."""
    config = QualificationConfig() if config is None else config
    out = Path(out_dir)
    plots = render_plots(inputs, config)
    report = build_report(inputs, verdicts, falsifiers, config=config, plots=plots, date=date)
    if insecure_plaintext():  # marked in red in report.html (report_html.insecure_banner)
        report = {**report, "insecure_plaintext": INSECURE_WARNING}
    try:
        json.dumps(report, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ReportError(f"the report is not JSON-serialisable: {exc}") from exc
    try:
        make_dirs(out)
        for name, png in plots.items():
            atomic_write_bytes(out / f"{name}.png", png)
        json_path, html_path = out / "report.json", out / "report.html"
        atomic_write_json(json_path, report)
        atomic_write_text(html_path, render_html(report, plots))
    except OSError as exc:
        raise ReportError(f"cannot write the report into {out}: {exc}; choose a writable "
                          "directory") from exc
    return json_path, html_path
