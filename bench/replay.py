"""Replay throughput and label size: decode capture vs prefill replay vs a bare forward.

On ONE teacher (default: the 48-routed-layer tiny Qwen3-Next preset, top-10 of 512) and
the SAME token histories (windows cut from the shipped multilingual/code corpus,
tokenized with the teacher's tokenizer), at each window length W:

(a) decode capture: :class:`replay.decode.DecodeRuntime`, a 1-token prefix then W-1
    teacher-forced single-token steps with the KV cache; one label per (decoded token,
    routed layer);
(b) prefill replay: :class:`replay.prefill.PrefillReplayer` (the worker's path:
    validation, padding, one forward per batch, hooks, ranking, features) with anchors
    at the same W-1 positions;
(c) a bare forward: ``model(input_ids)`` exactly as written (full logits, default
    cache), and the leaner ``use_cache=False, logits_to_keep=1`` call replay itself makes.

(b) runs one window per forward and with a large batch budget on the default
``tiled_mm`` experts (:mod:`replay.experts`), and, for comparison only, one window per
forward on a ``batched_mm`` copy of the teacher (the previous default: batch-invariant
too, but it copies expert weights per (token, expert) pair) and on a ``grouped_mm`` copy
(fast, but its labels depend on the batch, so the engine does not use it; see
``replay/prefill.py``). The comparison copies' labels are checked against (a) too,
though (a) ran on ``tiled_mm``: their rounding differs, so a few flips are expected. (b)
and (c) are the fastest of ``--repeats`` interleaved runs, (a) one run (it is slow); the
mismatch count compares (a) with each (b).

Ratios: (b)/(a) in labels/s; (b)/(c) as replay labels/s over ``L x`` forward tokens/s,
i.e. how close replay gets to the forward it is built on. Then bytes per (token, layer)
label on disk: the labels of (b) packed by ``consumers.labels.pack_rows`` and written by
``consumers.shards.write_shard`` (zstd, uint16 ids, uint8 or fp16 weights) when the
consumers package provides them, else by an equivalent pyarrow table (reported as
``writer``), next to the design note's 80 bytes (4-byte id + 4-byte weight) x 10.

Prints one JSON line per figure. Figures vary with the machine and its load; the goals
((b)/(a) >= 20 at 1024, (b)/(c) >= 0.8, <= 25 bytes per label) are reported, never
asserted.

``--device``/``--dtype``/``--attention`` pick the kernel path (a GPU: ``--device cuda
--dtype bfloat16``). ``--preset qwen3-next-80b-a3b-4l`` is Qwen3-Next-80B-A3B's real
widths (hidden 2048, 512 experts of 512, top-10, its attention heads) on 4 of its 48
layers (3 linear-attention, 1 full, its 3:1 pattern), written in bf16: about 13 GB, for
throughput at real width on an accelerator. Its figures also give
``projected_full_depth_tokens_per_s`` (tokens/s x 4/48, every layer costing the same)
and the hours to replay 100k, 1M and 10M tokens at that rate: an extrapolation from 4
layers, labelled as one.

    .venv/bin/python bench/replay.py [--lengths 256 1024] [--windows 2] [--threads 1]
        [--device cuda --dtype bfloat16] [--preset qwen3-next-80b-a3b-4l]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# This file is bench/replay.py: run as a script, its folder comes first on sys.path and
# would shadow the ``replay`` package. Drop the folder so the package is imported.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]

from hebrus_flywheel.replay.checkpoint import CheckpointStorage  # noqa: E402
from hebrus_flywheel.replay.decode import DecodeRuntime  # noqa: E402
from hebrus_flywheel.replay.prefill import PrefillReplayer, ReplayConfig, WindowLabels  # noqa: E402
from hebrus_flywheel.replay.teacher import (  # noqa: E402
    DTYPES,
    PRESETS,
    Teacher,
    TeacherPreset,
    init_teacher,
    load_teacher,
)
from hebrus_flywheel.train.projection import PROJECTION_TOKENS  # noqa: E402

DESIGN_NOTE_BYTES_PER_LABEL = 80  # 10 x (4-byte id + 4-byte weight)
PREFIX = 1
# Qwen3-Next-80B-A3B's config.json widths on 4 of its 48 layers (vocabulary: ours).
REAL_WIDTH = TeacherPreset(
    name="qwen3-next-80b-a3b-4l", num_hidden_layers=4, full_attention_interval=4,
    hidden_size=2048, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
)
REAL_DEPTH = 48
BENCH_PRESETS: dict[str, TeacherPreset] = {**PRESETS, REAL_WIDTH.name: REAL_WIDTH}


def emit(figure: str, value: float | int | str, unit: str, **extra: Any) -> None:
    print(json.dumps({"bench": "replay", "figure": figure, "value": value, "unit": unit,
                      **extra}), flush=True)


def corpus_tokens(teacher_dir: Path) -> np.ndarray:
    from hebrus_flywheel.replay.synthetic import corpus_texts
    from hebrus_flywheel.replay.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(teacher_dir).tokenizer
    ids: list[int] = []
    for _, text in corpus_texts():
        ids.extend(tokenizer.encode(text).ids)
    return np.asarray(ids, dtype=np.int64)


def histories(stream: np.ndarray, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens at spread-out offsets (wrapping around)."""
    stride = max(1, len(stream) // max(count, 1))
    reps = -(-(length + stride * count) // len(stream)) + 1
    tiled = np.tile(stream, reps)
    return [tiled[i * stride: i * stride + length].tolist() for i in range(count)]


def windows_for(replayer: PrefillReplayer, tokens: list[list[int]]) -> list[dict[str, Any]]:
    return [{
        "window_id": f"bench-{len(t)}-{i}", "split": "train", "owner": "bench",
        "thread": f"bench-{i}", "generation": 0, "identity_id": replayer.identity_id,
        "domain_tags": ["bench"], "token_ids": t, "first_token_ordinal": 0,
        "anchor_positions": list(range(PREFIX, len(t))),
    } for i, t in enumerate(tokens)]


def run_decode(teacher: Teacher, tokens: list[list[int]]) -> tuple[float, list[np.ndarray]]:
    runtime = DecodeRuntime(teacher, threads=None)
    start = time.perf_counter()
    turns = [runtime.decode_turn(t[:PREFIX], forced_ids=t[PREFIX:]) for t in tokens]
    return time.perf_counter() - start, [turn.expert_ids_TLK for turn in turns]


def run_replay(replayer: PrefillReplayer, windows: list[dict[str, Any]]
               ) -> tuple[float, list[WindowLabels]]:
    start = time.perf_counter()
    labels = replayer.replay(windows)
    return time.perf_counter() - start, labels


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_forward(teacher: Teacher, tokens: list[list[int]], *, literal: bool) -> float:
    model = teacher.model
    _synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        for t in tokens:
            ids = torch.tensor([t], device=model.device)
            if literal:
                model(ids)
            else:
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
    _synchronize(model.device)
    return time.perf_counter() - start


def _mismatches(decode_ids: list[np.ndarray], labels: list[WindowLabels]) -> int:
    return sum(int((d.astype(np.int64) != lab.expert_ids_ALK.astype(np.int64)).any(-1).sum())
               for d, lab in zip(decode_ids, labels, strict=True))


def _best_times(teacher: Teacher, replayers: dict[str, PrefillReplayer],
                tokens: list[list[int]], repeats: int
                ) -> tuple[dict[str, float], dict[str, list[WindowLabels]]]:
    """Fastest of ``repeats`` interleaved runs of each forward and replay variant."""
    best: dict[str, float] = {}
    labels: dict[str, list[WindowLabels]] = {}
    for _ in range(repeats):
        for literal in (True, False):
            key = "literal" if literal else "lean"
            best[key] = min(best.get(key, np.inf), run_forward(teacher, tokens, literal=literal))
        for name, replayer in replayers.items():
            seconds, labels[name] = run_replay(replayer, windows_for(replayer, tokens))
            best[name] = min(best.get(name, np.inf), seconds)
    return best, labels


def bench_length(teacher: Teacher, replayers: dict[str, PrefillReplayer],
                 tokens: list[list[int]], layers: int, repeats: int) -> list[WindowLabels]:
    length = len(tokens[0])
    labels_count = sum(len(t) - PREFIX for t in tokens) * layers
    common = {"window_tokens": length, "windows": len(tokens), "routed_layers": layers,
              "threads": torch.get_num_threads(), "timing": f"best of {repeats}"}
    decode_s, decode_ids = run_decode(teacher, tokens)
    a = labels_count / decode_s
    emit("decode_capture_labels_per_s", round(a, 1), "labels/s",
         **{**common, "timing": "one run"})
    best, labels = _best_times(teacher, replayers, tokens, repeats)
    total = sum(len(t) for t in tokens)
    c_literal, c_lean = total / best["literal"], total / best["lean"]
    emit("bare_forward_tokens_per_s", round(c_literal, 1), "tokens/s", call="model(input_ids)",
         **common)
    emit("lean_forward_tokens_per_s", round(c_lean, 1), "tokens/s",
         call="model(input_ids=..., use_cache=False, logits_to_keep=1)", **common)
    for name in replayers:
        b = labels_count / best[name]
        extra = {**common, "replay": name}
        emit("prefill_replay_labels_per_s", round(b, 1), "labels/s", **extra)
        emit("replay_over_decode", round(b / a, 2), "ratio", goal=">= 20 at 1024", **extra)
        emit("replay_over_bare_forward", round(b / (layers * c_literal), 3), "ratio",
             goal=">= 0.8", **extra)
        emit("replay_over_lean_forward", round(b / (layers * c_lean), 3), "ratio", **extra)
        emit("decode_vs_replay_mismatched_labels", _mismatches(decode_ids, labels[name]),
             "labels", of=labels_count, **extra)
        if layers < REAL_DEPTH and teacher.geometry.hidden_size == REAL_WIDTH.hidden_size:
            project(b / layers, layers, extra)
    return labels[next(iter(replayers))]


def project(tokens_per_s: float, layers: int, extra: dict[str, Any]) -> None:
    """Full-depth replay speed and collection hours, extrapolated from ``layers``."""
    full = tokens_per_s * layers / REAL_DEPTH
    basis = {**extra, "basis": f"measured on {layers} of {REAL_DEPTH} layers, x{layers}/"
             f"{REAL_DEPTH} (every layer costing the same); an extrapolation"}
    emit("projected_full_depth_tokens_per_s", round(full, 1), "tokens/s", **basis)
    for tokens in PROJECTION_TOKENS:  # the report's collection-time rows
        emit(f"projected_hours_for_{tokens}_tokens", round(tokens / full / 3600, 3), "hours",
             **basis)


def make_replayers(teacher: Teacher, length: int, others: dict[str, Teacher]
                   ) -> dict[str, PrefillReplayer]:
    impl = teacher.model.config._experts_implementation
    base = PrefillReplayer(teacher, ReplayConfig(max_batch_tokens=8192, dtype=teacher.dtype))
    one = ReplayConfig(max_batch_tokens=length, dtype=teacher.dtype)
    out = {f"{impl}, one window per forward": PrefillReplayer(teacher, one,
                                                               identity=base.identity),
           f"{impl}, max_batch_tokens=8192": base}
    for name, other in others.items():
        label = f"{name}{' (NOT batch-invariant)' if name == 'grouped_mm' else ''}"
        out[f"{label}, one window per forward"] = PrefillReplayer(other, one,
                                                                   identity=base.identity)
    return out


def _pack(labels: list[WindowLabels], layers: int, top_k: int, encoding: str) -> Any:
    from hebrus_flywheel.consumers.labels import SourceRef, pack_rows
    from hebrus_flywheel.core.geometry import RouteGeometry
    from hebrus_flywheel.core.snapshot import ShardLayout

    # Only L and K shape the label columns; the other routing fields are placeholders.
    route = RouteGeometry(family="bench", routed_layers=tuple(range(layers)),
                          layer_count=layers, expert_count=max(top_k, 512), top_k=top_k,
                          hidden_size=1, routed_intermediate_size=1)
    layout = ShardLayout(route=route, feature_dim=int(labels[0].features_ALD.shape[-1]),
                         hidden_dim=1, weight_encoding=encoding)
    items = [(lab, SourceRef(topic="bench", partition=0, offset=i))
             for i, lab in enumerate(labels)]
    return pack_rows(items, layout)


def _write_consumers(table: Any, root: Path, name: str) -> int:
    from hebrus_flywheel.consumers.shards import ShardConfig, write_shard

    return write_shard(root, f"{name}.parquet", table, ShardConfig(), windows=1).bytes


def _equivalent_table(labels: list[WindowLabels], encoding: str) -> Any:
    import pyarrow as pa

    ids = np.concatenate([lab.expert_ids_ALK for lab in labels])
    weights = np.concatenate([lab.weights_ALK for lab in labels])
    _, layers, k = ids.shape
    w = np.round(weights * 255).astype(np.uint8) if encoding == "uint8" \
        else weights.astype(np.float16)
    ids_col = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), k), layers)
    w_col = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(w.ravel()), k), layers)
    ordinal = pa.array(np.concatenate([lab.anchor_ordinals_A for lab in labels]))
    return pa.table({"token_ordinal": ordinal, "expert_ids": ids_col, f"weights_{encoding}": w_col})


