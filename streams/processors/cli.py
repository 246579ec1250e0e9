"""``flywheel streams worker``, ``inspect``, ``accounting`` and ``status``.

Mounted by ``flywheel.cli`` as ``flywheel streams …``; also runnable on its own as
``python -m hebrus_flywheel.streams.processors.cli …`` (the integration tests do that).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

from hebrus_flywheel.core.kafka.security import (
    INSECURE_WARNING,
    declare_role,
    insecure_plaintext,
)
from hebrus_flywheel.core.processes import bound_malloc
from hebrus_flywheel.core.progress import WatchdogConfig
from hebrus_flywheel.core.settings import bootstrap_servers, flywheel_home
from hebrus_flywheel.streams.processors.assemble import AssembleConfig
from hebrus_flywheel.streams.processors.dedup import DedupConfig
from hebrus_flywheel.streams.processors.event_loop import (
    DEFAULT_EVENT_LOOP,
    EVENT_LOOPS,
    use_event_loop,
)
from hebrus_flywheel.streams.processors.pipeline import ProcessorConfig
from hebrus_flywheel.streams.processors.split import SplitConfig
from hebrus_flywheel.streams.processors.window import WindowConfig

streams_app = typer.Typer(
    help="Stream processors: validate → assemble → split → dedup → window.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

_BOOTSTRAP = typer.Option(None, "--bootstrap-servers", help="Kafka bootstrap list.")
_NS_PREFIX = typer.Option(
    None, "--prefix", help="Prefix of every topic and group name: the namespace ('' for the "
    "shared one) (default: $FLYWHEEL_NAMESPACE, else --teacher's, else shared).")
_NS_TEACHER = typer.Option(
    None, "--teacher", help="Use the namespace of this teacher checkpoint directory.")
_APP_ID = typer.Option(
    "flywheel-streams",
    "--app-id",
    help="Worker group: consumer group, changelog and internal topic prefix.",
)


def processor_config(
    *,
    salt: str,
    validation_fraction: float,
    temporal_cut_ms: int | None,
    stress_rate: float,
    runtime_holdout_fraction: float,
    near_threshold: float,
    idle_timeout_s: float,
    context_length: int,
    route_context_length: int,
    order_lateness_s: float = 60.0,
    dedup_bands: bool = False,
) -> ProcessorConfig:
    """The stage configuration from command-line values."""
    return ProcessorConfig(
        assemble=AssembleConfig(idle_timeout_ms=int(idle_timeout_s * 1000)),
        split=SplitConfig(
            salt=salt,
            validation_fraction=validation_fraction,
            temporal_cut_ms=temporal_cut_ms,
            stress_rate=stress_rate,
            runtime_holdout_fraction=runtime_holdout_fraction,
        ),
        dedup=DedupConfig(threshold=near_threshold,
                          order_lateness_ms=int(order_lateness_s * 1000),
                          band_partitioned=dedup_bands),
        window=WindowConfig(
            context_length=context_length, route_context_length=route_context_length
        ),
    )


@streams_app.command("worker")
def worker_command(
    bootstrap: str | None = _BOOTSTRAP,
    prefix: str | None = _NS_PREFIX,
    teacher: Path | None = _NS_TEACHER,
    app_id: str = _APP_ID,
    salt: str = typer.Option("hebrus-flywheel-split-v1", help="Split hash salt."),
    validation_fraction: float = typer.Option(0.1, help="Share of owners in validation."),
    temporal_cut_ms: int | None = typer.Option(None, help="Temporal cut (Unix ms)."),
    stress_rate: float = typer.Option(0.5, help="Share of stress-tagged threads held out."),
    runtime_holdout_fraction: float = typer.Option(0.05, help="Share of decode captures held out."),
    near_threshold: float = typer.Option(0.8, help="Near-duplicate Jaccard threshold."),
    idle_timeout_s: float = typer.Option(300.0, help="Complete a thread after this idle time."),
    context_length: int = typer.Option(2048, help="Most tokens per window."),
    route_context_length: int = typer.Option(8192, help="Context of runtime_holdout windows."),
    tick_interval_s: float = typer.Option(5.0, help="Idle check interval."),
    order_lateness_s: float = typer.Option(60.0, help="How far (wall time) a capture record "
                                           "may trail the latest before it in its partition; "
                                           "dedup decides in event-time order within it."),
    order_grace_s: float = typer.Option(0.5, help="How long a partition caught up with live "
                                        "records waits before dedup decides past it."),
    stats_interval_s: float = typer.Option(30.0, help="Counter log interval."),
    session_timeout_s: float = typer.Option(10.0, help="Kafka group session timeout."),
    drain: bool = typer.Option(False, "--drain", help="Exit 0 once every input partition "
                               "is committed to its end offset (lag 0), outputs acknowledged."),
    drain_timeout_s: float | None = typer.Option(None, help="With --drain: exit non-zero if "
                                                 "the lag is not 0 after this long."),
    stall_timeout_s: float = typer.Option(120.0, help="Exit non-zero on lag with no progress "
                                          "for this long."),
    broker_timeout_s: float = typer.Option(300.0, help="Exit non-zero when the broker stays "
                                           "unreachable this long."),
    data_dir: Path | None = typer.Option(None, help="faust data directory (each worker on one "
                                         "machine needs its own)."),
    standby_replicas: int = typer.Option(1, help="Keep each table partition warm on this "
                                         "many other workers (0: none)."),
    poison_after_crashes: int = typer.Option(3, help="Quarantine a record by reference as "
                                             "'poison' on the next start once it crashed the "
                                             "worker this many times in a row."),
    event_loop: str = typer.Option(DEFAULT_EVENT_LOOP, help="Event loop of the worker: "
                                   f"{' or '.join(EVENT_LOOPS)} (the standard library's)."),
    dedup_bands: bool = typer.Option(False, "--dedup-bands", help="Band-partitioned dedup: "
                                     "its work spreads over workers (every worker of one "
                                     "app id the same; not yet for rebuild --from-capture)."),
) -> None:
    """Run one streams worker (start more with the same --app-id to share partitions)."""
    declare_role("streams")
    bound_malloc()  # before any thread starts: arenas are per thread
    use_event_loop(event_loop)  # before faust creates a loop, the fetch thread's included
    from hebrus_flywheel.streams.processors.app import StreamsWorker, WorkerConfig

    processors = processor_config(
        salt=salt,
        validation_fraction=validation_fraction,
        temporal_cut_ms=temporal_cut_ms,
        stress_rate=stress_rate,
        runtime_holdout_fraction=runtime_holdout_fraction,
        near_threshold=near_threshold,
        idle_timeout_s=idle_timeout_s,
        context_length=context_length,
        route_context_length=route_context_length,
        order_lateness_s=order_lateness_s,
        dedup_bands=dedup_bands,
    )
    from hebrus_flywheel.core.namespace import resolve_prefix

    config = WorkerConfig(
        bootstrap=bootstrap_servers(bootstrap),
        prefix=resolve_prefix(prefix, teacher=teacher),
        app_id=app_id,
        processors=processors,
        tick_interval_s=tick_interval_s,
        order_grace_s=order_grace_s,
        stats_interval_s=stats_interval_s,
        session_timeout_s=session_timeout_s,
        watchdog=WatchdogConfig(drain=drain, drain_timeout_s=drain_timeout_s,
                                stall_timeout_s=stall_timeout_s,
                                broker_timeout_s=broker_timeout_s),
        data_dir=data_dir,
        standby_replicas=standby_replicas,
        poison_after_crashes=poison_after_crashes,
    )
    StreamsWorker(config).run()


@streams_app.command("inspect")
def inspect_command(
    bootstrap: str | None = _BOOTSTRAP,
    prefix: str | None = _NS_PREFIX,
    teacher: Path | None = _NS_TEACHER,
    app_id: str = _APP_ID,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Per-split thread/window counts, dedup counts and quarantine counts by reason."""
    declare_role("streams")
    from hebrus_flywheel.core.namespace import resolve_prefix
    from hebrus_flywheel.streams.processors.inspect import format_summary, summarize_topics

    summary = summarize_topics(bootstrap_servers(bootstrap),
                               prefix=resolve_prefix(prefix, teacher=teacher), app_id=app_id)
    if not as_json and insecure_plaintext():
        typer.secho(INSECURE_WARNING, fg=typer.colors.RED, bold=True)
    typer.echo(json.dumps(summary, sort_keys=True) if as_json else format_summary(summary))


