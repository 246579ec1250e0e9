"""Candidate-path replay cost next to clean-path replay, on ONE teacher in one run.

On the same tiny Qwen3-Next teacher and the same token histories (random ids, with a
repeated stretch so prompt lookup finds continuations), at the same anchors:

(a) clean-path replay: :class:`replay.prefill.PrefillReplayer`, one forward per window;
    labels are (anchor, routed layer) pairs;
(b) candidate-path replay: :class:`replay.candidates.replay.CandidateReplayer` with the
    prompt-lookup drafter, the dense draft model (trained here on other windows of the
    same generator) and teacher self-drafting (W x B per anchor); labels are
    (candidate row, routed layer) pairs; each anchor prefills its prefix once.

Figures (one JSON line each): ``clean_labels_per_s``, ``candidate_labels_per_s`` (one
per drafter), their ratio, ``replay_cost_per_accepted_token`` (candidate replay seconds
per accepted candidate token; null when none was accepted), the acceptance rate and
rows per anchor. Falsifier 6 (candidate replay costs more than the savings) needs this
cost against the deployment's saving per accepted token, which this bench does not know:
it reports the cost only.

    .venv/bin/python bench/candidates.py [--length 256] [--windows 2] [--anchors 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def emit(figure: str, value: Any, **extra: Any) -> None:
    print(json.dumps({"figure": figure, "value": value, **extra}, sort_keys=True), flush=True)


def windows(identity_id: str, length: int, count: int, anchors: int,
            first_seed: int = 0) -> list[dict[str, Any]]:
    out = []
    for i in range(first_seed, first_seed + count):
        rng = np.random.default_rng(i)
        base = rng.integers(5, 4000, max(length // 3, 8)).tolist()
        tokens = (base * 4)[:length]
        tokens[len(base) + 3] = 17  # one repeat continues differently
        positions = np.linspace(length // 2, length - 1, anchors).astype(int).tolist()
        out.append({
            "window_id": f"bench-{i}", "split": "train", "owner": "o", "thread": f"t{i}",
            "generation": 0, "identity_id": identity_id, "domain_tags": ["bench"],
            "token_ids": tokens, "first_token_ordinal": 0,
            "anchor_positions": sorted(set(positions))})
    return out


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--anchors", type=int, default=8)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from hebrus_flywheel.replay.candidates.dense_draft import (
        DenseDraftConfig,
        train_dense_drafter,
    )
    from hebrus_flywheel.replay.candidates.drafters import DraftConfig, PromptLookupDrafter
    from hebrus_flywheel.replay.candidates.replay import CandidateConfig, CandidateReplayer
    from hebrus_flywheel.replay.candidates.self_draft import TeacherSelfDrafter
    from hebrus_flywheel.replay.prefill import PrefillReplayer
    from hebrus_flywheel.replay.teacher import init_teacher, load_teacher

    with tempfile.TemporaryDirectory() as tmp:
        directory = init_teacher(Path(tmp) / "teacher", preset="tiny-qwen3-next", seed=0)
        teacher = load_teacher(directory)
        clean = PrefillReplayer(teacher)
        batch = windows(clean.identity_id, args.length, args.windows, args.anchors)
        clean.replay(batch[:1])  # warm-up
        labels, seconds = timed(lambda: clean.replay(batch))
        clean_rate = sum(w.label_count for w in labels) / seconds
        emit("clean_labels_per_s", round(clean_rate, 1), seconds=round(seconds, 3),
             length=args.length, windows=args.windows)
        config = CandidateConfig(draft=DraftConfig(width=args.width, depth=args.depth))
        # the dense drafter learns from other windows of the same generator (its "train split")
        streams = [w["token_ids"] for w in windows(clean.identity_id, args.length,
                                                   max(args.windows, 4), args.anchors,
                                                   first_seed=1000)]
        dense, seconds = timed(lambda: train_dense_drafter(
            streams, DenseDraftConfig(vocab_size=teacher.vocab_size)))
        emit("dense_drafter_train_seconds", round(seconds, 3), streams=len(streams),
             drafter_id=dense.drafter_id)
        for drafter in (PromptLookupDrafter(ngram=3), dense, TeacherSelfDrafter(teacher)):
            replayer = CandidateReplayer(teacher, drafter, config)
            out, seconds = timed(lambda r=replayer: r.replay(batch))
            anchors = [a for per in out for a in per]
            count = sum(a.label_count for a in anchors)
            stats, tag = replayer.stats, {"drafter_id": drafter.drafter_id}
            rate = count / seconds
            emit("candidate_labels_per_s", round(rate, 1), seconds=round(seconds, 3),
                 width=args.width, depth=args.depth, **tag)
            emit("candidate_over_clean_labels_per_s", round(rate / clean_rate, 4), **tag)
            cost = seconds / stats.accepted_tokens if stats.accepted_tokens else None
            emit("replay_cost_per_accepted_token", None if cost is None else round(cost, 5),
                 unit="s", accepted_tokens=stats.accepted_tokens, **tag)
            emit("candidate_acceptance_rate",
                 round(stats.accepted_tokens / stats.rows, 4) if stats.rows else None,
                 rows=stats.rows, **tag)
            emit("candidate_rows_per_anchor",
                 round(stats.rows / stats.anchors, 3) if stats.anchors else None,
                 anchors=stats.anchors, anchors_without_paths=stats.anchors_without_paths,
                 **tag)


if __name__ == "__main__":
    main()
