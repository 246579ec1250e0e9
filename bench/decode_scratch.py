"""Scratch benchmark: teacher init time, size, and reference-decode tokens/s on this CPU.

Prints one JSON object per preset. Not a test; figures vary with the machine.
Usage (from the repo root; bench/replay.py would shadow the package if run by path):
    python -m bench.decode_scratch [PRESET ...] [--tokens N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hebrus_flywheel.replay.decode import DecodedTurn, DecodeRuntime, SamplingConfig
from hebrus_flywheel.replay.teacher import Teacher, init_teacher, load_teacher


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def bench(preset: str, workdir: Path, tokens: int, impl: str) -> dict[str, object]:
    out = workdir / preset
    start = time.perf_counter()
    init_teacher(out, preset=preset, seed=0, overwrite=True)
    init_s = time.perf_counter() - start
    start = time.perf_counter()
    teacher = load_teacher(out, experts_implementation=impl)
    load_s = time.perf_counter() - start
    runtime = DecodeRuntime(teacher)
    prefix = list(range(10, 74))
    runtime.decode_turn(prefix, sampling=SamplingConfig(max_new_tokens=8))  # warm-up
    sampling = SamplingConfig(max_new_tokens=tokens, stop_at_eos=False, temperature=1.0, seed=1)
    wall = time.perf_counter()
    turn = runtime.decode_turn(prefix, sampling=sampling)
    wall = time.perf_counter() - wall
    full = torch.tensor([prefix + turn.token_ids])
    start = time.perf_counter()
    routes = teacher.forward_routes(full)
    prefill_s = time.perf_counter() - start
    ids_TLK, _ = teacher.route(routes.router_logits_BTLE[0, len(prefix):])
    differ = (ids_TLK.numpy().astype(np.uint16) != turn.expert_ids_TLK).any(-1)
    return {
        "preset": preset,
        "experts_implementation": impl,
        "params": sum(p.numel() for p in teacher.model.parameters()),
        "checkpoint_bytes": _dir_bytes(out),
        "init_s": round(init_s, 2),
        "load_s": round(load_s, 2),
        "decode_tokens": len(turn.token_ids),
        "decode_forward_tok_s": round(turn.timing.tokens_per_s, 1),
        "decode_wall_tok_s": round(len(turn.token_ids) / wall, 1),
        "prefill_tok_s": round(full.shape[1] / prefill_s, 1),
        "parity_pairs_differing": int(differ.sum()),
        "parity_pairs": int(differ.size),
        "min_margin": float(turn.margins_TL.min()),
    }


def _record_decode_logits(teacher: Teacher) -> list[torch.Tensor]:
    """Scratch instrumentation: keep every router_logits_LE the decode runtime ranks."""
    seen: list[torch.Tensor] = []
    original = teacher.route

    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(logits.clone())
        return original(logits)

    teacher.route = route  # type: ignore[method-assign]
    return seen


def _adjacent_gap_TL(logits_TLE: torch.Tensor, k: int) -> torch.Tensor:
    top = torch.topk(logits_TLE.float(), k + 1, dim=-1).values
    return (top[..., :-1] - top[..., 1:]).min(-1).values


def _compare(teacher: Teacher, prefix: list[int], turn: DecodedTurn,
             dec_TLE: torch.Tensor) -> dict[str, torch.Tensor]:
    full = torch.tensor([prefix + turn.token_ids])
    pre_TLE = teacher.forward_routes(full).router_logits_BTLE[0, len(prefix):]
    ids_TLK = teacher.route(pre_TLE)[0]
    got = torch.from_numpy(turn.expert_ids_TLK.astype(np.int64))
    return {
        "rank": (ids_TLK != got).any(-1),
        "set": (ids_TLK.sort(-1).values != got.sort(-1).values).any(-1),
        "dlogit_TL": (pre_TLE.float() - dec_TLE.float()).abs().amax(-1),
        "gap_TL": _adjacent_gap_TL(pre_TLE, teacher.geometry.top_k),
    }


def stress(teacher_dir: Path, dtype: str, turns: int, tokens: int) -> dict[str, object]:
    """Many sampled turns; count (token, layer) pairs whose decode route != prefill route."""
    teacher = load_teacher(teacher_dir, dtype=dtype)
    runtime = DecodeRuntime(teacher)
    seen = _record_decode_logits(teacher)
    parts: dict[str, list[torch.Tensor]] = {"rank": [], "set": [], "dlogit_TL": [], "gap_TL": []}
    for turn_index in range(turns):
        gen = torch.Generator().manual_seed(turn_index)
        length = int(torch.randint(1, 150, (1,), generator=gen))
        prefix = torch.randint(5, teacher.vocab_size, (length,), generator=gen).tolist()
        sampling = SamplingConfig(temperature=1.0, seed=turn_index, max_new_tokens=tokens,
                                  stop_at_eos=False)
        seen.clear()
        turn = runtime.decode_turn(prefix, sampling=sampling)
        dec_TLE = torch.stack(seen)
        for key, value in _compare(teacher, prefix, turn, dec_TLE).items():
            parts[key].append(value)
    r = {k: torch.cat(v) for k, v in parts.items()}
    rank, dlogit, gap = r["rank"], r["dlogit_TL"], r["gap_TL"]
    first_layers = rank.float().argmax(-1)[rank.any(-1)]
    return {
        "teacher": str(teacher_dir), "dtype": dtype, "pairs": rank.numel(),
        "rank_differing_pairs": int(rank.sum()), "set_differing_pairs": int(r["set"].sum()),
        "max_abs_dlogit": float(dlogit.max()), "median_abs_dlogit": float(dlogit.median()),
        "dlogit_by_layer_max": [round(float(x), 8) for x in dlogit.amax(0)[::8]],
        "adjacent_gap_at_differences": sorted(gap[rank].tolist())[:10],
        "dlogit_at_differences": sorted(dlogit[rank].tolist())[:10],
        "pairs_with_gap_below_max_dlogit": int((gap < dlogit.max()).sum()),
        "first_differing_layer_histogram": torch.bincount(first_layers).tolist()[:48],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("presets", nargs="*", default=["tiny-qwen3-next", "tiny-qwen3-next-48l"])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--impl", default="batched_mm")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--stress", type=Path, default=None, help="teacher dir to stress")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    if args.stress is not None:
        print(json.dumps(stress(args.stress, args.dtype, args.turns, args.tokens)), flush=True)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="flywheel-bench-"))
    for preset in args.presets:
        print(json.dumps(bench(preset, workdir, args.tokens, args.impl)), flush=True)


if __name__ == "__main__":
    main()
