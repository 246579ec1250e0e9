"""The demo's stages past the sealed clean snapshot: the candidate path, the predictor
ablation, training, evaluation, the erasure drill and qualification."""

from __future__ import annotations

import json
import os
from typing import Any

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.core.files import atomic_write_text
from hebrus_flywheel.demo_context import (
    ACCOUNTING_FILE,
    DemoContext,
    print_lines,
    run_flywheel,
    teacher_name,
)

CANDIDATE_ANCHORS_PER_WINDOW = 2
"""Anchors per window drafted on the candidate path (the demo's time budget)."""


def stage_candidates(ctx: DemoContext) -> None:
    """The candidate-path product of the sealed epoch: all three drafters, W=4 x B=4, its own
    snapshot beside the clean one, parity against step-by-step decode, replay cost."""
    if ctx.snapshot_dir is None:
        raise FlywheelError("candidate replay needs the sealed snapshot of the replay stage")
    root = ctx.home / "datasets" / f"{teacher_name()}-candidates"
    lines = run_flywheel("replay", "candidates", "--snapshot", str(ctx.snapshot_dir), "--out",
                      str(root), "--teacher", str(ctx.teacher_dir), "--anchors-per-window",
                      str(CANDIDATE_ANCHORS_PER_WINDOW), "--json", log_name="candidates",
                      ctx=ctx)
    start = next(i for i, line in enumerate(lines) if line.startswith("{"))
    report = json.loads("\n".join(lines[start:]))
    ctx.candidate_report = report
    ctx.results["candidate_snapshot"] = report["out"]
    parity = report["parity"]
    cost = report["replay_cost_s_per_accepted_token"]
    print(f"[candidates] snapshot {report['snapshot_id'][:12]}: {report['rows']} candidate rows "
          f"({', '.join(report['drafters'])}), {report['accepted_tokens']} accepted tokens, "
          f"{'n/a' if cost is None else f'{cost:.3g}'} s replay per accepted token; parity "
          f"vs step-by-step decode: ids {parity['candidate_ids_exact']:.3f}, rank "
          f"{parity['candidate_rank_exact']:.3f}, accepted-prefix digests "
          f"{parity['accepted_prefix_digest_parity']:.3f} ({parity['paths']} paths)")


def _candidate_args(ctx: DemoContext) -> list[str]:
    report = ctx.candidate_report
    if report is None:
        return []
    args = ["--candidate-snapshot", str(report["out"])]
    if report["replay_cost_s_per_accepted_token"] is not None:
        args += ["--candidate-replay-cost", str(report["replay_cost_s_per_accepted_token"])]
    return args


def _chosen_predictor(ctx: DemoContext) -> dict[str, Any]:
    """The same-layer predictor the ablation chose on validation (never a holdout)."""
    summary = json.loads((ctx.run_dir / "predictor-summary.json").read_text())
    best = (summary["goal"].get("same_layer") or {}).get("best_learned")
    if best is None:
        raise FlywheelError("the predictor ablation chose no same-layer model; see "
                            f"{ctx.run_dir / 'predictor-report.md'}")
    return {"name": best, **summary["training"][best]["spec"]}


def stage_train(ctx: DemoContext) -> None:
    """Train, save and (later) qualify the predictor the ablation chose on validation."""
    from hebrus_flywheel.train.predictor_bench import BenchConfig, train_arguments, train_toml

    chosen = _chosen_predictor(ctx)
    ctx.results["trained_predictor"] = chosen
    config = ctx.run_dir / "train.toml"
    bench = BenchConfig(steps=_predictor_steps())  # the ablation's recipe, not a cousin
    atomic_write_text(config, train_toml(bench))
    ctx.checkpoint_dir = ctx.run_dir / "checkpoint"
    print(f"[train] the ablation's choice on validation: {chosen['name']} (its recipe)")
    lines = run_flywheel("train", "--snapshot", str(ctx.snapshot_dir), "--out",
                      str(ctx.checkpoint_dir), "--no-progress",
                      "--config", str(config), "--teacher", str(ctx.teacher_dir),
                      *train_arguments(chosen, bench), log_name="train", ctx=ctx)
    print_lines("train", lines[-6:])


