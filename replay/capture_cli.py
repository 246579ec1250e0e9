"""``flywheel capture``: decode agent threads on the reference runtime and publish them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from hebrus_flywheel.core.execution import ATTENTION_OPTION, DEVICE_OPTION, DTYPE_OPTION
from hebrus_flywheel.core.files import atomic_write_json
from hebrus_flywheel.core.kafka.security import declare_role
from hebrus_flywheel.core.settings import bootstrap_servers


def capture_command(
    teacher: Path = typer.Option(..., "--teacher", help="Teacher checkpoint directory."),
    threads: Path | None = typer.Option(
        None, "--threads", help="JSONL of agent threads (chat-messages format)."
    ),
    synthetic: int | None = typer.Option(
        None, "--synthetic", help="Generate N deterministic agent-shaped threads instead."
    ),
    seed: int = typer.Option(0, help="Seed for synthetic threads and sampling."),
    mode: str = typer.Option("forced", help="forced | greedy | sample"),
    max_new_tokens: int = typer.Option(96, help="Cap per assistant turn (greedy/sample)."),
    interleave: int = typer.Option(4, help="Threads decoded round-robin at once."),
    topic_prefix: str | None = typer.Option(
        None, "--topic-prefix", "--prefix", help="Topic-name prefix: the namespace ('' for the "
        "shared one) (default: $FLYWHEEL_NAMESPACE, else the teacher's own namespace)."),
    create_topics: bool = typer.Option(True, help="Create missing capture topics first."),
    summary_json: Path | None = typer.Option(None, help="Also write the summary here."),
    bootstrap: str | None = typer.Option(
        None, "--bootstrap-servers", help="Kafka bootstrap (default: env or embedded broker)."
    ),
    device: str = DEVICE_OPTION,
    dtype: str = DTYPE_OPTION,
    attention: str = ATTENTION_OPTION,
) -> None:
    """Run real KV-cache decode on threads and publish identities, turns and routes."""
    declare_role("runtime")
    from hebrus_flywheel.core.execution import Execution
    from hebrus_flywheel.replay.capture import CaptureConfig, load_threads

    execution = Execution(device=device, dtype=dtype, attention=attention)
    config = CaptureConfig(mode=mode, seed=seed, max_new_tokens=max_new_tokens,
                           interleave=interleave)
    from hebrus_flywheel.core.namespace import resolve_prefix

    source = load_threads(threads, synthetic, seed=seed)
    prefix = resolve_prefix(topic_prefix, teacher=teacher)
    typer.echo(f"namespace {prefix or '(shared)'!s}")
    summary = run_capture(
        teacher_dir=teacher, threads=source, config=config,
        bootstrap=bootstrap_servers(bootstrap), topic_prefix=prefix,
        create_topics=create_topics, expected=synthetic, execution=execution,
    )
    _print_summary(summary)
    if summary_json is not None:
        atomic_write_json(summary_json, summary)


def run_capture(
    *, teacher_dir: Path, threads: Any, config: Any, bootstrap: str, topic_prefix: str = "",
    create_topics: bool = True, expected: int | None = None, execution: Any = None,
) -> dict[str, Any]:
    """Load the teacher (on ``execution``, a :class:`core.execution.Execution`; default
    cpu/float32/sdpa), decode ``threads`` and publish; returns the summary as a dict."""
    from tqdm import tqdm

    from hebrus_flywheel.core.execution import Execution
    from hebrus_flywheel.replay.capture import CaptureSession
    from hebrus_flywheel.replay.decode import DecodeRuntime
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher
    from hebrus_flywheel.replay.tokenizer import load_tokenizer
    from hebrus_flywheel.streams import topics
    from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher

    run_on = execution or Execution()
    teacher = load_teacher(teacher_dir, dtype=run_on.dtype, device=run_on.device,
                           attention=run_on.attention)
    identity = build_runtime_identity(teacher, teacher_dir)
    if create_topics:  # only what capture writes: the runtime role may create nothing else
        topics.create_topics(bootstrap, [s for s in topics.catalogue(prefix=topic_prefix)
                                         if s.name.startswith(topic_prefix + "flywheel.capture.")])
    pub_config = PublisherConfig(
        bootstrap_servers=bootstrap,
        identities_topic=topic_prefix + topics.IDENTITIES_TOPIC,
        transcripts_topic=topic_prefix + topics.TRANSCRIPTS_TOPIC,
        observations_topic=topic_prefix + topics.OBSERVATIONS_TOPIC,
        consent_topic=topic_prefix + topics.CONSENT_TOPIC,
        full_policy="block_then_raise", max_block_ms=60_000,
        vocab_size=teacher.vocab_size,
    )
    with RuntimePublisher(pub_config, identity=identity) as publisher:
        session = CaptureSession(
            runtime=DecodeRuntime(teacher), tokenizer=load_tokenizer(teacher_dir),
            identity=identity, publisher=publisher, config=config,
        )
        with tqdm(total=expected, unit="thread", desc="capture", leave=False) as bar:
            summary = session.run(_counting(threads, bar))
        publisher.flush()
    stats = publisher.stats()
    summary.delivered, summary.failed = stats.delivered, stats.failed
    summary.dropped = stats.dropped_queue_full + stats.dropped_on_close
    summary.refused_no_consent = stats.refused_no_consent
    summary.rejected = dict(stats.rejected_invalid)
    summary.bytes_on_wire = dict(stats.bytes_on_wire)
    return summary.as_dict()


def _counting(items: Any, bar: Any) -> Any:
    for item in items:
        bar.update(1)
        yield item


def _print_summary(summary: dict[str, Any]) -> None:
    wire = sum(summary["bytes_on_wire"].values())
    tokens = max(summary["decoded_tokens"], 1)
    typer.echo(
        f"captured {summary['threads']} threads, {summary['turns']} turns, "
        f"{summary['decoded_tokens']} decoded tokens → {summary['observations']} route "
        f"observations\n"
        f"  identity   {summary['identity_id']}\n"
        f"  decode     {summary['decode_tokens_per_s']:.1f} tokens/s "
        f"({summary['decode_seconds']:.1f} s in decode steps, "
        f"{summary['wall_seconds']:.1f} s wall)\n"
        f"  delivered  {summary['delivered']} records, {wire} bytes on the wire "
        f"({wire / tokens:.0f} bytes per decoded token)\n"
        f"  dropped    {summary['dropped']}   failed {summary['failed']}   "
        f"rejected {sum(summary['rejected'].values())}   "
        f"refused (no consent) {summary['refused_no_consent']}"
    )
    if summary["refused_no_consent"]:
        typer.echo("  some owners have no live capture grant: their records were not published "
                   "(`flywheel consent list`; grant with `flywheel consent grant`)")
