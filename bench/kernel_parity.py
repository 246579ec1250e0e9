"""Decode/prefill route parity per (family, device, dtype, kernel path) on sharded bf16 checkpoints.

For each family it writes a tiny random checkpoint with **bf16 weights in safetensors
shards** (``teacher init --weights-dtype bfloat16 --max-shard-size``), then for every
(compute dtype, attention kernel) on this machine's device it loads the teacher on that
path, captures routes with real KV-cache decode (:class:`replay.decode.DecodeRuntime`,
teacher-forced token histories) and replays the same windows with
:class:`replay.prefill.PrefillReplayer` **on the same path**, through the parity gate
(:func:`replay.parity.run_parity`: exact expert ids and rank order per (anchor, routed
layer)). Parity is a property of the path; this measures it, it asserts nothing.

Figures (one JSON line each): ``parity_exact/<family>/<device>/<dtype>/<attention>``
(fraction of exact pairs), ``…/mismatched_pairs``, ``…/primary_mismatches``,
``…/authoritative`` (the gate's verdict), ``…/max_weight_abs_diff``.

    .venv/bin/python bench/kernel_parity.py [--families qwen3_moe mixtral] \
        [--dtypes float32 bfloat16] [--attention sdpa eager] [--device cpu]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hebrus_flywheel.replay.checkpoint import CheckpointStorage
from hebrus_flywheel.replay.decode import DecodeRuntime
from hebrus_flywheel.replay.parity import run_parity
from hebrus_flywheel.replay.prefill import PrefillReplayer, ReplayConfig
from hebrus_flywheel.replay.teacher import Teacher, init_teacher, load_teacher

TURNS = [(20, 60), (50, 30), (5, 40), (90, 50)]  # (prefix, decoded) per window


def _window(identity_id: str, tokens: list[int], prefix: int, routes: dict[str, Any],
            index: int) -> dict[str, Any]:
    body = f"{identity_id}|{index}|{tokens}".encode()
    return {
        "window_id": hashlib.sha256(body).hexdigest(), "content_digest": "0" * 64,
        "split": "runtime_holdout", "split_rule": "bench", "owner": "owner-a",
        "thread": f"t{index}", "generation": 0, "identity_id": identity_id,
        "domain_tags": ["bench"], "thread_digest": "0" * 64,
        "thread_token_count": len(tokens), "window_index": 0, "window_count": 1,
        "token_ids": tokens, "first_token_ordinal": 0,
        "anchor_positions": list(range(prefix, len(tokens))), "turns": [], "routes": routes,
        "config_digest": "0" * 64,
    }


def decode_windows(teacher: Teacher, identity_id: str, vocab: int) -> list[dict[str, Any]]:
    runtime = DecodeRuntime(teacher)
    out = []
    for i, (prefix, decoded) in enumerate(TURNS):
        tokens = np.random.default_rng(100 + i).integers(5, vocab - 1, prefix + decoded).tolist()
        turn = runtime.decode_turn(tokens[:prefix], forced_ids=tokens[prefix:])
        layers, k = turn.expert_ids_TLK.shape[1:]
        routes = {"layer_count": layers, "top_k": k, "layers": list(range(layers)),
                  "stages": [0] * layers,
                  "expert_ids": turn.expert_ids_TLK.astype("<i2").tobytes(),
                  "weights": turn.weights_TLK.astype("<f4").tobytes()}
        out.append(_window(identity_id, tokens, prefix, routes, i))
    return out


def measure(path: Path, device: str, dtype: str, attention: str) -> dict[str, Any]:
    teacher = load_teacher(path, dtype=dtype, device=device, attention=attention)
    replayer = PrefillReplayer(teacher, ReplayConfig(dtype=dtype))
    windows = decode_windows(teacher, replayer.identity_id, teacher.vocab_size)
    result = run_parity(replayer, windows)
    return {"parity_exact": 1.0 - result.mismatch_rate, "pairs": result.pairs,
            "mismatched_pairs": result.mismatched_pairs,
            "primary_mismatches": result.primary_mismatches,
            "authoritative": result.authoritative,
            "max_weight_abs_diff": result.max_weight_abs_diff,
            "kernel_path": result.kernel_path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["qwen3_moe", "mixtral", "deepseek_v3"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--attention", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-shard-size", default="200KB")
    args = parser.parse_args()
    storage = CheckpointStorage(weights_dtype="bfloat16", max_shard_size=args.max_shard_size)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            path = init_teacher(Path(tmp) / family, family=family, seed=2, storage=storage)
            for dtype in args.dtypes:
                for attention in args.attention:
                    row = measure(path, args.device, dtype, attention)
                    name = f"{family}/{args.device}/{dtype}/{attention}"
                    for key in ("parity_exact", "mismatched_pairs", "primary_mismatches",
                                "authoritative", "max_weight_abs_diff"):
                        print(json.dumps({"figure": f"{key}/{name}", "value": row[key],
                                          "pairs": row["pairs"],
                                          "kernel_path": row["kernel_path"]}), flush=True)


if __name__ == "__main__":
    main()
