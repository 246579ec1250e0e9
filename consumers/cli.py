"""CLI of the consumers: ``flywheel replay worker``, ``seal``, ``verify``, ``rebuild``,
``export-plaintext`` and ``snapshots expire``.

``replay_app`` is a typer sub-app (mounted as ``flywheel replay``); ``seal_command``,
``verify_command`` and ``rebuild_command`` are plain command functions (mounted as
``flywheel seal|verify|rebuild``). Nothing heavy (torch, pyarrow) is imported at module
level. Deliberate errors propagate to ``flywheel.cli.main``: message and exit status 2.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import typer

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.execution import ATTENTION_OPTION, DEVICE_OPTION, DTYPE_OPTION
from hebrus_flywheel.core.kafka.security import declare_role
from hebrus_flywheel.core.settings import bootstrap_servers

replay_app = typer.Typer(help="Replay windows through the frozen teacher into shards.",
                         no_args_is_help=True)
snapshots_app = typer.Typer(help="Manage sealed snapshots under a dataset root.",
                            no_args_is_help=True)

_BOOTSTRAP_HELP = "Kafka bootstrap servers (default: $FLYWHEEL_BOOTSTRAP_SERVERS or embedded)."


def _options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--replay-option must be KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


@replay_app.command("worker")
def worker_command(
    teacher: Path = typer.Option(..., "--teacher", help="Teacher checkpoint directory."),
    dataset: Path = typer.Option(..., "--dataset", help="Dataset root for shards."),
    bootstrap: str | None = typer.Option(None, "--bootstrap-servers", help=_BOOTSTRAP_HELP),
    prefix: str | None = typer.Option(
        None, "--prefix", help="Topic-name and group prefix: the namespace ('' for the shared "
        "one) (default: $FLYWHEEL_NAMESPACE, else the teacher's own namespace)."),
    group_id: str = typer.Option("flywheel-replay", "--group-id",
                                 help="Consumer group (within the namespace)."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="Tokenizer directory."),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    attention: str = ATTENTION_OPTION,
    offsets_per_shard: int = typer.Option(256, "--offsets-per-shard",
                                          help="Source offsets per shard (per partition)."),
    row_group_rows: int = typer.Option(8192, "--row-group-rows", help="Rows per row group."),
    weight_encoding: str | None = typer.Option(
        None, "--weight-encoding", help="uint8 | float16 (default: uint8 when the teacher's "
        "weights stay in [0, 1], else float16)."),
    batch_windows: int = typer.Option(8, "--batch-windows", help="Windows per engine call."),
    torch_threads: int | None = typer.Option(None, "--torch-threads",
                                             help="torch intra-op threads (recorded)."),
    replay_option: list[str] = typer.Option([], "--replay-option",
                                            help="ReplayConfig field as KEY=VALUE (repeat)."),
    stop_after_epoch: int | None = typer.Option(None, "--stop-after-epoch",
                                                help="Exit once this epoch is fully written."),
    instance_id: str | None = typer.Option(None, "--instance-id",
                                           help="Static group member id (fast restarts)."),
    session_timeout_s: float = typer.Option(30.0, "--session-timeout-s",
                                            help="Kafka group session timeout."),
    drain: bool = typer.Option(False, "--drain", help="Exit 0 once every window partition "
                               "is committed to its end offset (lag 0)."),
    drain_timeout_s: float | None = typer.Option(None, "--drain-timeout-s",
                                                 help="With --drain: exit non-zero if the "
                                                 "lag is not 0 after this long."),
    stall_timeout_s: float = typer.Option(120.0, "--stall-timeout-s",
                                          help="Exit non-zero on unread lag with no "
                                          "progress for this long."),
    broker_timeout_s: float = typer.Option(300.0, "--broker-timeout-s",
                                           help="Exit non-zero when the broker stays "
                                           "unreachable this long."),
    content_policy: Path | None = typer.Option(
        None, "--content-policy", help="TOML file whose [content_policy] table sets the "
        "secrets and tool-output policy (default: detect-secrets plugins, e-mail and phone "
        "patterns, no excluded roles)."),
) -> None:
    """Consume the window topics, replay windows in prefill, write Parquet shards."""
    from hebrus_flywheel.consumers.content_policy import ContentPolicyConfig, policy_from_file
    declare_role("replay")
    from hebrus_flywheel.consumers.shards import ShardConfig
    from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
    from hebrus_flywheel.core.namespace import resolve_prefix
    from hebrus_flywheel.core.progress import WatchdogConfig
    from hebrus_flywheel.replay.teacher import default_weight_encoding

    weight_encoding = weight_encoding or default_weight_encoding(teacher)
    config = ReplayWorkerConfig(
        teacher=teacher, dataset=dataset, bootstrap=bootstrap_servers(bootstrap),
        prefix=resolve_prefix(prefix, teacher=teacher),
        group_id=group_id, tokenizer_dir=tokenizer, dtype=dtype, device=device,
        attention=attention,
        shard=ShardConfig(offsets_per_shard=offsets_per_shard, row_group_rows=row_group_rows,
                          weight_encoding=weight_encoding),
        batch_windows=batch_windows, torch_threads=torch_threads,
        replay_options=_options(replay_option),
        stop_after_epoch=stop_after_epoch, instance_id=instance_id,
        session_timeout_s=session_timeout_s,
        watchdog=WatchdogConfig(drain=drain, drain_timeout_s=drain_timeout_s,
                                stall_timeout_s=stall_timeout_s,
                                broker_timeout_s=broker_timeout_s),
        content_policy=(ContentPolicyConfig() if content_policy is None
                        else policy_from_file(content_policy)))
    worker = ReplayWorker(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    stats = worker.run()
    typer.echo(json.dumps(stats.report(), indent=2, sort_keys=True))
    if worker.drained:
        typer.echo(worker.drained)


@replay_app.command("candidates")
def candidates_command(
    snapshot: Path = typer.Option(..., "--snapshot", help="Sealed clean epoch directory."),
    out: Path = typer.Option(..., "--out", help="Candidate dataset root (not the clean one)."),
    teacher: Path = typer.Option(..., "--teacher", help="Teacher checkpoint directory."),
    bootstrap: str | None = typer.Option(None, "--bootstrap-servers", help=_BOOTSTRAP_HELP),
    drafter: list[str] = typer.Option(
        ["prompt_lookup", "dense", "teacher_self"], "--drafter",
        help="Drafter(s): prompt_lookup (n-gram lookup in the context, no model), dense (a "
        "small GRU draft model trained on the snapshot's train split), teacher_self (the "
        "teacher drafts greedily: the upper bound)."),
    width: int = typer.Option(4, "--width", help="Candidate paths per anchor (W)."),
    depth: int = typer.Option(4, "--depth", help="Candidate positions per path (B)."),
    anchors_per_window: int = typer.Option(
        4, "--anchors-per-window", help="Anchors drafted per window, evenly spaced."),
    parity_windows: int = typer.Option(
        4, "--parity-windows", help="Windows checked against step-by-step decode (Gate 1)."),
    timeout_s: float = typer.Option(120.0, "--timeout-s", help="Source read timeout."),
    external_workers: bool = typer.Option(
        False, "--external-workers",
        help="Only plan and seal here: `flywheel replay candidate-worker` processes replay "
        "the blocks from the candidate topic."),
    wait_s: float = typer.Option(3600.0, "--wait-s",
                                 help="How long to wait for every block to be reported."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Candidate-path replay of a sealed clean epoch's windows into its own snapshot: plan
    the blocks on the candidate topic, replay them (here unless --external-workers), seal."""
    declare_role("sealer")
    from hebrus_flywheel.consumers.candidate_epoch import (
        CandidateEpochConfig,
        build_candidate_epoch,
    )

    report = build_candidate_epoch(CandidateEpochConfig(
        snapshot=snapshot, out=out, teacher=teacher, bootstrap=bootstrap_servers(bootstrap),
        drafters=tuple(drafter), width=width, depth=depth,
        anchors_per_window=anchors_per_window, parity_windows=parity_windows,
        timeout_s=timeout_s, external_workers=external_workers, wait_s=wait_s))
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    parity = report["parity"]
    typer.echo(f"candidate snapshot {report['snapshot_id']}: {report['rows']} rows in "
               f"{report['shards']} shards ({report['out']})")
    typer.echo(f"  parity vs step-by-step decode: ids {parity['candidate_ids_exact']:.4f}, "
               f"rank {parity['candidate_rank_exact']:.4f}, accepted-prefix digests "
               f"{parity['accepted_prefix_digest_parity']:.4f} over {parity['paths']} paths")
    cost = report["replay_cost_s_per_accepted_token"]
    typer.echo(f"  {report['accepted_tokens']} accepted tokens, "
               f"{'n/a' if cost is None else f'{cost:.4g}'} s of candidate replay per "
               "accepted token")


