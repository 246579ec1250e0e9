"""``flywheel selftest --teacher DIR``: the whole pipeline, small, on a private namespace.

What a user runs first on their own checkpoint. In a fresh topic namespace
(``<teacher namespace>selftest-<run>.``, see :mod:`core.namespace`) it captures a few
synthetic threads with real KV-cache decode, runs the streams worker and the replay
worker to completion, seals epoch 0 (which runs the parity gate on the
``runtime_holdout`` windows: replayed labels against the decode-captured routes),
verifies the snapshot and trains one step on it.

Every stage prints one JSON line (``{"stage": ..., "ok": true, "seconds": ..., figures}``);
the last line is the verdict, with ``parity_exact`` (the fraction of compared
(anchor, routed layer) pairs whose expert ids AND rank order match exactly) and
``sealed_rows``. A failing stage prints ``{"selftest": "failed", "stage": ..., "reason":
...}`` and the command exits 1. The namespace's topics are deleted afterwards unless
``--keep-topics``; logs and the dataset stay in the work directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from hebrus_flywheel.core.errors import ConfigError, FlywheelError
from hebrus_flywheel.core.execution import (
    ATTENTION_OPTION,
    DEVICE_OPTION,
    DTYPE_OPTION,
    Execution,
)
from hebrus_flywheel.core.files import create_file, make_dirs
from hebrus_flywheel.core.kafka.security import acting_as
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV


class SelftestError(FlywheelError):
    """A stage failed; the message says which and why."""


@dataclass(frozen=True, kw_only=True)
class SelftestConfig:
    """One selftest run.

    Fields:
        teacher: the checkpoint directory under test.
        bootstrap: Kafka bootstrap servers.
        work_dir: where logs, the dataset and the checkpoint go (created).
        namespace: topic/group prefix of this run (private: unique per run).
        threads: synthetic threads to capture.
        seed: seed of the synthetic threads.
        train_steps: training steps on the sealed snapshot.
        stage_timeout_s: longest any one stage may take.
        keep_topics: leave the namespace's topics on the broker afterwards.
        execution: device, compute dtype and attention kernel of capture AND replay
            (parity is established per kernel path; bf16 compute is not exact on CPU,
            so such a run fails at the parity gate and says so).
    """

    teacher: Path
    bootstrap: str
    work_dir: Path
    namespace: str
    threads: int = 8
    seed: int = 0
    train_steps: int = 1
    stage_timeout_s: float = 600.0
    keep_topics: bool = False
    execution: Execution = field(default_factory=Execution)

    def __post_init__(self) -> None:
        if not (self.teacher / "config.json").is_file():
            raise ConfigError(f"teacher: {self.teacher} has no config.json; pass a local "
                              "checkpoint directory (or create one: flywheel teacher init)")
        for name, low in (("threads", 2), ("train_steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if not self.stage_timeout_s > 0:
            raise ConfigError(f"stage_timeout_s must be positive, got {self.stage_timeout_s!r}")
        if not self.namespace or not self.bootstrap:
            raise ConfigError("namespace and bootstrap must be non-empty")


@dataclass
class _Run:
    config: SelftestConfig
    emit: Callable[[dict[str, Any]], None]
    figures: dict[str, Any] = field(default_factory=dict)
    snapshot: Path | None = None
    resolved: Execution | None = None

    @property
    def execution(self) -> Execution:
        """The configured execution, its ``auto`` attention resolved by the teacher stage."""
        return self.resolved or self.config.execution

    @property
    def dataset(self) -> Path:
        return self.config.work_dir / "dataset"


def private_namespace(base: str) -> str:
    """``<base>selftest-<12 hex>.``: a namespace no earlier run used."""
    return f"{base}selftest-{uuid.uuid4().hex[:12]}."


def _flywheel(run: _Run, *args: str, log_name: str) -> list[str]:
    """A ``flywheel`` command as its own process; SelftestError with its log tail."""
    log_path = run.config.work_dir / f"{log_name}.log"
    cmd = [sys.executable, "-m", "hebrus_flywheel.cli", *args]
    with create_file(log_path) as log_file:
        try:
            proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, check=False,
                                  timeout=run.config.stage_timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise SelftestError(f"`flywheel {args[0]}` ran past {exc.timeout:.0f} s; see "
                                f"{log_path}") from exc
    lines = log_path.read_text(errors="replace").splitlines()
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in lines[-6:] if line.strip())
        raise SelftestError(f"`flywheel {' '.join(args[:2])}` exited {proc.returncode}: "
                            f"{tail} (log: {log_path})")
    return lines


def _json_tail(lines: list[str]) -> dict[str, Any]:
    """The JSON object a ``--json`` command printed last."""
    starts = [i for i, line in enumerate(lines) if line.startswith("{")]
    for start in reversed(starts):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads("\n".join(lines[start:]))
            if isinstance(value, dict):
                return value
    raise SelftestError("a --json command printed no JSON object")


# --- stages -------------------------------------------------------------------------------


def _stage_teacher(run: _Run) -> dict[str, Any]:
    from hebrus_flywheel.replay.teacher import (
        DEFAULT_EXPERTS_IMPLEMENTATION,
        read_geometry,
        resolve_attention,
    )

    geometry = read_geometry(run.config.teacher)
    attention = resolve_attention(run.config.teacher, run.config.execution.attention)
    run.resolved = execution = run.config.execution.with_attention(attention)
    run.figures["family"] = geometry.family
    run.figures["kernel_path"] = execution.kernel_path(DEFAULT_EXPERTS_IMPLEMENTATION)
    run.figures["dtype"] = execution.dtype
    return {"family": geometry.family, "dtype": execution.dtype,
            "device": execution.device, "attention": execution.attention,
            "routed_layers": list(geometry.routed_layers),
            "experts": geometry.expert_count, "top_k": geometry.top_k,
            "weight_rule": geometry.weight_rule, "namespace": run.config.namespace}


def _stage_topics(run: _Run) -> dict[str, Any]:
    from hebrus_flywheel.streams.acls import grant_catalogue
    from hebrus_flywheel.streams.topics import catalogue, create_topics

    specs = catalogue(run.config.namespace)
    create_topics(run.config.bootstrap, specs)
    grant_catalogue(run.config.bootstrap, run.config.namespace)
    return {"topics": len(specs)}


def _stage_consent(run: _Run) -> dict[str, Any]:
    """Grant every scope to the synthetic owners on the private namespace's consent
    ledger: capture, replay, seal and train all check it (fail closed)."""
    from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer
    from hebrus_flywheel.replay.capture import load_threads
    from hebrus_flywheel.streams.consent import CONSENT_TOPIC, SCOPES, grant, now_ms
    from hebrus_flywheel.streams.consent_book import write_entries

    names = Pseudonymizer(LocalOwnerKeyStore(create=True))
    owners = sorted({names.owner(t.owner) for t in
                     load_threads(None, run.config.threads, seed=run.config.seed)})
    start = now_ms()
    write_entries(run.config.bootstrap, [
        grant(owner, SCOPES, granted_at_ms=start, expires_at_ms=start + 86_400_000,
              policy_version="selftest", granted_by="flywheel selftest") for owner in owners],
        topic=run.config.namespace + CONSENT_TOPIC)
    return {"owners": len(owners), "scopes": list(SCOPES)}


def _stage_capture(run: _Run) -> dict[str, Any]:
    from hebrus_flywheel.replay.capture import CaptureConfig, load_threads
    from hebrus_flywheel.replay.capture_cli import run_capture

    config = CaptureConfig(mode="forced", seed=run.config.seed, interleave=4)
    threads = load_threads(None, run.config.threads, seed=run.config.seed)
    summary = run_capture(teacher_dir=run.config.teacher, threads=threads, config=config,
                          bootstrap=run.config.bootstrap, topic_prefix=run.config.namespace,
                          create_topics=False, execution=run.execution)
    if summary["failed"] or summary["dropped"] or sum(summary["rejected"].values()):
        raise SelftestError(f"capture lost records: failed {summary['failed']}, dropped "
                            f"{summary['dropped']}, rejected {summary['rejected']}")
    run.figures["identity_id"] = summary["identity_id"]
    run.figures["decode_tokens_per_s"] = round(summary["decode_tokens_per_s"], 1)
    return {k: summary[k] for k in ("threads", "turns", "decoded_tokens", "observations",
                                    "identity_id")}


VALIDATION_FRACTION, RUNTIME_HOLDOUT_FRACTION = 0.2, 0.5


def split_salt(run: _Run) -> str:
    """A split salt under which the synthetic threads fill train, validation and the
    runtime holdout (training needs the first two, the parity gate the third)."""
    from hebrus_flywheel.replay.capture import load_threads
    from hebrus_flywheel.salts import split_salt as search
    from hebrus_flywheel.streams.processors.split import SplitConfig

    threads = list(load_threads(None, run.config.threads, seed=run.config.seed))
    config = SplitConfig(salt="flywheel-selftest", validation_fraction=VALIDATION_FRACTION,
                         runtime_holdout_fraction=RUNTIME_HOLDOUT_FRACTION)
    salt = search(threads, run.config.teacher, config,
                  minimum={"train": 1, "validation": 1, "runtime_holdout": 1})
    if salt is None:
        raise SelftestError(f"{len(threads)} threads cannot fill train, validation and the "
                            "runtime holdout with distinct threads; capture more threads "
                            "(--threads)")
    return salt


def _stage_streams(run: _Run) -> dict[str, Any]:
    salt = split_salt(run)
    _flywheel(run, "streams", "worker", "--drain", "--bootstrap-servers", run.config.bootstrap,
              "--prefix", run.config.namespace, "--salt", salt,
              "--validation-fraction", str(VALIDATION_FRACTION),
              "--runtime-holdout-fraction", str(RUNTIME_HOLDOUT_FRACTION), "--stress-rate", "0.0",
              "--drain-timeout-s", str(run.config.stage_timeout_s), log_name="streams-worker")
    return {"split_salt": salt}


def _stage_replay_and_seal(run: _Run) -> dict[str, Any]:
    log_path = run.config.work_dir / "replay-worker.log"
    cmd = [sys.executable, "-m", "hebrus_flywheel.cli", "replay", "worker", "--teacher",
           str(run.config.teacher), "--dataset", str(run.dataset), "--bootstrap-servers",
           run.config.bootstrap, "--prefix", run.config.namespace, "--drain",
           *_execution_args(run.execution)]
    with create_file(log_path) as log_file:
        worker = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_for_dataset(run, worker, log_path)
        lines = _flywheel(run, "seal", "--epoch", "0", "--dataset", str(run.dataset),
                          "--bootstrap-servers", run.config.bootstrap, "--json",
                          "--timeout-s", str(run.config.stage_timeout_s), log_name="seal")
        status = worker.wait(timeout=run.config.stage_timeout_s)
    finally:
        if worker.poll() is None:
            worker.terminate()
            worker.wait(timeout=30)
    if status != 0:
        raise SelftestError(f"the replay worker exited {status}; see {log_path}")
    summary = _json_tail(lines)
    run.snapshot = Path(summary["manifest"]).parent
    return _parity_figures(run, summary)


def _execution_args(execution: Execution) -> list[str]:
    return ["--device", execution.device, "--dtype", execution.dtype,
            "--attention", execution.attention]


def _wait_for_dataset(run: _Run, worker: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + run.config.stage_timeout_s
    while not (run.dataset / "dataset.json").exists():
        if worker.poll() is not None:
            raise SelftestError(f"the replay worker exited ({worker.returncode}) before "
                                f"writing anything; see {log_path}")
        if time.monotonic() > deadline:
            raise SelftestError(f"the replay worker wrote nothing in "
                                f"{run.config.stage_timeout_s:.0f} s; see {log_path}")
        time.sleep(0.5)


def _parity_figures(run: _Run, summary: dict[str, Any]) -> dict[str, Any]:
    manifest = json.loads(Path(summary["manifest"]).read_text(encoding="utf-8"))
    parity = manifest.get("parity") or {}
    pairs, mismatched = int(parity.get("pairs") or 0), int(parity.get("mismatched_pairs") or 0)
    if not pairs:
        raise SelftestError("no runtime_holdout pair was compared, so parity is unproven; "
                            "capture more threads (--threads)")
    exact = (pairs - mismatched) / pairs
    run.figures.update(parity_exact=exact, parity_pairs=pairs,
                       sealed_rows=int(summary["totals"]["rows"]),
                       max_weight_abs_diff=parity.get("max_weight_abs_diff"))
    return {"parity_exact": exact, "parity_pairs": pairs, "mismatched_pairs": mismatched,
            "parity_authoritative": summary["parity_authoritative"],
            "sealed_rows": summary["totals"]["rows"], "splits": sorted(summary["splits"]),
            "snapshot_id": summary["snapshot_id"]}


def _stage_verify(run: _Run) -> dict[str, Any]:
    report = _json_tail(_flywheel(run, "verify", str(run.snapshot), "--json",
                                  log_name="verify"))
    return {"shards": report["shards"], "rows": report["rows"]}


def _stage_train(run: _Run) -> dict[str, Any]:
    out = run.config.work_dir / "checkpoint"
    _flywheel(run, "train", "--snapshot", str(run.snapshot), "--out", str(out), "--max-steps",
              str(run.config.train_steps), "--no-progress", log_name="train")
    return {"steps": run.config.train_steps, "checkpoint": str(out)}


STAGES: list[tuple[str, Callable[[_Run], dict[str, Any]], str | None]] = [
    ("teacher", _stage_teacher, None),
    ("topics", _stage_topics, "admin"),
    ("consent", _stage_consent, "admin"),
    ("capture", _stage_capture, "runtime"),
    ("streams", _stage_streams, None),
    ("replay_seal", _stage_replay_and_seal, None),
    ("verify", _stage_verify, None),
    ("train", _stage_train, None),
]


def namespace_topics(bootstrap: str, namespace: str) -> list[str]:
    """Every topic of ``namespace``: the catalogue and the workers' internal topics."""
    from hebrus_flywheel.streams.topics import admin_client

    names = admin_client(bootstrap).list_topics(timeout=30).topics
    return sorted(name for name in names if name.startswith(namespace))


