"""Decode/prefill route parity per (family, device, dtype, kernel path) on sharded bf16 checkpoints.

For each family it writes a tiny random checkpoint with **bf16 weights in safetensors
shards** (``teacher init --weights-dtype bfloat16 --max-shard-size``), then for every
(compute dtype, attention kernel) on this machine's device it loads the teacher on that
path, captures routes with real KV-cache decode (:class:`replay.decode.DecodeRuntime`,
teacher-forced token histories) and replays the same windows with
:class:`replay.prefill.PrefillReplayer` **on the same path**, through the parity gate
(:func:`replay.parity.run_parity`: exact expert ids and rank order per (anchor, routed
layer)). Parity is a property of the path; this measures it, it asserts nothing.

``--teacher DIR`` measures one existing checkpoint instead (e.g. the demo's pretrained
teacher under ``$FLYWHEEL_HOME/teachers``) on its own tokenization of the package's text
corpus (``replay/data``), in ``--windows`` windows whose histories grow to a few hundred
tokens, ``--decoded`` decoded tokens each: near ties are rare, so a flip rate needs
thousands of pairs.

Figures (one JSON line each): ``parity_exact/<family>/<device>/<dtype>/<attention>``
(fraction of exact pairs), ``…/mismatched_pairs``, ``…/primary_mismatches``,
``…/authoritative`` (the gate's verdict), ``…/max_weight_abs_diff``.

    .venv/bin/python bench/kernel_parity.py [--families qwen3_moe mixtral] \
        [--dtypes float32 bfloat16 float64] [--attention sdpa eager] [--device cpu]
    .venv/bin/python bench/kernel_parity.py --teacher DIR --dtypes float32 float64 \
        --attention sdpa --windows 24 --decoded 64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
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


def corpus_tokens(teacher_dir: Path) -> list[int]:
    """The package's text corpus (replay/data) under the teacher's own tokenizer."""
    from hebrus_flywheel.replay.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(teacher_dir).tokenizer
    data = Path(__file__).resolve().parents[1] / "replay" / "data"
    text = "\n".join(f.read_text(encoding="utf-8") for f in sorted(data.glob("*.txt")))
    return list(tokenizer.encode(text).ids)


def _tokens(corpus: list[int] | None, index: int, count: int, vocab: int) -> list[int]:
    if corpus is None:
        return np.random.default_rng(100 + index).integers(5, vocab - 1, count).tolist()
    start = (index * 997) % max(1, len(corpus) - count)
    return corpus[start:start + count]


def decode_windows(teacher: Teacher, identity_id: str, vocab: int,
                   turns: list[tuple[int, int]],
                   corpus: list[int] | None = None) -> list[dict[str, Any]]:
    runtime = DecodeRuntime(teacher)
    out = []
    for i, (prefix, decoded) in enumerate(turns):
        tokens = _tokens(corpus, i, prefix + decoded, vocab)
        turn = runtime.decode_turn(tokens[:prefix], forced_ids=tokens[prefix:])
        layers, k = turn.expert_ids_TLK.shape[1:]
        routes = {"layer_count": layers, "top_k": k, "layers": list(range(layers)),
                  "stages": [0] * layers,
                  "expert_ids": turn.expert_ids_TLK.astype("<i2").tobytes(),
                  "weights": turn.weights_TLK.astype("<f4").tobytes()}
        out.append(_window(identity_id, tokens, prefix, routes, i))
    return out


def measure(path: Path, device: str, dtype: str, attention: str,
            turns: list[tuple[int, int]], corpus: list[int] | None = None) -> dict[str, Any]:
    teacher = load_teacher(path, dtype=dtype, device=device, attention=attention)
    replayer = PrefillReplayer(teacher, ReplayConfig(dtype=dtype))
    windows = decode_windows(teacher, replayer.identity_id, teacher.vocab_size, turns, corpus)
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
    parser.add_argument("--teacher", type=Path, help="measure this checkpoint instead")
    parser.add_argument("--windows", type=int, default=24, help="with --teacher")
    parser.add_argument("--decoded", type=int, default=64, help="with --teacher")
    args = parser.parse_args()
    if args.teacher is not None:
        turns = [(40 + 25 * i, args.decoded) for i in range(args.windows)]
        report(args.teacher, args.teacher.name, args, turns, corpus_tokens(args.teacher))
        return
    storage = CheckpointStorage(weights_dtype="bfloat16", max_shard_size=args.max_shard_size)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            path = init_teacher(Path(tmp) / family, family=family, seed=2, storage=storage)
            report(path, family, args, TURNS)


def report(path: Path, label: str, args: argparse.Namespace,
           turns: list[tuple[int, int]], corpus: list[int] | None = None) -> None:
    for dtype in args.dtypes:
        for attention in args.attention:
            started = time.perf_counter()
            row = measure(path, args.device, dtype, attention, turns, corpus)
            name = f"{label}/{args.device}/{dtype}/{attention}"
            for key in ("parity_exact", "mismatched_pairs", "primary_mismatches",
                        "authoritative", "max_weight_abs_diff"):
                print(json.dumps({"figure": f"{key}/{name}", "value": row[key],
                                  "pairs": row["pairs"], "kernel_path": row["kernel_path"],
                                  "seconds": round(time.perf_counter() - started, 1)}),
                      flush=True)


if __name__ == "__main__":
    main()
