"""CLI of sidecar training: ``flywheel train`` and ``flywheel evaluate``.

``train_command`` and ``evaluate_command`` are plain typer command functions that the
root CLI mounts. Nothing heavy (torch, pyarrow) is imported at module level. The module
also runs on its own, which is how ``torchrun`` starts one process per rank::

    flywheel train --snapshot DATA/epoch=0 --out ckpt/ [--config train.toml]
    torchrun --nproc_per_node=2 -m train.cli train --snapshot DATA/epoch=0 --out ckpt/
    flywheel evaluate --snapshot DATA/epoch=0 --checkpoint ckpt/ [--teacher DIR] \\
        [--out report.json]

Command-line flags override the TOML file, which overrides the defaults
(:mod:`train.config`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import typer

from hebrus_flywheel.core.execution import device_option
from hebrus_flywheel.core.kafka.security import declare_role
from hebrus_flywheel.core.runner import offline_environment, run_app
from hebrus_flywheel.core.snapshot.remote import localize

log = logging.getLogger(__name__)


def _overrides(config: Any, **flags: Any) -> Any:
    """``config`` with every flag that was given (not None) replaced; dotted names reach
    into sections (``optim.max_steps``)."""
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None:
            continue
        section, _, key = name.partition("__")
        if key:
            sections.setdefault(section, {})[key] = value
        else:
            top[section] = value
    for section, values in sections.items():
        top[section] = dataclasses.replace(getattr(config, section), **values)
    return dataclasses.replace(config, **top)


_BOOTSTRAP = typer.Option(None, "--bootstrap-servers",
                          help="Kafka bootstrap of the consent ledger [default: env or the "
                          "embedded broker].")
_NO_LEDGER = typer.Option(False, "--no-consent-ledger",
                          help="Do not re-check owners against the consent ledger (offline); "
                          "only the rows the seal refused are excluded. Reported loudly.")


def consent_source(snapshot: Path, bootstrap: str | None, skip: bool) -> Any:
    """The consent ledger the snapshot's pipeline used (its topic prefix is in the
    manifest), or None with a warning when ``skip``."""
    if skip:
        typer.secho("warning: --no-consent-ledger: owners are not re-checked against the "
                    "consent ledger; only rows the seal refused are excluded", fg="red",
                    err=True)
        return None
    from hebrus_flywheel.core.settings import bootstrap_servers
    from hebrus_flywheel.core.snapshot import load_manifest
    from hebrus_flywheel.streams.consent import CONSENT_TOPIC
    from hebrus_flywheel.streams.consent_book import ConsentBook

    directory = snapshot.parent if snapshot.name == "manifest.json" else snapshot
    prefix = str((load_manifest(directory).get("source") or {}).get("prefix") or "")
    book = ConsentBook(bootstrap=bootstrap_servers(bootstrap), topic=prefix + CONSENT_TOPIC)
    book.load()  # fail closed: an unreadable ledger stops here, naming the topic
    return book


def _print_consent(report: dict[str, Any]) -> None:
    typer.echo(f"consent ({report.get('source')}): {report.get('rows_excluded', 0)} of "
               f"{report.get('rows_checked', '?')} rows excluded "
               f"({report.get('owners_excluded', 0)} owners without a live grant)")


def train_command(
    snapshot_arg: str = typer.Option(..., "--snapshot", help="Sealed epoch directory (or its "
                                     "manifest.json), or s3://bucket/prefix/epoch=N."),
    out: str = typer.Option(..., "--out", help="Checkpoint directory to write, or "
                            "s3://bucket/prefix: staged locally, published when training ends."),
    config: Path | None = typer.Option(None, "--config", help="TOML training config."),
    seed: int | None = typer.Option(None, "--seed", help="Override the config's seed."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Override optim.max_steps."),
    batch_size: int | None = typer.Option(None, "--batch-size",
                                          help="Override data.batch_size (rows per rank)."),
    workers: int | None = typer.Option(None, "--workers", help="Override data.num_workers."),
    device: str | None = device_option(None, what="Training", allow_auto=True),
    threads: int | None = typer.Option(None, "--threads", help="torch threads per rank."),
    snapshot_id: str | None = typer.Option(None, "--snapshot-id",
                                           help="Refuse unless the snapshot has this id."),
    progress: bool | None = typer.Option(None, "--progress/--no-progress",
                                         help="Progress bar (default: the config's)."),
    resume: str | None = typer.Option(None, "--resume", help="Start from this checkpoint's "
                                      "parameters (a directory or s3:// URL; refused when an "
                                      "erasure tainted it)."),
    model: str | None = typer.Option(None, "--model", help="model.architecture: sidecar, "
                                     "per_layer_mlp, shared_lowrank or gate_adapter."),
    gate_prior: bool | None = typer.Option(None, "--gate-prior/--no-gate-prior",
                                           help="model.gate_prior (needs --teacher)."),
    width: int | None = typer.Option(None, "--width", help="model.rank: the predictor's "
                                     "width (the sidecar's low-rank width)."),
    method: str | None = typer.Option(None, "--method", help="Name of the learned method "
                                      "in evaluation and qualification."),
    lr: float | None = typer.Option(None, "--lr", help="optim.lr (and optim.min_lr = lr/10)."),
    eval_every: int | None = typer.Option(None, "--eval-every",
                                          help="Override schedule.eval_every."),
    teacher: Path | None = typer.Option(None, "--teacher", help="The snapshot's teacher: its "
                                        "routers, for a gate prior or a gate adapter."),
    bootstrap: str | None = _BOOTSTRAP,
    no_consent_ledger: bool = _NO_LEDGER,
) -> None:
    """Train a route sidecar or predictor on a snapshot's train split (DDP under torchrun)."""
    declare_role("trainer")
    snapshot = localize(snapshot_arg)
    from hebrus_flywheel.train.config import load_config
    from hebrus_flywheel.train.trainer import train

    settings = _overrides(load_config(config), seed=seed, device=device, threads=threads,
                          method=method, optim__max_steps=max_steps, optim__lr=lr,
                          optim__min_lr=None if lr is None else lr / 10,
                          data__batch_size=batch_size, data__num_workers=workers,
                          schedule__progress=progress, schedule__eval_every=eval_every,
                          model__architecture=model, model__gate_prior=gate_prior,
                          model__rank=width)
    from hebrus_flywheel.train.remote_checkpoint import (
        localize_checkpoint,
        output_dir,
        publish_checkpoint,
    )

    consent = consent_source(snapshot, bootstrap, no_consent_ledger)
    out_dir, publish_to = output_dir(out)
    result = train(snapshot, out_dir, settings, expected_id=snapshot_id,
                   resume=None if resume is None else localize_checkpoint(resume),
                   consent=consent, teacher_dir=teacher)
    if int(os.environ.get("RANK", "0")) == 0:
        if publish_to is not None:
            written = publish_checkpoint(out_dir, publish_to)
            typer.echo(f"published {', '.join(written)} to {publish_to}")
        _print_consent(result.lineage.get("snapshot", {}).get("consent") or {})
        outcome = result.lineage.get("training", {})
        typer.echo(f"checkpoint {result.lineage.get('checkpoint_id')} in {result.checkpoint_dir}"
                   f": best step {outcome.get('best_step')}, validation "
                   f"{outcome.get('best_validation')}, stopped by {outcome.get('stopped')}")


