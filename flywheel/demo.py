"""``make demo``: the flywheel end to end on the embedded default.

Each stage is idempotent where it can be (the teacher is created once and reused; a
second run captures a new epoch of threads with a new seed), prints what it did, and
the run ends with a summary a person can read. Later stages of the pipeline append
themselves to :data:`STAGES`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.core.files import atomic_write_text, create_file, make_dirs
from hebrus_flywheel.core.kafka.security import (
    INSECURE_WARNING,
    acting_as,
    insecure_marker,
    insecure_plaintext,
)
from hebrus_flywheel.core.settings import bootstrap_servers, flywheel_home

log = logging.getLogger("hebrus_flywheel.demo")

DEFAULT_PRESET = "tiny-qwen3-next"
RED, RESET = "\033[1;31m", "\033[0m"


@dataclass
class DemoContext:
    """State shared by the demo stages."""

    home: Path
    bootstrap: str
    teacher_dir: Path
    run_dir: Path
    dataset_dir: Path
    epoch: int
    threads: int
    snapshot_dir: Path | None = None
    temporal_cut_ms: int | None = None
    checkpoint_dir: Path | None = None
    rebuild_report: Path | None = None
    candidate_report: dict[str, Any] | None = None
    results: dict[str, Any] = field(default_factory=dict)


def _stage_broker(ctx: DemoContext) -> None:
    from hebrus_flywheel.streams import topics
    from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker

    embedded = EmbeddedBroker(BrokerConfig(insecure_plaintext=insecure_marker().is_file()))
    if ctx.bootstrap == embedded.config.bootstrap:
        embedded.up()
    # the retention policy of $FLYWHEEL_RETENTION_CONFIG, else the defaults (7 days)
    created = topics.create_topics(ctx.bootstrap, topics.catalogue())
    ctx.results["topics"] = created
    print(f"[broker] {ctx.bootstrap}: {len(created)} catalogue topics ready")


def _teacher_name() -> str:
    """``tiny-qwen3-next-pretrained`` (issue 17), or the random-weight teacher when
    ``FLYWHEEL_DEMO_TEACHER=random``; datasets are kept apart per teacher."""
    random = os.environ.get("FLYWHEEL_DEMO_TEACHER", "pretrained") == "random"
    return DEFAULT_PRESET if random else f"{DEFAULT_PRESET}-pretrained"


def _pretrain_teacher(ctx: DemoContext) -> None:
    from hebrus_flywheel.replay.pretrain import PretrainConfig, pretrain_teacher
    from hebrus_flywheel.replay.teacher import artifact_digest

    steps = int(os.environ.get("FLYWHEEL_DEMO_TEACHER_STEPS", "100"))
    _, record, reused = pretrain_teacher(ctx.teacher_dir, PretrainConfig(
        preset=DEFAULT_PRESET, steps=steps))
    before, after = record["held_out_before"], record["held_out_after"]
    print(f"[teacher] {'reusing' if reused else 'pretrained'} {ctx.teacher_dir.name}: "
          f"{record['steps_run']} steps ({record.get('seconds_per_step', '?')} s/step), "
          f"held-out loss "
          f"{before['loss']:.3f} -> {after['loss']:.3f}, expert-load entropy "
          f"{after['mean_load_entropy']:.3f}, {record['total_seconds']} s to build")
    ctx.results["teacher_pretrain"] = {k: record[k] for k in (
        "held_out_before", "held_out_after", "steps_run", "total_seconds")}
    ctx.results["teacher_pretrain"]["config_digest"] = record.get("config_digest")
    ctx.results["teacher_digest"] = artifact_digest(ctx.teacher_dir)


def _stage_teacher(ctx: DemoContext) -> None:
    from hebrus_flywheel.replay.teacher import artifact_digest, init_teacher

    if ctx.teacher_dir.name != DEFAULT_PRESET:
        _pretrain_teacher(ctx)
        return
    if not (ctx.teacher_dir / "config.json").exists():
        init_teacher(ctx.teacher_dir, preset=DEFAULT_PRESET, seed=0)
        print(f"[teacher] created {DEFAULT_PRESET} in {ctx.teacher_dir}")
    else:
        print(f"[teacher] reusing {ctx.teacher_dir}")
    ctx.results["teacher_digest"] = artifact_digest(ctx.teacher_dir)


DEMO_POLICY = "demo-synthetic-v1"


def demo_owner(raw: str) -> str:
    """The id capture records carry for the synthetic owner ``raw``: its pseudonym in
    the local owner key store (the runtime publisher pseudonymizes every owner)."""
    from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer

    return Pseudonymizer(LocalOwnerKeyStore(create=True)).owner(raw)


def _epoch_threads(ctx: DemoContext) -> Iterator[Any]:
    from hebrus_flywheel.replay.capture import load_threads

    # Each epoch captures new threads of the same owners: thread ids carry the epoch so
    # they never collide with (already closed) threads of earlier epochs.
    return (dataclasses.replace(t, thread_id=f"e{ctx.epoch:03d}-{t.thread_id}")
            for t in load_threads(None, ctx.threads, seed=ctx.epoch))


def _stage_consent(ctx: DemoContext) -> None:
    """Grant every scope to the owners of this epoch's threads but the last one, whose
    records must then be refused at capture (counted in the capture summary)."""
    from hebrus_flywheel.streams.consent import SCOPES, grant, now_ms
    from hebrus_flywheel.streams.consent_book import write_entries

    raw_owners = sorted({t.owner for t in _epoch_threads(ctx)})
    withheld = raw_owners.pop() if len(raw_owners) > 1 else None
    owners = [demo_owner(raw) for raw in raw_owners]
    start = now_ms()
    write_entries(ctx.bootstrap, [grant(owner, SCOPES, granted_at_ms=start,
                                        expires_at_ms=start + 365 * 86_400_000,
                                        policy_version=DEMO_POLICY, granted_by="make demo")
                                  for owner in owners])
    ctx.results["consent"] = {"granted_owners": len(owners), "scopes": list(SCOPES),
                              "policy_version": DEMO_POLICY, "withheld_owner": withheld}
    print(f"[consent] granted {', '.join(SCOPES)} to {len(owners)} synthetic owners "
          f"(policy {DEMO_POLICY}); {withheld} gets none unless an earlier run granted it: "
          "its records are refused at capture")


def _stage_capture(ctx: DemoContext) -> None:
    from hebrus_flywheel.replay.capture import CaptureConfig
    from hebrus_flywheel.replay.capture_cli import _print_summary, run_capture

    config = CaptureConfig(mode="forced", seed=ctx.epoch, interleave=4)
    threads = _epoch_threads(ctx)
    started_ms = time.time() * 1000
    summary = run_capture(teacher_dir=ctx.teacher_dir, threads=threads, config=config,
                          bootstrap=ctx.bootstrap, expected=ctx.threads)
    # The temporal holdout is "the newest period": threads whose first record was
    # published in the last fifth of this capture.
    ctx.temporal_cut_ms = int(started_ms + 0.8 * (time.time() * 1000 - started_ms))
    ctx.results["capture"] = summary
    if "consent" in ctx.results:
        ctx.results["consent"]["refused_at_capture"] = summary["refused_no_consent"]
    print("[capture]", end=" ")
    _print_summary(summary)


def _flywheel(*args: str, log_name: str, ctx: DemoContext) -> list[str]:
    """Run a ``flywheel`` sub-command as its own process (faust and the replay worker
    own their event loops and signal handlers); its log goes to the run directory."""
    cmd = [sys.executable, "-m", "hebrus_flywheel.cli", *args]
    log_path = ctx.run_dir / f"{log_name}.log"
    with create_file(log_path) as log_file:
        proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, check=False)
    lines = log_path.read_text().splitlines()
    if proc.returncode != 0:
        tail = "\n".join(lines[-15:])
        raise FlywheelError(f"`flywheel {' '.join(args)}` failed ({proc.returncode}); "
                            f"see {log_path}:\n{tail}")
    return lines


VALIDATION_FRACTION, RUNTIME_HOLDOUT_FRACTION = 0.25, 0.15
DEFAULT_SALT = "hebrus-flywheel-split-v1"
# Threads the owner and runtime draws must give each split (the temporal and stress
# rules then move some out): training needs validation, the parity gate the holdout.
SPLIT_MINIMUM = {"train": 6, "validation": 3, "runtime_holdout": 2}


def _split_salt(ctx: DemoContext) -> str:
    """The home's split salt: chosen once, on the first epoch, so that this key store's
    owner pseudonyms fill every split the later stages need, then kept (an owner never
    changes split across epochs). A home sealed before the salt was recorded keeps the
    default salt it used."""
    from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer
    from hebrus_flywheel.streams.processors.split import SplitConfig, search_salt

    path = ctx.home / "demo" / "split-salt"
    if path.is_file():
        return path.read_text().strip()
    salt = DEFAULT_SALT
    if ctx.epoch == 0:
        withheld = ctx.results.get("consent", {}).get("withheld_owner")
        names = Pseudonymizer(LocalOwnerKeyStore(create=True))
        ids = [(names.owner(t.owner), names.thread(t.owner, t.thread_id))
               for t in _epoch_threads(ctx) if t.owner != withheld]
        config = SplitConfig(salt=DEFAULT_SALT, validation_fraction=VALIDATION_FRACTION,
                             runtime_holdout_fraction=RUNTIME_HOLDOUT_FRACTION)
        found = search_salt(ids, config, minimum=SPLIT_MINIMUM)
        if found is None:
            raise FlywheelError(f"{len(ids)} demo threads cannot fill {SPLIT_MINIMUM}; "
                                "raise FLYWHEEL_DEMO_THREADS")
        salt = found
    atomic_write_text(path, salt + "\n")
    return salt


def _stage_streams(ctx: DemoContext) -> None:
    # Small demo epochs need larger evaluation shares than production defaults so that
    # every split (and the parity sample) is non-empty.
    temporal_cut = ctx.temporal_cut_ms or int(time.time() * 1000)
    _flywheel("streams", "worker", "--drain", "--validation-fraction", str(VALIDATION_FRACTION),
              "--runtime-holdout-fraction", str(RUNTIME_HOLDOUT_FRACTION), "--stress-rate", "0.3",
              "--salt", _split_salt(ctx),
              "--temporal-cut-ms", str(temporal_cut), log_name="streams-worker", ctx=ctx)
    lines = _flywheel("streams", "inspect", log_name="streams-inspect", ctx=ctx)
    print("[streams] split, dedup and quarantine summary:")
    for line in lines:
        if not line.startswith(("20", "[")):
            print("   ", line)
    ledger = _accounting(ctx)
    print(f"[streams] record accounting: {ledger['totals']['records']} consumed capture "
          f"records, {ledger['unaccounted']} unaccounted ({ctx.run_dir / ACCOUNTING_FILE})")


ACCOUNTING_FILE = "streams-accounting.json"


def _accounting(ctx: DemoContext) -> dict[str, Any]:
    """``flywheel streams accounting`` (the streams role) saved for Gate 1."""
    lines = _flywheel("streams", "accounting", log_name="streams-accounting", ctx=ctx)
    ledger: dict[str, Any] = json.loads(next(line for line in reversed(lines)
                                             if line.startswith("{")))
    atomic_write_text(ctx.run_dir / ACCOUNTING_FILE, json.dumps(ledger, sort_keys=True))
    return ledger


def _stage_replay(ctx: DemoContext) -> None:
    # --drain: the worker ends on "caught up" (every window partition committed to its
    # end). The open epoch's last, partial blocks close only at a recorded boundary, so
    # it drains once the seal below has recorded the epoch's end offsets.
    log_path = ctx.run_dir / "replay-worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "hebrus_flywheel.cli", "replay", "worker", "--teacher",
         str(ctx.teacher_dir), "--dataset", str(ctx.dataset_dir), "--drain",
         "--prefix", ""],  # the demo uses the shared namespace (its own broker)
        stdout=create_file(log_path), stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_dataset(ctx, worker)
        lines = _flywheel("seal", "--epoch", str(ctx.epoch), "--dataset", str(ctx.dataset_dir),
                          log_name="seal", ctx=ctx)
        status = worker.wait(timeout=120)
    finally:
        if worker.poll() is None:
            worker.terminate()
            worker.wait(timeout=30)
    drained = [line for line in log_path.read_text(errors="replace").splitlines()
               if line.startswith("drained:")]
    if status != 0 or not drained:
        raise FlywheelError(f"the replay worker did not drain (exit {status}); see {log_path}")
    lines.append(drained[-1])
    manifest = ctx.dataset_dir / f"epoch={ctx.epoch}" / "manifest.json"
    ctx.snapshot_dir = manifest.parent
    ctx.results["snapshot"] = str(ctx.snapshot_dir)
    print("[replay] " + "\n         ".join(
        line.strip() for line in lines if not line.startswith(("20", "["))))


def _wait_for_dataset(ctx: DemoContext, worker: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while not (ctx.dataset_dir / "dataset.json").exists():
        if worker.poll() is not None:
            raise FlywheelError(f"the replay worker exited ({worker.returncode}) before "
                                f"writing; see {ctx.run_dir / 'replay-worker.log'}")
        if time.monotonic() > deadline:
            raise FlywheelError("the replay worker wrote nothing for 120 s; see "
                                f"{ctx.run_dir / 'replay-worker.log'}")
        time.sleep(1)


def _stage_rebuild(ctx: DemoContext) -> None:
    out = ctx.run_dir / "rebuild"
    lines = _flywheel("rebuild", "--snapshot", str(ctx.snapshot_dir), "--out", str(out),
                      "--teacher", str(ctx.teacher_dir), "--from-capture", "--json",
                      log_name="rebuild", ctx=ctx)
    start = next(i for i, line in enumerate(lines) if line.startswith("{"))
    report = json.loads("\n".join(lines[start:]))
    ctx.rebuild_report = ctx.run_dir / "rebuild.json"
    atomic_write_text(ctx.rebuild_report, json.dumps(report, indent=2))
    print(f"[rebuild] {report['capture_windows_regenerated']} windows regenerated from the "
          f"capture topics ({report['capture_segments']} streams configuration segment(s)), "
          f"replayed into {out}: "
          f"{'plaintext byte-identical' if report.get('identical') else 'DIFFERENT'} "
          f"(content id {'matches' if report.get('content_id_match') else 'DIFFERS'}; "
          "ciphertext fresh: encrypted at rest)")


CANDIDATE_ANCHORS_PER_WINDOW = 2
"""Anchors per window drafted on the candidate path (the demo's time budget)."""


def _stage_candidates(ctx: DemoContext) -> None:
    """The candidate-path product of the sealed epoch: all three drafters, W=4 x B=4, its own
    snapshot beside the clean one, parity against step-by-step decode, replay cost."""
    if ctx.snapshot_dir is None:
        raise FlywheelError("candidate replay needs the sealed snapshot of the replay stage")
    root = ctx.home / "datasets" / f"{_teacher_name()}-candidates"
    lines = _flywheel("replay", "candidates", "--snapshot", str(ctx.snapshot_dir), "--out",
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


def _print_lines(tag: str, lines: list[str]) -> None:
    shown = [line for line in lines if line.strip() and not line.startswith(("20", "[", "WARN"))]
    print(f"[{tag}]")
    for line in shown:
        print("   ", line)


def _chosen_predictor(ctx: DemoContext) -> dict[str, Any]:
    """The same-layer predictor the ablation chose on validation (never a holdout)."""
    summary = json.loads((ctx.run_dir / "predictor-summary.json").read_text())
    best = (summary["goal"].get("same_layer") or {}).get("best_learned")
    if best is None:
        raise FlywheelError("the predictor ablation chose no same-layer model; see "
                            f"{ctx.run_dir / 'predictor-report.md'}")
    return {"name": best, **summary["training"][best]["spec"]}


def _stage_train(ctx: DemoContext) -> None:
    """Train, save and (later) qualify the predictor the ablation chose on validation."""
    from hebrus_flywheel.train.predictor_bench import BenchConfig, train_arguments, train_toml

    chosen = _chosen_predictor(ctx)
    ctx.results["trained_predictor"] = chosen
    config = ctx.run_dir / "train.toml"
    bench = BenchConfig(steps=_predictor_steps())  # the ablation's recipe, not a cousin
    atomic_write_text(config, train_toml(bench))
    ctx.checkpoint_dir = ctx.run_dir / "checkpoint"
    print(f"[train] the ablation's choice on validation: {chosen['name']} (its recipe)")
    lines = _flywheel("train", "--snapshot", str(ctx.snapshot_dir), "--out",
                      str(ctx.checkpoint_dir), "--no-progress",
                      "--config", str(config), "--teacher", str(ctx.teacher_dir),
                      *train_arguments(chosen, bench), log_name="train", ctx=ctx)
    _print_lines("train", lines[-6:])


def _stage_evaluate(ctx: DemoContext) -> None:
    out = ctx.run_dir / "evaluation.json"
    lines = _flywheel("evaluate", "--snapshot", str(ctx.snapshot_dir), "--checkpoint",
                      str(ctx.checkpoint_dir), "--teacher", str(ctx.teacher_dir), "--out",
                      str(out), log_name="evaluate", ctx=ctx)
    ctx.results["evaluation"] = str(out)
    _print_lines("evaluate", lines)


def _predictor_steps() -> int:
    """Most optimiser steps of every predictor (ablation and checkpoint alike)."""
    return int(os.environ.get("FLYWHEEL_DEMO_PREDICTOR_STEPS", "300"))


def _stage_predictors(ctx: DemoContext) -> None:
    steps = str(_predictor_steps())
    widths = os.environ.get("FLYWHEEL_DEMO_PREDICTOR_WIDTHS", "32,64,128").split(",")
    lines = _flywheel("predictors", "--snapshot", str(ctx.snapshot_dir), "--teacher",
                      str(ctx.teacher_dir), "--out", str(ctx.run_dir), "--steps", steps,
                      *(a for w in widths for a in ("--width", w.strip())),
                      log_name="predictors", ctx=ctx)
    ctx.results["predictor_figures"] = str(ctx.run_dir / "predictor-figures.jsonl")
    _print_lines("predictors", lines)


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


def _stage_erasure_drill(ctx: DemoContext) -> None:
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


def _stage_qualify(ctx: DemoContext) -> None:
    config = ctx.run_dir / "qualify.toml"
    atomic_write_text(config, QUALIFY_CONFIG)
    report_dir = ctx.run_dir / "report"
    lines = _flywheel("qualify", "--snapshot", str(ctx.snapshot_dir), "--checkpoint",
                      str(ctx.checkpoint_dir), "--teacher", str(ctx.teacher_dir), "--config",
                      str(config), "--bootstrap-servers", ctx.bootstrap, "--out",
                      str(report_dir), "--rebuild-report", str(ctx.rebuild_report),
                      "--erasure-receipt", str(ctx.run_dir / "erasure-receipt.json"),
                      "--streams-accounting", str(ctx.run_dir / ACCOUNTING_FILE),
                      *_figures_args(ctx), *_candidate_args(ctx), log_name="qualify",
                      ctx=ctx)
    ctx.results["report"] = str(report_dir / "report.html")
    _print_lines("qualify", lines)


STAGES: list[tuple[str, Callable[[DemoContext], None]]] = [
    ("broker", _stage_broker),
    ("teacher", _stage_teacher),
    ("consent", _stage_consent),
    ("capture", _stage_capture),
    ("streams", _stage_streams),
    ("replay", _stage_replay),
    ("rebuild", _stage_rebuild),
    ("candidates", _stage_candidates),
    ("predictors", _stage_predictors),  # the ablation chooses on validation what to train
    ("train", _stage_train),
    ("evaluate", _stage_evaluate),
    ("erasure", _stage_erasure_drill),
    ("qualify", _stage_qualify),
]


# Each stage runs as its own Kafka role (least privilege, see streams/acls.py): the
# in-process stages set it here; a stage that starts `flywheel` commands sets none, so
# each command declares its own (streams, replay, sealer, trainer).
STAGE_ROLES: dict[str, str] = {"broker": "admin", "consent": "admin", "capture": "runtime"}


def _transport_line() -> str:
    if insecure_plaintext():
        return f"{RED}[demo] {INSECURE_WARNING}{RESET}"
    return "[demo] transport: SASL_SSL (TLS + SCRAM-SHA-512), one Kafka principal per stage"


def _next_epoch(dataset_dir: Path) -> int:
    sealed = [int(p.parent.name.split("=")[1]) for p in dataset_dir.glob("epoch=*/manifest.json")]
    return max(sealed) + 1 if sealed else 0


def run_demo(*, threads: int = 32) -> DemoContext:
    home = flywheel_home()
    dataset_dir = home / "datasets" / _teacher_name()
    epoch = _next_epoch(dataset_dir)
    ctx = DemoContext(
        home=home, bootstrap=bootstrap_servers(None),
        teacher_dir=home / "teachers" / _teacher_name(),
        run_dir=home / "demo" / "runs" / f"epoch-{epoch}", dataset_dir=dataset_dir,
        epoch=epoch, threads=threads,
    )
    make_dirs(ctx.run_dir)
    started = time.perf_counter()
    for name, stage in STAGES:
        t0 = time.perf_counter()
        with acting_as(STAGE_ROLES.get(name)):
            stage(ctx)
        ctx.results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    ctx.results["wall_seconds"] = round(time.perf_counter() - started, 1)
    ctx.results["insecure_plaintext"] = insecure_plaintext()
    atomic_write_text(ctx.run_dir / "demo.json", json.dumps(ctx.results, indent=2, default=str))
    print(f"[demo] epoch {epoch} done in {ctx.results['wall_seconds']} s; "
          f"details in {ctx.run_dir / 'demo.json'}")
    if "report" in ctx.results:
        print(f"[demo] report: {ctx.results['report']}")
    print(_transport_line())
    return ctx


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        run_demo(threads=int(os.environ.get("FLYWHEEL_DEMO_THREADS", "32")))
    except FlywheelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