def stage_evaluate(ctx: DemoContext) -> None:
    out = ctx.run_dir / "evaluation.json"
    lines = run_flywheel("evaluate", "--snapshot", str(ctx.snapshot_dir), "--checkpoint",
                      str(ctx.checkpoint_dir), "--teacher", str(ctx.teacher_dir), "--out",
                      str(out), log_name="evaluate", ctx=ctx)
    ctx.results["evaluation"] = str(out)
    print_lines("evaluate", lines)


def _predictor_steps() -> int:
    """Most optimiser steps of every predictor (ablation and checkpoint alike)."""
    return int(os.environ.get("FLYWHEEL_DEMO_PREDICTOR_STEPS", "300"))


def stage_predictors(ctx: DemoContext) -> None:
    steps = str(_predictor_steps())
    widths = os.environ.get("FLYWHEEL_DEMO_PREDICTOR_WIDTHS", "32,64,128").split(",")
    lines = run_flywheel("predictors", "--snapshot", str(ctx.snapshot_dir), "--teacher",
                      str(ctx.teacher_dir), "--out", str(ctx.run_dir), "--steps", steps,
                      *(a for w in widths for a in ("--width", w.strip())),
                      log_name="predictors", ctx=ctx)
    ctx.results["predictor_figures"] = str(ctx.run_dir / "predictor-figures.jsonl")
    print_lines("predictors", lines)


QUALIFY_CONFIG = """\
# The demo's threads are generated offline by replay.synthetic: no production transcript.
# Deletion support is not declared: the erasure drill measures it (--erasure-receipt).
# Whether the rows are authorized is measured from the consent ledger (Gate 2), not
# declared here.
[authorization]
policy = "synthetic-threads"
production_transcripts = false

# An assumed deployment, not a measurement: the output tokens one predictor serves before
# it is replaced. Falsifier 6 weighs the candidate replay cost measured in this run
# against the saving per token the shadow simulation measured, times this volume.
[economics]
deployment_tokens = 10000000
"""


def stage_erasure_drill(ctx: DemoContext) -> None:
    """Erase one synthetic owner from a copy of the snapshot and measure what is left
    (``consumers.erasure_drill``); Gate 2 and falsifier 8 read the receipt."""
    from hebrus_flywheel.consumers.erasure_drill import run_drill

    if ctx.snapshot_dir is None:
        raise FlywheelError("the erasure drill needs the sealed snapshot of the replay stage")
    drill = run_drill(ctx.snapshot_dir, ctx.checkpoint_dir, ctx.run_dir)
    ctx.results["erasure_receipt"] = str(ctx.run_dir / "erasure-receipt.json")
    if drill["state"] != "run":
        print(f"[erasure] drill not run: {drill['reason']}")
        return
    superseding = drill["superseding_snapshot"] or {}
    print(f"[erasure] owner {drill['owner']}: {drill['owner_rows_before']} rows before, "
          f"{drill['owner_rows_after']} after; plaintext canary hits "
          f"{drill['plaintext_canary_hits']} "
          f"({(drill['plaintext_canary_scan'] or {}).get('broker_logs')} in broker logs); "
          f"superseding snapshot {str(superseding.get('id'))[:12]} verifies "
          f"{superseding.get('verifies')}; {len(drill['tainted_checkpoints'])} tainted "
          f"checkpoint(s); receipt {ctx.results['erasure_receipt']}")


def _figures_args(ctx: DemoContext) -> list[str]:
    figures = ctx.results.get("predictor_figures")
    return ["--predictor-figures", figures] if figures else []


def stage_qualify(ctx: DemoContext) -> None:
    config = ctx.run_dir / "qualify.toml"
    atomic_write_text(config, QUALIFY_CONFIG)
    report_dir = ctx.run_dir / "report"
    lines = run_flywheel("qualify", "--snapshot", str(ctx.snapshot_dir), "--checkpoint",
                      str(ctx.checkpoint_dir), "--teacher", str(ctx.teacher_dir), "--config",
                      str(config), "--bootstrap-servers", ctx.bootstrap, "--out",
                      str(report_dir), "--rebuild-report", str(ctx.rebuild_report),
                      "--erasure-receipt", str(ctx.run_dir / "erasure-receipt.json"),
                      "--streams-accounting", str(ctx.run_dir / ACCOUNTING_FILE),
                      *_figures_args(ctx), *_candidate_args(ctx), log_name="qualify",
                      ctx=ctx)
    ctx.results["report"] = str(report_dir / "report.html")
    print_lines("qualify", lines)