@streams_app.command("accounting")
def accounting_command(
    bootstrap: str | None = _BOOTSTRAP,
    prefix: str | None = _NS_PREFIX,
    teacher: Path | None = _NS_TEACHER,
    app_id: str = _APP_ID,
) -> None:
    """Per capture partition, JSON: records up to the group's committed offset and where
    each went (windowed, quarantined and dropped as a duplicate by reason, pending in an
    open window, ...); ``unaccounted`` (also at the top level) counts consumed records
    found in no output and no open state (see
    ``streams.processors.accounting``). Exits 1 when a state changelog record is no
    state-codec record (``refused_state_records``: refused unread, never run as code)."""
    declare_role("streams")
    from hebrus_flywheel.core.namespace import resolve_prefix
    from hebrus_flywheel.streams.processors.accounting import account

    report = account(bootstrap_servers(bootstrap), prefix=resolve_prefix(prefix, teacher=teacher),
                     app_id=app_id)
    typer.echo(json.dumps(report, sort_keys=True))
    refused = report["refused_state_records"]
    if refused:
        typer.echo(f"refused {len(refused)} state changelog record(s) that are no state-codec "
                   f"record (first: {refused[0]}); they were not decoded and count as no open "
                   "state. Someone wrote to the changelog topic: check its write ACLs, then "
                   "delete the topic's bad records or rebuild the worker state.", err=True)
        raise typer.Exit(1)


_MAX_AGE = typer.Option(None, "--max-age-s", help="Exit 1 unless a health file was written "
                        "this recently (container health checks).")


@streams_app.command("status")
def status_command(max_age_s: float | None = _MAX_AGE) -> None:
    """One line per streams worker from its health file under $FLYWHEEL_HOME/health."""
    declare_role("streams")
    status_exit("streams", max_age_s)


def status_exit(kind: str, max_age_s: float | None) -> None:
    """Print the health lines of ``kind`` workers (shared with ``flywheel replay status``);
    with ``max_age_s``, exit 1 unless one of them is that fresh."""
    import time

    from hebrus_flywheel.core.processes import pid_alive
    from hebrus_flywheel.core.progress import format_health, read_health

    now = time.time()
    records = read_health(flywheel_home(), kind)
    if not records:
        typer.echo(f"no {kind} worker health files under {flywheel_home() / 'health'}")
    for r in records:
        typer.echo(format_health(r, now, alive=pid_alive(int(r["pid"]))))
    if max_age_s is not None and not any(now - r["written_at"] <= max_age_s for r in records):
        raise typer.Exit(1)


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("faust", "aiokafka", "mode"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    streams_app()


if __name__ == "__main__":
    main()
