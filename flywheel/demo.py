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
from pathlib import Path
from typing import Any

from hebrus_flywheel import demo_learn
from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.core.files import atomic_write_text, create_file, make_dirs
from hebrus_flywheel.core.kafka.security import (
    INSECURE_WARNING,
    acting_as,
    insecure_marker,
    insecure_plaintext,
)
from hebrus_flywheel.core.settings import bootstrap_servers, flywheel_home
from hebrus_flywheel.demo_context import (
    ACCOUNTING_FILE,
    DEFAULT_PRESET,
    DEMO_DTYPE,
    DemoContext,
    run_flywheel,
    teacher_name,
)

log = logging.getLogger("hebrus_flywheel.demo")

RED, RESET = "\033[1;31m", "\033[0m"


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
    from hebrus_flywheel.core.execution import Execution
    from hebrus_flywheel.replay.capture import CaptureConfig
    from hebrus_flywheel.replay.capture_cli import _print_summary, run_capture

    config = CaptureConfig(mode="forced", seed=ctx.epoch, interleave=4)
    threads = _epoch_threads(ctx)
    started_ms = time.time() * 1000
    summary = run_capture(teacher_dir=ctx.teacher_dir, threads=threads, config=config,
                          bootstrap=ctx.bootstrap, expected=ctx.threads,
                          execution=Execution(dtype=DEMO_DTYPE))
    # The temporal holdout is "the newest period": threads whose first record was
    # published in the last fifth of this capture.
    ctx.temporal_cut_ms = int(started_ms + 0.8 * (time.time() * 1000 - started_ms))
    ctx.results["capture"] = summary
    if "consent" in ctx.results:
        ctx.results["consent"]["refused_at_capture"] = summary["refused_no_consent"]
    print("[capture]", end=" ")
    _print_summary(summary)


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
    from hebrus_flywheel.salts import split_salt
    from hebrus_flywheel.streams.processors.split import SplitConfig

    path = ctx.home / "demo" / "split-salt"
    if path.is_file():
        return path.read_text().strip()
    salt = DEFAULT_SALT
    if ctx.epoch == 0:
        withheld = ctx.results.get("consent", {}).get("withheld_owner")
        threads = [t for t in _epoch_threads(ctx) if t.owner != withheld]
        config = SplitConfig(salt=DEFAULT_SALT, validation_fraction=VALIDATION_FRACTION,
                             runtime_holdout_fraction=RUNTIME_HOLDOUT_FRACTION)
        found = split_salt(threads, ctx.teacher_dir, config, minimum=SPLIT_MINIMUM)
        if found is None:
            raise FlywheelError(f"{len(threads)} demo threads cannot fill {SPLIT_MINIMUM} "
                                "with distinct threads; raise FLYWHEEL_DEMO_THREADS")
        salt = found
    atomic_write_text(path, salt + "\n")
    return salt


def _stage_streams(ctx: DemoContext) -> None:
    # Small demo epochs need larger evaluation shares than production defaults so that
    # every split (and the parity sample) is non-empty.
    temporal_cut = ctx.temporal_cut_ms or int(time.time() * 1000)
    run_flywheel("streams", "worker", "--drain", "--validation-fraction", str(VALIDATION_FRACTION),
              "--runtime-holdout-fraction", str(RUNTIME_HOLDOUT_FRACTION), "--stress-rate", "0.3",
              "--salt", _split_salt(ctx),
              "--temporal-cut-ms", str(temporal_cut), log_name="streams-worker", ctx=ctx)
    lines = run_flywheel("streams", "inspect", log_name="streams-inspect", ctx=ctx)
    print("[streams] split, dedup and quarantine summary:")
    for line in lines:
        if not line.startswith(("20", "[")):
            print("   ", line)
    ledger = _accounting(ctx)
    print(f"[streams] record accounting: {ledger['totals']['records']} consumed capture "
          f"records, {ledger['unaccounted']} unaccounted ({ctx.run_dir / ACCOUNTING_FILE})")




def _accounting(ctx: DemoContext) -> dict[str, Any]:
    """``flywheel streams accounting`` (the streams role) saved for Gate 1."""
    lines = run_flywheel("streams", "accounting", log_name="streams-accounting", ctx=ctx)
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
         "--dtype", DEMO_DTYPE,
         "--prefix", ""],  # the demo uses the shared namespace (its own broker)
        stdout=create_file(log_path), stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_dataset(ctx, worker)
        lines = run_flywheel("seal", "--epoch", str(ctx.epoch), "--dataset", str(ctx.dataset_dir),
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
    lines = run_flywheel("rebuild", "--snapshot", str(ctx.snapshot_dir), "--out", str(out),
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


STAGES: list[tuple[str, Callable[[DemoContext], None]]] = [
    ("broker", _stage_broker),
    ("teacher", _stage_teacher),
    ("consent", _stage_consent),
    ("capture", _stage_capture),
    ("streams", _stage_streams),
    ("replay", _stage_replay),
    ("rebuild", _stage_rebuild),
    ("candidates", demo_learn.stage_candidates),
    ("predictors", demo_learn.stage_predictors),  # the ablation chooses on validation what to train
    ("train", demo_learn.stage_train),
    ("evaluate", demo_learn.stage_evaluate),
    ("erasure", demo_learn.stage_erasure_drill),
    ("qualify", demo_learn.stage_qualify),
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
    dataset_dir = home / "datasets" / teacher_name()
    epoch = _next_epoch(dataset_dir)
    ctx = DemoContext(
        home=home, bootstrap=bootstrap_servers(None),
        teacher_dir=home / "teachers" / teacher_name(),
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
