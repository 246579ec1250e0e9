"""What the demo's stages share: their context, the teacher's name, sub-commands."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.core.files import create_file

DEFAULT_PRESET = "tiny-qwen3-next"
# The demo's decode runtime and its replay both run the teacher in float64
# (replay.float64): in float32 their kernels round router logits up to ~4e-6 apart, and
# on an AVX-512 CPU about one (anchor, layer) pair in 3,000 then flipped its rank order,
# so the exact parity gate refused 3 of 3 epochs.
DEMO_DTYPE = "float64"
ACCOUNTING_FILE = "streams-accounting.json"


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


def teacher_name() -> str:
    """``tiny-qwen3-next-pretrained`` (issue 17), or the random-weight teacher when
    ``FLYWHEEL_DEMO_TEACHER=random``; datasets are kept apart per teacher."""
    random = os.environ.get("FLYWHEEL_DEMO_TEACHER", "pretrained") == "random"
    return DEFAULT_PRESET if random else f"{DEFAULT_PRESET}-pretrained"


def run_flywheel(*args: str, log_name: str, ctx: DemoContext) -> list[str]:
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


def print_lines(tag: str, lines: list[str]) -> None:
    shown = [line for line in lines if line.strip() and not line.startswith(("20", "[", "WARN"))]
    print(f"[{tag}]")
    for line in shown:
        print("   ", line)
