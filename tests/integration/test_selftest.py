"""``flywheel selftest`` on a tiny checkpoint of every generated MoE family.

Each run captures six synthetic threads on a private namespace of the session broker,
streams, replays, seals (the parity gate), verifies and trains one step; it must pass
with exact route parity, and its topics must be gone afterwards. One run also goes
through the CLI to check the JSON lines and the exit status; one is made to fail.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hebrus_flywheel.core.execution import Execution
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV
from hebrus_flywheel.replay.adapters import adapter_for
from hebrus_flywheel.replay.checkpoint import INDEX_FILE, CheckpointStorage, stored_dtypes
from hebrus_flywheel.replay.families import FAMILIES
from hebrus_flywheel.replay.teacher import init_teacher
from hebrus_flywheel.selftest import (
    SelftestConfig,
    namespace_topics,
    private_namespace,
    run_selftest,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
THREADS = 6


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("selftest-teachers")


def _teacher(base: Path, family: str) -> Path:
    target = base / family
    if not (target / "config.json").is_file():
        init_teacher(target, family=family, seed=2)
    return target


def _topics_gone(bootstrap: str, namespace: str) -> bool:
    deadline = time.monotonic() + 30
    while namespace_topics(bootstrap, namespace):
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


@pytest.mark.family_matrix
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_selftest_passes_with_exact_parity(
    family: str, teachers: Path, kafka_bootstrap: str, tmp_path: Path
) -> None:
    lines: list[dict[str, Any]] = []
    config = SelftestConfig(teacher=_teacher(teachers, family), bootstrap=kafka_bootstrap,
                            work_dir=tmp_path / "run", namespace=private_namespace("it-"),
                            threads=THREADS)  # attention auto: what the family supports
    verdict = run_selftest(config, emit=lines.append)
    assert verdict["selftest"] == "passed", verdict
    assert verdict["family"] == adapter_for(family).model_type  # a composite's text family
    assert verdict["parity_exact"] == 1.0 and verdict["parity_pairs"] > 0
    assert verdict["sealed_rows"] > 0
    stages = [line["stage"] for line in lines if "stage" in line]
    assert stages == ["teacher", "topics", "consent", "capture", "streams", "replay_seal",
                      "verify", "train"]
    teacher_line = lines[0]
    assert teacher_line["routed_layers"]  # the routed-layer map is reported
    assert teacher_line["attention"] == FAMILIES[family].attention
    assert f"attention={FAMILIES[family].attention};" in verdict["kernel_path"]
    assert _topics_gone(kafka_bootstrap, config.namespace)


@pytest.fixture(scope="module")
def sharded_bf16(teachers: Path) -> Path:
    """A checkpoint stored like a real one: bf16 tensors in safetensors shards + index."""
    target = teachers / "qwen3_moe-sharded-bf16"
    if not (target / INDEX_FILE).is_file():
        init_teacher(target, family="qwen3_moe", seed=2, storage=CheckpointStorage(
            weights_dtype="bfloat16", max_shard_size="200KB"))
    assert stored_dtypes(target) == ["BF16"]
    return target


def test_selftest_on_a_sharded_bf16_checkpoint_in_fp32_is_exact(
    sharded_bf16: Path, kafka_bootstrap: str, tmp_path: Path
) -> None:
    lines: list[dict[str, Any]] = []
    config = SelftestConfig(teacher=sharded_bf16, bootstrap=kafka_bootstrap,
                            work_dir=tmp_path / "run", namespace=private_namespace("it-"),
                            threads=THREADS, execution=Execution(dtype="float32"))
    verdict = run_selftest(config, emit=lines.append)
    assert verdict["selftest"] == "passed", verdict
    assert verdict["parity_exact"] == 1.0 and verdict["parity_pairs"] > 0
    assert verdict["kernel_path"] == "device=cpu;attention=sdpa;experts=tiled_mm"
    [path] = (Path(verdict["work_dir"]) / "dataset").rglob("manifest.json")
    manifest = json.loads(path.read_text())
    assert manifest["teacher"]["kernel_path"] == verdict["kernel_path"]
    assert manifest["identity"]["kernel_path"] == verdict["kernel_path"]
    assert manifest["parity"]["kernel_path"] == verdict["kernel_path"]


def test_selftest_in_bf16_compute_fails_at_the_parity_gate_and_says_why(
    sharded_bf16: Path, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """bf16 compute is not exact between decode and prefill on this CPU (measured by
    bench/kernel_parity.py): the selftest must not pass, and must name the path."""
    config = SelftestConfig(teacher=sharded_bf16, bootstrap=kafka_bootstrap,
                            work_dir=tmp_path / "run", namespace=private_namespace("it-"),
                            threads=THREADS, execution=Execution(dtype="bfloat16"))
    verdict = run_selftest(config, emit=lambda line: None)
    assert verdict["selftest"] == "failed" and verdict["stage"] == "replay_seal", verdict
    assert "not authoritative" in verdict["reason"] and "bfloat16" in verdict["reason"]
    assert "attention=sdpa" in verdict["reason"]


def test_cli_prints_json_lines_and_fails_with_the_stage(
    teachers: Path, kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import typer

    from hebrus_flywheel.selftest import selftest_command

    app = typer.Typer()
    app.command()(selftest_command)
    monkeypatch.setenv(BOOTSTRAP_ENV, kafka_bootstrap)
    teacher = _teacher(teachers, "qwen3_moe")
    bad = tmp_path / "no-tokenizer"
    bad.mkdir()
    for item in teacher.iterdir():
        if item.name.endswith((".json", ".safetensors")) and not item.name.startswith("token"):
            (bad / item.name).write_bytes(item.read_bytes())
    result = CliRunner().invoke(app, ["--teacher", str(bad), "--threads", "2",
                                      "--work-dir", str(tmp_path / "bad")])
    assert result.exit_code == 1, result.output
    verdict = json.loads(result.output.strip().splitlines()[-1])
    assert verdict["selftest"] == "failed" and verdict["stage"] == "capture"
    assert "tokenizer" in verdict["reason"]
