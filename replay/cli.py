"""``flywheel teacher …``: create and describe frozen teachers (typer sub-app).

torch and transformers are imported inside the commands, never at module level, so the
rest of the CLI starts fast. Errors raised on purpose (:class:`FlywheelError`) propagate
to ``flywheel.cli.main``, which prints them and exits with status 2.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

teacher_app = typer.Typer(help="Create or describe a frozen teacher.", no_args_is_help=True)


@teacher_app.command("init")
def init_command(
    out: Path = typer.Option(..., "--out", help="Directory to create the teacher in."),
    preset: str = typer.Option("tiny-qwen3-next", "--preset",
                               help="Qwen3-Next preset name (with the default family)."),
    family: str = typer.Option("qwen3_next", "--family",
                               help="MoE family to generate (`flywheel teacher families`)."),
    seed: int = typer.Option(0, "--seed", help="Weight-init seed (same seed, same digest)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out."),
    weights_dtype: str = typer.Option("float32", "--weights-dtype",
                                      help="Stored weight dtype: float32, bfloat16, float16."),
    max_shard_size: str = typer.Option(
        "50GB", "--max-shard-size", help="Largest safetensors shard (e.g. 200KB); a bigger "
        "checkpoint is sharded with model.safetensors.index.json."),
) -> None:
    """Create a deterministic tiny random teacher checkpoint (weights + tokenizer) in --out."""
    from hebrus_flywheel.replay.checkpoint import CheckpointStorage
    from hebrus_flywheel.replay.teacher import artifact_digest, init_teacher

    storage = CheckpointStorage(weights_dtype=weights_dtype, max_shard_size=max_shard_size)
    start = time.perf_counter()
    path = init_teacher(out, preset=preset, seed=seed, overwrite=overwrite, family=family,
                        storage=storage)
    elapsed = time.perf_counter() - start
    name = preset if family == "qwen3_next" else f"tiny-{family}"
    typer.echo(f"created teacher {name} (seed {seed}) in {path} [{elapsed:.1f} s]")
    typer.echo(f"  model_artifact_digest  {artifact_digest(path)}")


@teacher_app.command("families")
def families_command(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List the MoE families that load as teachers and that `teacher init` can generate."""
    from hebrus_flywheel.replay.adapters import ADAPTERS
    from hebrus_flywheel.replay.families import FAMILIES
    from hebrus_flywheel.replay.refused import REFUSED_FAMILIES

    rows = {name: {"generate": name in FAMILIES,
                   "summary": FAMILIES[name].summary if name in FAMILIES else ""}
            for name in sorted({*ADAPTERS, *FAMILIES})}  # composites are generated too
    for name, why in sorted(REFUSED_FAMILIES.items()):  # listed with the reason, not loadable
        rows[name] = {"generate": False, "refused": True, "summary": f"not a teacher: {why}"}
    rows = dict(sorted(rows.items()))
    if as_json:
        typer.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    for name, row in rows.items():
        typer.echo(f"{name:14} {row['summary']}")


def describe_teacher(directory: Path, *, dtype: str = "float32") -> dict[str, Any]:
    """Family, geometry, stored weights, digests and runtime identity of a teacher."""
    from hebrus_flywheel.replay.checkpoint import stored_dtypes, weight_files
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher, read_manifest

    teacher = load_teacher(directory, dtype=dtype)
    files = weight_files(teacher.path)
    geometry = teacher.geometry
    config = teacher.model.config
    return {
        "path": str(teacher.path),
        "family": geometry.family,
        "manifest": read_manifest(teacher.path),
        "layer_count": geometry.layer_count,
        "routed_layers": list(geometry.routed_layers),
        "layer_types": list(getattr(config, "layer_types", None) or []),
        "parameters": sum(p.numel() for p in teacher.model.parameters()),
        "vocab_size": teacher.vocab_size,
        "eos_token_ids": list(teacher.eos_token_ids),
        "weight_files": [p.name for p in files],
        "stored_dtypes": stored_dtypes(teacher.path),
        "identity": build_runtime_identity(teacher),
    }


@teacher_app.command("describe")
def describe_command(
    directory: Path = typer.Argument(..., help="Teacher checkpoint directory."),
    dtype: str = typer.Option("float32", "--dtype", help="Compute dtype to load with."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Print family, routing geometry, digests and the runtime identity id."""
    info = describe_teacher(directory, dtype=dtype)
    if as_json:
        typer.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    identity = info.pop("identity")
    info.pop("manifest")
    for key, value in info.items():
        typer.echo(f"{key:26} {value}")
    for key, value in identity.items():
        typer.echo(f"{key:26} {value}")


@teacher_app.command("pretrain")
def pretrain_command(
    out: Path | None = typer.Option(None, "--out", help="Teacher directory [default: "
                                    "$FLYWHEEL_HOME/teachers/PRESET-pretrained]."),
    preset: str = typer.Option("tiny-qwen3-next", "--preset", help="Teacher preset name."),
    seed: int = typer.Option(0, "--seed", help="Init, corpus-sample and batch-order seed."),
    steps: int = typer.Option(100, "--steps", help="Optimiser steps (the deterministic budget)."),
    max_seconds: float = typer.Option(
        1800.0, "--max-seconds", help="Safety ceiling on training time: past it the run "
        "fails and saves nothing (never a shorter teacher); not part of the cache key."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per step."),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per sequence."),
    corpus_bytes: int = typer.Option(3_000_000, "--corpus-bytes",
                                     help="Bytes of local text and code to sample."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Retrain even if cached."),
    as_json: bool = typer.Option(False, "--json", help="Print the record as JSON."),
) -> None:
    """Pretrain the tiny teacher on local text and code (LM + MoE load-balancing loss)."""
    from hebrus_flywheel.core.settings import flywheel_home
    from hebrus_flywheel.replay.pretrain import PretrainConfig, pretrain_teacher
    from hebrus_flywheel.replay.teacher import artifact_digest

    config = PretrainConfig(preset=preset, seed=seed, steps=steps, max_seconds=max_seconds,
                            batch_size=batch_size, seq_len=seq_len, corpus_bytes=corpus_bytes)
    target = out or flywheel_home() / "teachers" / f"{preset}-pretrained"
    path, record, reused = pretrain_teacher(target, config, overwrite=overwrite)
    if as_json:
        typer.echo(json.dumps({"path": str(path), "reused": reused, **record}, indent=2))
        return
    before, after = record["held_out_before"], record["held_out_after"]
    typer.echo(f"{'reused' if reused else 'pretrained'} teacher {preset} in {path}: "
               f"{record['steps_run']} steps ({record.get('seconds_per_step', '?')} s/step) on "
               f"{record['train_tokens']} tokens of {record['corpus_files']} local files "
               f"[{record['total_seconds']} s]")
    typer.echo(f"  held-out loss {before['loss']:.3f} -> {after['loss']:.3f} nats/token; "
               f"expert-load entropy {before['mean_load_entropy']:.3f} -> "
               f"{after['mean_load_entropy']:.3f} (1.0 = even), per layer "
               f"{after['load_entropy']}")
    typer.echo(f"  model_artifact_digest  {artifact_digest(path)}")