def evaluate_command(
    snapshot_arg: str = typer.Option(..., "--snapshot", help="Sealed epoch directory or "
                                     "s3://bucket/prefix/epoch=N."),
    checkpoint: str = typer.Option(..., "--checkpoint", help="Checkpoint directory or file, "
                                   "or s3://bucket/prefix of a published one."),
    out: Path | None = typer.Option(None, "--out", help="Write the full JSON report here."),
    teacher: Path | None = typer.Option(None, "--teacher", help="The snapshot's teacher "
                                        "checkpoint: enables the native_gate control."),
    split: list[str] = typer.Option([], "--split", help="Evaluation split (repeat); default: "
                                    "every evaluation split present."),
    batch_size: int = typer.Option(8192, "--batch-size", help="(token, layer) rows per batch."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random control."),
    snapshot_id: str | None = typer.Option(None, "--snapshot-id",
                                           help="Refuse unless the snapshot has this id."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar."),
    bootstrap: str | None = _BOOTSTRAP,
    no_consent_ledger: bool = _NO_LEDGER,
) -> None:
    """Score every control and the checkpoint on the evaluation splits; print a table."""
    snapshot = localize(snapshot_arg)
    declare_role("trainer")
    from hebrus_flywheel.train.evaluate import EvaluateConfig, evaluate, write_report
    from hebrus_flywheel.train.remote_checkpoint import localize_checkpoint

    settings = EvaluateConfig(splits=tuple(split), batch_size=batch_size, seed=seed,
                              progress=progress)
    report = evaluate(snapshot, localize_checkpoint(checkpoint), settings, teacher_dir=teacher,
                      expected_id=snapshot_id,
                      consent=consent_source(snapshot, bootstrap, no_consent_ledger))
    print_report(report)
    print_projection(report["collection_projection"])
    _print_consent(report["snapshot"]["consent"])
    if out is not None:
        write_report(report, out)
        typer.echo(f"report written to {out}")


def predictors_command(
    snapshot_arg: str = typer.Option(..., "--snapshot", help="Sealed epoch directory or "
                                     "s3://bucket/prefix/epoch=N."),
    out: Path = typer.Option(..., "--out", help="Directory for predictor-figures.jsonl, "
                             "predictor-summary.json and predictor-report.md."),
    teacher: Path | None = typer.Option(None, "--teacher", help="The snapshot's teacher: "
                                        "enables the native-gate control and gate priors."),
    steps: int = typer.Option(400, "--steps", help="Optimiser steps per predictor."),
    width: list[int] = typer.Option([64], "--width", help="Predictor width (repeat to "
                                    "ablate)."),
    seed: int = typer.Option(0, "--seed", help="Seed of init, batches and random control."),
    expert_bytes: int | None = typer.Option(None, "--expert-bytes", help="Bytes of one "
                                            "expert [default: the snapshot identity's, as "
                                            "the simulator sizes it]."),
    threads: int = typer.Option(1, "--threads", help="torch threads (0: leave as is; "
                                "one is fastest on a shared CPU)."),
) -> None:
    """Train the predictor ablation; score it and every control at budgets k..4k."""
    snapshot = localize(snapshot_arg)
    declare_role("trainer")
    import torch

    from hebrus_flywheel.train.predictor_bench import (
        BenchConfig,
        bench_snapshot,
        default_specs,
        goal_lines,
    )

    if threads:
        torch.set_num_threads(threads)
    if expert_bytes is None:
        expert_bytes = snapshot_expert_bytes(snapshot)
    specs = default_specs(tuple(width))
    if teacher is None:
        specs = tuple(s for s in specs if not s.gate_prior and s.architecture != "gate_adapter")
    config = BenchConfig(specs=specs, steps=steps, seed=seed, expert_bytes=expert_bytes)
    report = bench_snapshot(snapshot, out, config, teacher_dir=teacher)
    for line in goal_lines(report):
        typer.echo(line)
    typer.echo(f"figures written to {report['outputs']['figures']}; ablation table in "
               f"{report['outputs']['report']}")


def snapshot_expert_bytes(snapshot: Path) -> int:
    """Bytes of one routed expert of the snapshot's teacher, from its identity alone:
    the same :class:`~core.geometry.StreamGeometry` the qualification simulator uses."""
    from hebrus_flywheel.core.geometry import StreamGeometry
    from hebrus_flywheel.core.snapshot import load_manifest

    directory = snapshot.parent if snapshot.name == "manifest.json" else snapshot
    return StreamGeometry.from_identity(load_manifest(directory).identity).expert_bytes


def print_projection(table: dict[str, Any]) -> None:
    """The collection-time projection as a text table, then one JSON figure line each."""
    import json

    from hebrus_flywheel.train.projection import projection_figures, projection_lines

    typer.echo("collection-time projection (hours; design note formula "
               "replay_tokens / measured teacher-prefill tokens/s):")
    for line in projection_lines(table):
        typer.echo(f"  {line}")
    for figure in projection_figures(table):
        typer.echo(json.dumps(figure, sort_keys=False))


def _cell(value: Any) -> str:
    return "—" if value is None else f"{value:.3f}"


def print_report(report: dict[str, Any]) -> None:
    """One rich table per evaluation split: method × metric (overall)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 132))
    results = report["offline"]["results"] + report.get("auxiliary", [])
    config = results[0]["config"]
    budgets, k = [str(b) for b in config["budgets"]], config["top_k"]
    for split in report["snapshot"]["splits"]:
        table = Table(title=f"{split} — snapshot {report['snapshot']['snapshot_id'][:12]}")
        for column in ("method", "rows", f"exact@{k}", *(f"R@{b}" for b in budgets),
                       f"P@{budgets[0]}", "RR", "ECE"):
            table.add_column(column, justify="left" if column == "method" else "right")
        for result in results:
            node = (result["splits"].get(split) or {}).get("overall")
            if node is None:
                continue
            calibration = node.get("calibration") or {}
            table.add_row(result["method"], str(node["rows"]), _cell(node["exact_match"]),
                          *(_cell(node["recall"][b]) for b in budgets),
                          _cell(node["precision"][budgets[0]]), _cell(node["rr_first"]),
                          _cell(calibration.get("ece")))
        console.print(table)
    for method, why in report.get("skipped", {}).items():
        console.print(f"[dim]{method} skipped: {why}[/dim]")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m hebrus_flywheel.train.cli`` (one process per torchrun rank)."""
    offline_environment()
    main_rank = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if main_rank else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = typer.Typer(name="flywheel-train", no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False)
    app.command("train")(train_command)
    app.command("evaluate")(evaluate_command)
    app.command("predictors")(predictors_command)
    run_app(app, argv)


if __name__ == "__main__":
    main()
