"""``flywheel qualify``: Gates 1-6 and the ten falsifiers on real artefacts.

::

    flywheel qualify --snapshot DATA/epoch=0 --checkpoint ckpt/ --out report/ \\
        [--teacher DIR] [--config qualify.toml] [--rebuild-report rebuild.json] \\
        [--streams-summary inspect.json | --bootstrap-servers HOST:PORT [--prefix P]]

Builds the input bundle with :func:`train.qualify.collect.collect_inputs`, runs
:func:`train.qualify.qualify` and writes ``report.json``, ``report.html``, the PNGs and
``collection.json`` (what each evidence piece was built from, and the step timings).
Prints the gate and falsifier verdicts and the report path. Exit status 0 whenever the
report was written, whatever the verdicts; 2 on an error, with a message saying what to
do. torch is imported only when the command runs.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import typer

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.core.files import atomic_write_json
from hebrus_flywheel.core.kafka.security import (
    INSECURE_WARNING,
    declare_role,
    insecure_plaintext,
)

COLLECTION_FILE = "collection.json"


def qualify_command(
    snapshot_arg: str = typer.Option(..., "--snapshot", help="Sealed epoch directory or "
                                     "s3://bucket/prefix/epoch=N."),
    checkpoint_arg: str = typer.Option(..., "--checkpoint", help="Checkpoint directory or "
                                       "file, or s3://bucket/prefix of a published one."),
    out: Path = typer.Option(..., "--out", help="Report directory (created if needed)."),
    teacher: Path | None = typer.Option(None, "--teacher", help="The snapshot's teacher: "
                                        "enables the native_gate control."),
    config: Path | None = typer.Option(None, "--config", help="TOML: [objective], [gates.*], "
                                       "[sim], [sweep], [break_even], [throughput], ..."),
    rebuild_report: Path | None = typer.Option(None, "--rebuild-report",
                                               help="JSON of `flywheel rebuild --json`."),
    streams_summary: Path | None = typer.Option(None, "--streams-summary",
                                                help="JSON of `flywheel streams inspect "
                                                "--json` (with capture.records)."),
    streams_accounting: Path | None = typer.Option(
        None, "--streams-accounting", help="JSON of `flywheel streams accounting` (run as the "
        "streams role): Gate 1's record accounting becomes a measured figure."),
    bootstrap: str | None = typer.Option(None, "--bootstrap-servers", help="Read the streams "
                                         "counts from this broker."),
    prefix: str | None = typer.Option(None, "--prefix", help="Topic prefix (default: the "
                                      "snapshot's recorded source prefix)."),
    progress: bool = typer.Option(False, "--progress/--no-progress", help="Progress bars."),
    erasure_receipt: Path | None = typer.Option(None, "--erasure-receipt", help="The erasure "
                                                "drill's erasure-receipt.json: measures "
                                                "deletion support (Gate 2, falsifier 8)."),
    predictor_figures: Path | None = typer.Option(None, "--predictor-figures", help="The "
                                                  "predictor-figures.jsonl of `flywheel "
                                                  "predictors`: Gate 3 also judges it."),
    candidate_snapshot: Path | None = typer.Option(
        None, "--candidate-snapshot", help="A sealed candidate_path snapshot: trains Model B "
        "and the governor (Model C) and measures falsifiers 3 and 6."),
    candidate_replay_cost: float | None = typer.Option(
        None, "--candidate-replay-cost", help="Candidate-path replay seconds per accepted "
        "token, as bench/candidates.py printed it (falsifier 6)."),
) -> None:
    """Qualify a checkpoint on a snapshot: six gates, ten falsifiers, a report."""
    declare_role("trainer")
    from hebrus_flywheel.core.snapshot.remote import localize
    from hebrus_flywheel.train.remote_checkpoint import localize_checkpoint

    snapshot, checkpoint = localize(snapshot_arg), localize_checkpoint(checkpoint_arg)
    try:
        outcome, seconds = _run(
            snapshot=snapshot, checkpoint=checkpoint, out=out, teacher=teacher, config=config,
            rebuild_report=rebuild_report, streams_summary=streams_summary,
            bootstrap=bootstrap, prefix=prefix, progress=progress,
            erasure_receipt=erasure_receipt, predictor_figures=predictor_figures,
            streams_accounting=streams_accounting, candidate_snapshot=candidate_snapshot,
            candidate_replay_cost=candidate_replay_cost)
    except FlywheelError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    print_verdicts(outcome)
    print_collection(outcome.report_json)
    typer.echo(f"report: {outcome.report_html} (json: {outcome.report_json}); "
               f"evidence sources: {out / COLLECTION_FILE}; {seconds:.1f} s")


def _run(*, snapshot: Path, checkpoint: Path, out: Path, teacher: Path | None,
         config: Path | None, rebuild_report: Path | None, streams_summary: Path | None,
         bootstrap: str | None, prefix: str | None, progress: bool,
         erasure_receipt: Path | None = None,
         predictor_figures: Path | None = None,
         streams_accounting: Path | None = None, candidate_snapshot: Path | None = None,
         candidate_replay_cost: float | None = None) -> tuple[Any, float]:
    from hebrus_flywheel.train.qualify import qualify
    from hebrus_flywheel.train.qualify.collect import CollectRequest, collect_inputs, load_settings
    from hebrus_flywheel.train.qualify.errors import InputError

    if streams_summary is not None and bootstrap:
        raise InputError("give --streams-summary or --bootstrap-servers, not both")
    started = time.perf_counter()
    settings = load_settings(config)
    collected = collect_inputs(CollectRequest(
        snapshot=snapshot, checkpoint=checkpoint, teacher=teacher,
        rebuild_report=rebuild_report, streams_summary=streams_summary, bootstrap=bootstrap,
        prefix=prefix, settings=settings, progress=progress, erasure_receipt=erasure_receipt,
        predictor_figures=predictor_figures, streams_accounting=streams_accounting,
        candidate_snapshot=candidate_snapshot,
        candidate_replay_cost_s_per_accepted_token=candidate_replay_cost))
    report_started = time.perf_counter()
    outcome = qualify(collected.inputs, out, settings.thresholds,
                      date=datetime.datetime.now(datetime.UTC).date().isoformat())
    timings = {**collected.timings_s, "report": time.perf_counter() - report_started,
               "total": time.perf_counter() - started}
    _write_collection(out, collected.notes, timings)
    return outcome, timings["total"]


def _write_collection(out: Path, notes: dict[str, str], timings: dict[str, float]) -> None:
    from hebrus_flywheel.train.qualify.errors import ReportError

    body = {"schema": "flywheel.qualify.collection.v1", "sources": dict(sorted(notes.items())),
            "timings_s": {k: round(v, 3) for k, v in sorted(timings.items())}}
    try:
        atomic_write_json(out / COLLECTION_FILE, body)
    except OSError as exc:
        raise ReportError(f"cannot write {out / COLLECTION_FILE}: {exc}") from exc


def _short(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def print_collection(report_json: Path) -> None:
    """The simulator geometry and the collection-time projection of the written report."""
    import json

    from hebrus_flywheel.train.projection import projection_lines

    report = json.loads(Path(report_json).read_text(encoding="utf-8"))
    g = report["simulator_geometry"]
    typer.echo(f"simulator geometry ({g['source']}): {g['family']}, {g['routed_layers']} "
               f"routed of {g['layers']} layers ({g['dense_layers']} dense, resident), "
               f"{_experts(g)}, top-{g['top_k']}, hidden {g['hidden_size']}, "
               f"routed intermediate {g['routed_intermediate_size']}")
    typer.echo(f"simulator geometry: expert {g['expert_bytes']:,} B = 3 x "
               f"{g['hidden_size']} x {g['routed_intermediate_size']} x {g['dtype_bytes']} B; "
               f"{g['streamed_bytes_per_token']:,} B streamed per token (L x k x expert); "
               f"budgets {g['budgets']} (k..4k)")
    typer.echo("collection-time projection (hours):")
    for line in projection_lines(report["collection_projection"]):
        typer.echo(f"  {line}")


def _experts(geometry: dict[str, Any]) -> str:
    """``17 experts``, or ``16 experts + a skip class`` where the router has one."""
    if geometry.get("skip_class"):
        return f"{geometry['experts'] - 1} experts + a skip class (runs none, never read)"
    return f"{geometry['experts']} experts"


def print_verdicts(outcome: Any) -> None:
    """Gate and falsifier verdicts as two tables, then the decision."""
    from rich.console import Console
    from rich.table import Table

    from hebrus_flywheel.train.qualify import decision

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 150))
    gates = Table(title="Qualification gates")
    for column in ("gate", "name", "verdict", "headline"):
        gates.add_column(column)
    for v in outcome.verdicts:
        gates.add_row(str(v.gate), v.name, v.status, _short(v.headline))
    falsifiers = Table(title="Falsifiers")
    for column in ("#", "verdict", "why"):
        falsifiers.add_column(column)
    for f in outcome.falsifiers:
        falsifiers.add_row(str(f.number), f.status, _short(f.reason))
    console.print(gates)
    console.print(falsifiers)
    console.print(decision(outcome.verdicts, outcome.falsifiers)["summary"])
    if insecure_plaintext():
        console.print(f"[bold red]{INSECURE_WARNING}[/bold red]")