@replay_app.command("candidate-worker")
def candidate_worker_command(
    teacher: Path = typer.Option(..., "--teacher", help="Teacher checkpoint directory."),
    bootstrap: str | None = typer.Option(None, "--bootstrap-servers", help=_BOOTSTRAP_HELP),
    prefix: str | None = typer.Option(
        None, "--prefix", help="Topic-name and group prefix: the namespace ('' for the shared "
        "one; default: $FLYWHEEL_NAMESPACE or the teacher's)."),
    max_idle_s: float | None = typer.Option(
        None, "--max-idle-s", help="Exit after this long without work (default: run on)."),
    timeout_s: float = typer.Option(120.0, "--timeout-s", help="Window read timeout."),
) -> None:
    """Replay candidate work items (planned by `flywheel replay candidates`) into shards."""
    declare_role("replay")
    from hebrus_flywheel.consumers.candidate_worker import CandidateWorker, CandidateWorkerConfig
    from hebrus_flywheel.core.namespace import resolve_prefix

    worker = CandidateWorker(CandidateWorkerConfig(
        teacher=teacher, bootstrap=bootstrap_servers(bootstrap),
        prefix=resolve_prefix(prefix, teacher=teacher), max_idle_s=max_idle_s,
        timeout_s=timeout_s))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    typer.echo(json.dumps(worker.run().report(), indent=2, sort_keys=True))


