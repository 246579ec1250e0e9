"""Benchmark of the shadow SSD-prefetch simulator on the default (Qwen4Exp-like) geometry.

Prints one JSON object: for each predictor, the simulator's own speed (trace tokens
replayed per wall-clock second) and the simulated decode figures (tokens/s, exposed
wait, timely recall, byte amplification). The trace is synthetic (routes with temporal
locality), so the simulated figures illustrate the model, not a real runtime.

    .venv/bin/python bench/sim.py --tokens 256
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hebrus_flywheel.train.sim import (
    DecodeTrace,
    PredictionSet,
    SimConfig,
    oracle_predictions,
    previous_token_predictions,
    simulate,
    summarize,
)


def synthetic_trace(tokens: int, *, layers: int = 48, experts: int = 512, k: int = 10,
                    keep: float = 0.6, seed: int = 0) -> DecodeTrace:
    """Routes where each token keeps about ``keep`` of the previous token's experts."""
    rng = np.random.default_rng(seed)
    routes = np.empty((tokens, layers, k), dtype=np.int64)
    for layer in range(layers):
        current = rng.choice(experts, k, replace=False)
        for token in range(tokens):
            kept = current[rng.random(k) < keep]
            fresh = rng.permutation(np.setdiff1d(np.arange(experts), kept))[: k - kept.size]
            current = np.concatenate([kept, fresh])
            routes[token, layer] = current
    return DecodeTrace(routes=routes, num_experts=experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    trace = synthetic_trace(args.tokens)
    config = SimConfig()
    predictors: dict[str, PredictionSet] = {
        "none": PredictionSet.empty(),
        "previous_token": previous_token_predictions(trace),
        "oracle_layer_start": oracle_predictions(trace),
        "oracle_one_token_early": oracle_predictions(
            trace, priority=2, lead_boundaries=trace.num_layers + 1),
    }
    context = {"tokens": args.tokens, "layers": trace.num_layers, "top_k": trace.top_k,
               "expert_bytes": config.expert_bytes}
    for name, predictions in predictors.items():
        started = time.perf_counter()
        metrics = summarize(simulate(trace, predictions, config))
        wall = time.perf_counter() - started
        emit("replayed_tokens_per_wall_s", round(args.tokens / wall, 1), "tokens/s",
             predictor=name, predictions=len(predictions), **context)
        for key, unit in FIGURES:
            emit(key, metrics[key], unit, predictor=name, **context)


FIGURES = (("tokens_per_s", "tokens/s (simulated)"), ("exposed_wait_s", "s"),
           ("timely_recall", "ratio"), ("recall", "ratio"),
           ("byte_amplification_vs_topk", "ratio"), ("hidden_fraction", "ratio"),
           ("useful_prefetch_ratio", "ratio"), ("p0_starvation_attempts", "count"),
           ("evictions_by_prefetch", "count"))


def emit(figure: str, value: object, unit: str, **extra: object) -> None:
    print(json.dumps({"bench": "sim", "figure": figure, "value": value, "unit": unit,
                      **extra}), flush=True)


if __name__ == "__main__":
    main()