def _write_equivalent(table: Any, root: Path, name: str) -> int:
    import pyarrow.parquet as pq

    path = root / f"{name}.parquet"
    pq.write_table(table, path, compression="zstd", compression_level=3, use_dictionary=True,
                   row_group_size=8192)
    return path.stat().st_size


def label_bytes(labels: list[WindowLabels], layers: int, top_k: int, workdir: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="shards-", dir=workdir))
    count = sum(len(lab.anchor_ordinals_A) for lab in labels)
    for encoding in ("uint8", "float16"):
        try:
            table = _pack(labels, layers, top_k, encoding)
            writer, write = "consumers.shards.write_shard", _write_consumers
            full = write(table, root, f"full-{encoding}")
            weight_column = "weights_u8" if encoding == "uint8" else "weights_f16"
            keep = ["source_offset", "token_ordinal", "expert_ids", weight_column]
            only = write(table.select(keep), root, f"labels-{encoding}")
        except ImportError:
            writer, full = "equivalent-pyarrow (consumers.shards not available)", None
            only = _write_equivalent(_equivalent_table(labels, encoding), root, encoding)
        extra = {"weights": encoding, "writer": writer, "tokens": count, "routed_layers": layers,
                 "top_k": top_k, "design_note_bytes": DESIGN_NOTE_BYTES_PER_LABEL}
        emit("label_bytes_per_token_layer", round(only / (count * layers), 2), "bytes",
             goal="<= 25", columns="token_ordinal, expert_ids, weights", **extra)
        if full is not None:
            emit("shard_row_bytes_per_token_layer", round(full / (count * layers), 2), "bytes",
                 columns="whole shard row incl. fp16 features (D=64), margins, lineage", **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--windows", type=int, default=2, help="windows per length")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="best-of-N for (b) and (c)")
    parser.add_argument("--compare", nargs="*", default=["batched_mm", "grouped_mm"],
                        help="other experts implementations to replay with, for comparison")
    parser.add_argument("--preset", default="tiny-qwen3-next-48l", choices=sorted(BENCH_PRESETS))
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--attention", default="auto", help="auto, sdpa or eager")
    parser.add_argument("--teacher", type=Path, help="reuse this teacher directory")
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as scratch:
        workdir = args.workdir or Path(scratch)
        teacher_dir = args.teacher or workdir / args.preset
        if not (teacher_dir / "config.json").is_file():
            storage = CheckpointStorage(weights_dtype="bfloat16" if args.preset ==
                                        REAL_WIDTH.name else "float32", max_shard_size="5GB")
            init_teacher(teacher_dir, preset=BENCH_PRESETS[args.preset], storage=storage)
        path = {"device": args.device, "dtype": args.dtype, "attention": args.attention}
        teacher = load_teacher(teacher_dir, **path)
        geometry = teacher.geometry
        emit("teacher", args.preset, "preset", routed_layers=geometry.routed_layer_count,
             experts=geometry.expert_count, top_k=geometry.top_k, hidden=geometry.hidden_size,
             experts_implementation=teacher.model.config._experts_implementation,
             kernel_path=teacher.kernel_path, dtype=teacher.dtype)
        replayer = PrefillReplayer(teacher, ReplayConfig(dtype=teacher.dtype))
        others = {name: load_teacher(teacher_dir, experts_implementation=name, **path)
                  for name in args.compare}
        stream = corpus_tokens(teacher.path)
        warm = histories(stream, 1, 32)
        run_decode(teacher, warm), run_replay(replayer, windows_for(replayer, warm))
        labels: list[WindowLabels] = []
        for length in args.lengths:
            labels += bench_length(teacher, make_replayers(teacher, length, others),
                                   histories(stream, args.windows, length),
                                   geometry.routed_layer_count, args.repeats)
        label_bytes(labels, geometry.routed_layer_count, geometry.top_k, workdir)


if __name__ == "__main__":
    main()
