"""``make demo``: the flywheel end to end on the embedded default.

Each stage is idempotent where it can be (the teacher is created once and reused; a
second run captures a new epoch of threads with a new seed), prints what it did, and
the run ends with a summary a person can read. Later stages of the pipeline append
themselves to :data:`STAGES`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.errors import FlywheelError
from flywheel.settings import bootstrap_servers, flywheel_home

log = logging.getLogger("flywheel.demo")

DEFAULT_PRESET = "tiny-qwen3-next"


@dataclass
class DemoContext:
    """State shared by the demo stages."""

    home: Path
    bootstrap: str
    teacher_dir: Path
    run_dir: Path
    epoch: int
    threads: int
    results: dict[str, Any] = field(default_factory=dict)


def _stage_broker(ctx: DemoContext) -> None:
    from streams import topics
    from streams.broker import BrokerConfig, EmbeddedBroker

    embedded = EmbeddedBroker(BrokerConfig())
    if ctx.bootstrap == embedded.config.bootstrap:
        embedded.up()
    created = topics.create_topics(ctx.bootstrap, topics.CATALOGUE)
    ctx.results["topics"] = created
    print(f"[broker] {ctx.bootstrap}: {len(created)} catalogue topics ready")


def _stage_teacher(ctx: DemoContext) -> None:
    from replay.teacher import artifact_digest, init_teacher

    if not (ctx.teacher_dir / "config.json").exists():
        init_teacher(ctx.teacher_dir, preset=DEFAULT_PRESET, seed=0)
        print(f"[teacher] created {DEFAULT_PRESET} in {ctx.teacher_dir}")
    else:
        print(f"[teacher] reusing {ctx.teacher_dir}")
    ctx.results["teacher_digest"] = artifact_digest(ctx.teacher_dir)


def _stage_capture(ctx: DemoContext) -> None:
    from replay.capture import CaptureConfig, load_threads
    from replay.capture_cli import _print_summary, run_capture

    config = CaptureConfig(mode="forced", seed=ctx.epoch, interleave=4)
    threads = load_threads(None, ctx.threads, seed=ctx.epoch)
    summary = run_capture(teacher_dir=ctx.teacher_dir, threads=threads, config=config,
                          bootstrap=ctx.bootstrap, expected=ctx.threads)
    ctx.results["capture"] = summary
    print("[capture]", end=" ")
    _print_summary(summary)


STAGES: list[tuple[str, Callable[[DemoContext], None]]] = [
    ("broker", _stage_broker),
    ("teacher", _stage_teacher),
    ("capture", _stage_capture),
]


def _next_epoch(home: Path) -> int:
    runs = home / "demo" / "runs"
    existing = sorted(int(p.name.split("-")[1]) for p in runs.glob("epoch-*") if p.is_dir())
    return existing[-1] + 1 if existing else 0


def run_demo(*, threads: int = 16) -> DemoContext:
    home = flywheel_home()
    epoch = _next_epoch(home)
    ctx = DemoContext(
        home=home, bootstrap=bootstrap_servers(None),
        teacher_dir=home / "teachers" / DEFAULT_PRESET,
        run_dir=home / "demo" / "runs" / f"epoch-{epoch}", epoch=epoch, threads=threads,
    )
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for name, stage in STAGES:
        t0 = time.perf_counter()
        stage(ctx)
        ctx.results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    ctx.results["wall_seconds"] = round(time.perf_counter() - started, 1)
    (ctx.run_dir / "demo.json").write_text(json.dumps(ctx.results, indent=2, default=str))
    print(f"[demo] epoch {epoch} done in {ctx.results['wall_seconds']} s; "
          f"details in {ctx.run_dir / 'demo.json'}")
    return ctx


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        run_demo(threads=int(os.environ.get("FLYWHEEL_DEMO_THREADS", "16")))
    except FlywheelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