@replay_app.command("status")
def status_command(max_age_s: float | None = typer.Option(
        None, "--max-age-s", help="Exit 1 unless a health file was written this recently.",
)) -> None:
    """One line per replay worker from its health file under $FLYWHEEL_HOME/health."""
    declare_role("replay")
    from hebrus_flywheel.streams.processors.cli import status_exit

    status_exit("replay", max_age_s)


def seal_command(
    epoch: int = typer.Option(..., "--epoch", help="Epoch to seal (0, 1, ... in order)."),
    dataset: Path = typer.Option(..., "--dataset", help="Dataset root the workers write."),
    bootstrap: str | None = typer.Option(None, "--bootstrap-servers", help=_BOOTSTRAP_HELP),
    parity: Path | None = typer.Option(None, "--parity",
                                       help="Parity result JSON (else computed on the "
                                            "epoch's runtime_holdout shards)."),
    override_parity: str | None = typer.Option(None, "--override-parity",
                                               help="Reason to seal a non-authoritative "
                                                    "identity (recorded)."),
    timeout_s: float = typer.Option(600.0, "--timeout-s", help="Wait for workers this long."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest summary as JSON."),
    snapshot_root: str | None = typer.Option(
        None, "--snapshot-root", envvar="FLYWHEEL_SNAPSHOT_ROOT",
        help="Also publish the sealed epoch to s3://bucket/prefix (shards first, manifest "
        "last; docs/operations.md). Default: local only."),
) -> None:
    """Record the epoch boundary, wait for the workers, write the manifest, make it read-only."""
    declare_role("sealer")
    from hebrus_flywheel.consumers.seal import SealConfig, seal_epoch

    result = seal_epoch(SealConfig(dataset=dataset, epoch=epoch,
                                   bootstrap=bootstrap_servers(bootstrap), parity_file=parity,
                                   override_parity=override_parity, timeout_s=timeout_s,
                                   snapshot_root=snapshot_root))
    m = result.manifest
    summary = {"snapshot_id": result.snapshot_id, "manifest": str(result.manifest_path),
               "published": result.published.url if result.published else None,
               "already_sealed": result.already_sealed, "epoch": m["epoch"],
               "totals": m["totals"], "splits": m["splits"],
               "parity_authoritative": bool((m["parity"] or {}).get("authoritative")),
               "parity_override": m["parity_override"]}
    if as_json:
        typer.echo(json.dumps(summary, indent=2, sort_keys=True))
        return
    typer.echo(f"sealed epoch {m['epoch']}{' (already sealed)' if result.already_sealed else ''}")
    typer.echo(f"  snapshot id  {result.snapshot_id}")
    typer.echo(f"  manifest     {result.manifest_path}")
    if result.published is not None:
        typer.echo(f"  published    {result.published.url}")
    typer.echo(f"  shards {m['totals']['shards']}  windows {m['totals']['windows']}  "
               f"rows {m['totals']['rows']}  bytes {m['totals']['bytes']}")
    typer.echo(f"  parity authoritative: {summary['parity_authoritative']}"
               + (f"  (OVERRIDDEN: {m['parity_override']['reason']})"
                  if m["parity_override"] else ""))


def verify_command(
    snapshot: str = typer.Argument(..., help="Sealed epoch directory, its manifest.json, or "
                                   "s3://bucket/prefix/epoch=N."),
    snapshot_id: str | None = typer.Option(None, "--snapshot-id", help="Expected snapshot id."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    keys: bool = typer.Option(
        False, "--keys", help="Also decrypt every shard (needs the snapshot's key file) and "
        "check the SHA-256 of its plaintext encoding."),
) -> None:
    """Check every shard's bytes and SHA-256 (no key needed) and that no file is missing
    or extra; with --keys also the decrypted content."""
    from hebrus_flywheel.core.snapshot import verify_snapshot

    report = verify_snapshot(snapshot, expected_id=snapshot_id, keys=keys)
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    checked = ("ciphertext and plaintext digests" if keys else
               "ciphertext digests" if report["encrypted"] else "digests (PLAINTEXT shards)")
    typer.echo(f"ok: snapshot {report['snapshot_id']} (epoch {report['epoch']}), "
               f"{report['shards']} shards, {report['rows']} rows, {report['bytes']} bytes; "
               f"checked {checked}")


def export_command(
    snapshot: str = typer.Argument(..., help="Sealed epoch directory, its manifest.json, or "
                                   "s3://bucket/prefix/epoch=N."),
    out: Path = typer.Option(..., "--out", help="Directory for the plaintext copies."),
) -> None:
    """Write an UNENCRYPTED copy of every shard (checked against the manifest's plaintext
    digests) for tools such as DuckDB that cannot use the project's keys."""
    from hebrus_flywheel.core.snapshot.export import export_plaintext

    written = export_plaintext(snapshot, out)
    typer.echo(f"exported {len(written)} plaintext shards to {out}; they are NOT encrypted: "
               "delete them when done")


def rebuild_command(
    snapshot: str = typer.Option(..., "--snapshot", help="Sealed epoch directory or "
                                 "s3://bucket/prefix/epoch=N."),
    out: Path = typer.Option(..., "--out", help="Output root (epoch=N must not exist)."),
    teacher: Path = typer.Option(..., "--teacher", help="Teacher checkpoint directory."),
    bootstrap: str | None = typer.Option(None, "--bootstrap-servers", help=_BOOTSTRAP_HELP),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="Tokenizer directory."),
    timeout_s: float = typer.Option(120.0, "--timeout-s", help="Source read timeout."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    from_capture: bool = typer.Option(
        False, "--from-capture", help="Also regenerate the windows from the capture topics "
        "(up to the offsets recorded at seal, with every recorded streams configuration) "
        "through the stream processors, require the same ids and digests, replay those."),
) -> None:
    """Replay the window topics up to the snapshot's offsets; require identical shards."""
    declare_role("sealer")
    from hebrus_flywheel.consumers.rebuild import RebuildConfig, rebuild_snapshot

    report = rebuild_snapshot(RebuildConfig(
        snapshot=snapshot, out=out, teacher=teacher, bootstrap=bootstrap_servers(bootstrap),
        tokenizer_dir=tokenizer, timeout_s=timeout_s, from_capture=from_capture))
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    typer.echo(f"rebuilt {report['shards']} shards ({report['rows']} rows) into {report['out']}")
    typer.echo(f"  plaintext byte-identical to snapshot {report['snapshot_id']}: "
               f"{report['identical']}")
    typer.echo(f"  content id {report['rebuilt_content_id']}"
               f"{'' if report['content_id_match'] else ' (differs: writer versions changed)'}")
    typer.echo(f"  rebuilt snapshot id {report['rebuilt_snapshot_id']}"
               f"{'' if report['snapshot_id_match'] else ' (differs: fresh encryption keys)'}")
    if from_capture:
        typer.echo(f"  windows regenerated from capture topics: "
                   f"{report['capture_windows_regenerated']} "
                   f"({report['capture_segments']} streams configuration segment(s))")


@snapshots_app.callback()
def _snapshots() -> None:
    """Manage sealed snapshots under a dataset root (a group even with one command)."""


@snapshots_app.command("expire")
def expire_command(
    dataset: str = typer.Option(..., "--dataset", help="Dataset root (holds epoch=N), or "
                                "an s3://bucket/prefix snapshot root."),
    older_than: str = typer.Option(..., "--older-than", metavar="DURATION",
                                   help="Only snapshots sealed longer ago than this "
                                   "(e.g. 7d, 36h, 90m)."),
    keep: int = typer.Option(1, "--keep", help="The newest N sealed snapshots stay, "
                             "whatever their age."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would go; delete nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Delete the files of old sealed snapshots (never unsealed epochs or the newest N);
    resumes a deletion a killed run left half-done."""
    from hebrus_flywheel.consumers.expire import ExpireConfig, expire_snapshots
    from hebrus_flywheel.consumers.expire_remote import expire_published
    from hebrus_flywheel.consumers.supersede import purge_superseded
    from hebrus_flywheel.core.durations import parse_duration_ms
    from hebrus_flywheel.core.storage import is_object_url

    older_than_ms = parse_duration_ms(older_than, what="--older-than")
    purged: list[dict[str, Any]] = []
    if is_object_url(dataset):
        result = expire_published(dataset, keep=keep, dry_run=dry_run,
                                  older_than_ms=older_than_ms)
    else:
        result = expire_snapshots(ExpireConfig(root=Path(dataset), keep=keep, dry_run=dry_run,
                                               older_than_ms=older_than_ms))
        # snapshots superseded by `flywheel erase` whose grace period ended go too
        purged = [] if dry_run else purge_superseded(Path(dataset))
    if as_json:
        typer.echo(json.dumps({**result.to_json(), "superseded_deleted": purged}, indent=2,
                              sort_keys=True))
        return
    for line in result.lines():
        typer.echo(line)
    for item in purged:
        typer.echo(f"removed      superseded snapshot {item['snapshot_id']} (by "
                   f"{item['superseded_by']}): {len(item['deleted']['files'])} files, "
                   f"{item['deleted']['bytes']} bytes, its erasure grace period ended")


@snapshots_app.command("publish")
def publish_command(
    dataset: Path = typer.Option(..., "--dataset", help="Dataset root holding the sealed "
                                 "epoch=N."),
    epoch: int = typer.Option(..., "--epoch", help="The sealed epoch to publish."),
    snapshot_root: str = typer.Option(..., "--snapshot-root", envvar="FLYWHEEL_SNAPSHOT_ROOT",
                                      help="s3://bucket/prefix to publish to."),
) -> None:
    """Publish (or finish publishing) a sealed local epoch to an s3:// root: shards first,
    manifest last; also publishes a snapshot that supersedes the one there (erasure)."""
    from hebrus_flywheel.consumers.publish import publish_epoch
    from hebrus_flywheel.consumers.shards import epoch_dir

    result = publish_epoch(epoch_dir(dataset, epoch), snapshot_root)
    state = "already published" if result.already_published else "published"
    typer.echo(f"{state}: snapshot {result.snapshot_id} ({result.shards} shards) at "
               f"{result.url}")