def _cleanup(run: _Run) -> None:
    """Delete the run's topics (best effort: a failure leaves them, and says so)."""
    if run.config.keep_topics:
        return
    from hebrus_flywheel.streams.topics import delete_topics

    with acting_as("admin"):
        try:
            delete_topics(run.config.bootstrap,
                          namespace_topics(run.config.bootstrap, run.config.namespace))
        except Exception as exc:  # cleanup must not hide the verdict
            run.emit({"cleanup": "failed", "namespace": run.config.namespace,
                      "reason": f"{type(exc).__name__}: {exc}"})


def run_selftest(config: SelftestConfig, *, emit: Callable[[dict[str, Any]], None]
                 ) -> dict[str, Any]:
    """Run every stage, emitting one JSON-ready dict per stage and the verdict last;
    returns the verdict (``selftest`` is ``passed`` or ``failed``)."""
    make_dirs(config.work_dir)
    run = _Run(config=config, emit=emit)
    before = os.environ.get(BOOTSTRAP_ENV)
    os.environ[BOOTSTRAP_ENV] = config.bootstrap  # the commands it starts use the same broker
    started = time.perf_counter()
    try:
        failure = _run_stages(run)
    finally:
        _cleanup(run)
        if before is None:
            os.environ.pop(BOOTSTRAP_ENV, None)
        else:
            os.environ[BOOTSTRAP_ENV] = before
    verdict: dict[str, Any] = failure or {"selftest": "passed", **run.figures}
    verdict.update(namespace=config.namespace, seconds=round(time.perf_counter() - started, 1),
                   work_dir=str(config.work_dir))
    emit(verdict)
    return verdict


def _run_stages(run: _Run) -> dict[str, Any] | None:
    """Every stage in order; the failed verdict of the first that fails, else None."""
    for name, stage, role in STAGES:
        t0 = time.perf_counter()
        try:
            with acting_as(role):
                figures = stage(run)
        except Exception as exc:  # any failure is the verdict, with its reason
            reason = str(exc) if isinstance(exc, FlywheelError) else \
                f"{type(exc).__name__}: {exc}"
            return {"selftest": "failed", "stage": name, "reason": reason}
        run.emit({"stage": name, "ok": True, "seconds": round(time.perf_counter() - t0, 1),
                  **figures})
    return None


def _ensure_broker(bootstrap: str) -> None:
    """Start this home's embedded broker when ``bootstrap`` names it and it is down."""
    from hebrus_flywheel.core.kafka.security import insecure_marker
    from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker, probe_metadata

    embedded = EmbeddedBroker(BrokerConfig(insecure_plaintext=insecure_marker().is_file()))
    if bootstrap == embedded.config.bootstrap and not probe_metadata(bootstrap, 5.0):
        embedded.up()


def selftest_command(
    teacher: Path = typer.Option(..., "--teacher", help="Checkpoint directory to test."),
    threads: int = typer.Option(8, "--threads", help="Synthetic threads to capture."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic threads."),
    prefix: str | None = typer.Option(
        None, "--prefix", help="Namespace the private run namespace goes under (default: "
        "$FLYWHEEL_NAMESPACE, else the teacher's namespace)."),
    work_dir: Path | None = typer.Option(
        None, "--work-dir", help="Logs, dataset and checkpoint (default: "
        "$FLYWHEEL_HOME/selftest/<run namespace>)."),
    train_steps: int = typer.Option(1, "--train-steps", help="Training steps on the snapshot."),
    stage_timeout_s: float = typer.Option(600.0, "--stage-timeout-s",
                                          help="Fail a stage that runs longer than this."),
    keep_topics: bool = typer.Option(False, "--keep-topics",
                                     help="Leave the run's topics on the broker."),
    bootstrap: str | None = typer.Option(
        None, "--bootstrap-servers", help="Kafka bootstrap (default: env or embedded broker)."),
    device: str = DEVICE_OPTION,
    dtype: str = DTYPE_OPTION,
    attention: str = ATTENTION_OPTION,
) -> None:
    """Capture, stream, replay, parity, seal, verify and train one step, on a private topic
    namespace; one JSON line per stage, exit 1 with the reason if any stage fails."""
    from hebrus_flywheel.core.namespace import resolve_prefix
    from hebrus_flywheel.core.settings import bootstrap_servers, flywheel_home

    servers = bootstrap_servers(bootstrap)
    namespace = private_namespace(resolve_prefix(prefix, teacher=teacher))
    config = SelftestConfig(
        teacher=teacher.resolve(), bootstrap=servers, namespace=namespace,
        work_dir=(work_dir or flywheel_home() / "selftest" / namespace.rstrip(".")).resolve(),
        threads=threads, seed=seed, train_steps=train_steps,
        stage_timeout_s=stage_timeout_s, keep_topics=keep_topics,
        execution=Execution(device=device, dtype=dtype, attention=attention))
    _ensure_broker(servers)
    verdict = run_selftest(config, emit=lambda line: typer.echo(json.dumps(line, default=str)))
    if verdict["selftest"] != "passed":
        raise typer.Exit(1)
