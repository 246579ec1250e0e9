"""Builds ``qualify_inputs.json``: a small crafted qualification bundle whose offline and
shadow figures come from the real producers (``train.metrics``, ``train.baselines``,
``train.sim``) on synthetic routes, so the fixture follows their schemas.

Run ``.venv/bin/python tests/assets/qualify_make_inputs.py`` to rewrite the fixture.
The routes are synthetic (a persistent, Zipf-skewed route process) and the "sidecar" is
a noisy oracle: the figures exercise the report, they are not evidence about any model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hebrus_flywheel.core.geometry import RouteGeometry, teacher_budgets
from hebrus_flywheel.train.baselines import (
    BaselineConfig,
    FrequencyTable,
    HistoryBaselines,
    RandomBaseline,
)
from hebrus_flywheel.train.metrics import MetricsAccumulator, MetricsConfig
from hebrus_flywheel.train.sim import (
    DecodeTrace,
    PredictionBuilder,
    SimConfig,
    break_even,
    oracle_predictions,
    shadow_io,
    sweep,
)

LAYERS, EXPERTS, TOP_K = 4, 32, 4
BUDGETS = teacher_budgets(TOP_K)  # k, 2k, 3k, 4k of the teacher's k
TOKENS, THREADS = 30, 6
SPLITS = ("train", "validation", "temporal_holdout", "runtime_holdout")
GEOMETRY = RouteGeometry(family="qwen3_next", routed_layers=tuple(range(LAYERS)),
                         layer_count=LAYERS, expert_count=EXPERTS, top_k=TOP_K,
                         hidden_size=64, routed_intermediate_size=32)
SIM = SimConfig(geometry=GEOMETRY, dtype_bytes=2.0,
                attention_time_s=250e-6, moe_time_s=150e-6, step_overhead_s=1e-3,
                ssd_bandwidth_bytes_per_s=1.5e8, ssd_latency_s=50e-6, ssd_queue_depth=8,
                cache_capacity_experts=64, eviction="priority")
OUT = Path(__file__).with_name("qualify_inputs.json")


def routes_for(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """(tokens, L, K) routes: each expert persists with p=0.6, else a Zipf draw."""
    weights = 1.0 / np.arange(1, EXPERTS + 1) ** 1.1
    perms = [rng.permutation(EXPERTS) for _ in range(LAYERS)]
    out = np.zeros((tokens, LAYERS, TOP_K), dtype=np.int64)
    for t in range(tokens):
        for layer in range(LAYERS):
            keep = [e for e in out[t - 1, layer] if t and rng.random() < 0.6]
            while len(keep) < TOP_K:
                e = int(perms[layer][rng.choice(EXPERTS, p=weights / weights.sum())])
                if e not in keep:
                    keep.append(e)
            out[t, layer] = keep
    return out


def sidecar_scores(rng: np.random.Generator, targets_BK: np.ndarray) -> np.ndarray:
    """A noisy oracle: each native expert kept near the top with p=0.85."""
    scores = rng.random((targets_BK.shape[0], EXPERTS))
    keep = rng.random(targets_BK.shape) < 0.85
    rows = np.repeat(np.arange(targets_BK.shape[0]), TOP_K).reshape(targets_BK.shape)
    scores[rows[keep], targets_BK[keep]] += 2.0 + rng.random(int(keep.sum()))
    return scores


def split_rows(rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    data = {}
    for s, split in enumerate(SPLITS):
        cols: dict[str, list[Any]] = {k: [] for k in ("thread", "ordinal", "layer", "target",
                                                      "domain")}
        for t in range(THREADS):
            routes = routes_for(rng, TOKENS)
            for o in range(TOKENS):
                for layer in range(LAYERS):
                    cols["thread"].append(f"{split}-t{t}")
                    cols["ordinal"].append(o)
                    cols["layer"].append(layer)
                    cols["target"].append(routes[o, layer])
                    cols["domain"].append("code" if (t + s) % 2 else "chat")
        data[split] = {k: np.asarray(v) for k, v in cols.items()}
    return data


def offline_results(rng: np.random.Generator, data: dict) -> list[dict[str, Any]]:
    config = BaselineConfig(layer_count=LAYERS, expert_count=EXPERTS, seed=1, lru_capacity=16)
    table = FrequencyTable(config)
    table.fit(layer_B=data["train"]["layer"], target_ids_BK=data["train"]["target"],
              split_B="train")
    methods = ("random", "frequency", "lru", "previous_token", "adjacent_layer", "sidecar")
    metrics = MetricsConfig(expert_count=EXPERTS, top_k=TOP_K, budgets=BUDGETS,
                            union_max_window=3, calibration_bins=5)
    acc = {m: MetricsAccumulator(metrics, method=m) for m in methods}
    rand = RandomBaseline(config)
    for split in SPLITS[1:]:
        d = data[split]
        history = HistoryBaselines(config, fill=table).score_and_observe(
            thread_B=d["thread"], ordinal_B=d["ordinal"], layer_B=d["layer"],
            target_ids_BK=d["target"])
        rows = len(d["layer"])
        side = sidecar_scores(rng, d["target"])
        prob = 1.0 / (1.0 + np.exp(-(side - 1.8) * 3.0))
        scores = {"random": rand.scores(rows), "sidecar": side,
                  "frequency": table.fill(d["layer"]) + rand.scores(rows) * 1e-6, **history}
        for m in methods:
            acc[m].update(target_ids_BK=d["target"], layer_B=d["layer"], split_B=split,
                          scores_BE=scores[m], domain_B=d["domain"], thread_B=d["thread"],
                          ordinal_B=d["ordinal"],
                          membership_prob_BE=prob if m == "sidecar" else None)
    return [acc[m].result() for m in methods]


def shadow(rng: np.random.Generator) -> dict[str, Any]:
    routes = np.concatenate([routes_for(rng, TOKENS) for _ in range(2)])
    trace = DecodeTrace(routes=routes, num_experts=EXPERTS,
                        sequence=np.repeat([0, 1], TOKENS))
    ranked = np.argsort(-sidecar_scores(rng, routes.reshape(-1, TOP_K)), axis=1,
                        kind="stable").reshape(len(routes), LAYERS, EXPERTS)
    builder, span = PredictionBuilder(), LAYERS + 1
    for row in range(len(routes)):
        for layer in range(LAYERS):
            ready = max(row * span + layer - 1, 0)
            builder.add(target_row=row, target_layer=layer, experts=ranked[row, layer, :8],
                        priority=1, ready_row=ready // span, ready_boundary=ready % span)
    predictions = builder.build()
    return {
        "metrics": shadow_io(trace, predictions.within_budget(TOP_K), SIM), "budget": TOP_K,
        "sim_config": SIM.to_dict(),
        "sweep": sweep(trace, predictions, SIM, bandwidths=(2.5e7, 5e7, 1e8, 1.5e8, 3e8, 1e9),
                       budgets=BUDGETS),
        "break_even": break_even(trace, {1: 1.0, 2: 1.6, 4: 2.5}),
        "oracle": shadow_io(trace, oracle_predictions(trace, lead_boundaries=1), SIM),
    }


def rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    if isinstance(value, float):
        return round(value, 9)
    return value


def integrity(data: dict) -> dict[str, Any]:
    splits = {}
    for i, split in enumerate(SPLITS):
        threads = sorted(set(data[split]["thread"].tolist()))
        splits[split] = {
            "owners": 3, "threads": len(threads), "windows": THREADS * 5,
            "owner_ids": [f"{split}-o{j}" for j in range(3)], "thread_ids": threads,
            "identity_digests": ["rt-7f3a9c"], "teacher_digests": ["teacher-11aa"],
            "tokenizer_digests": ["tok-22bb"],
            "coverage": {"domain": {"chat": 3, "code": 3}, "language": {"en": 5, "it": 1},
                         "prompt_length": {"0-512": 4, "512-2048": 2},
                         "tool_calls": {"none": 4, "some": 2 + i % 2}}}
    return {"splits": splits, "overlaps": [],
            "near_duplicates": {"found": 3, "removed": 3, "threshold": 0.9, "method": "minhash"},
            "authorization": {"policy": "synthetic-threads", "approved": True,
                              "production_transcripts": False, "deletion_supported": True},
            "consent": {"rows": 640, "rows_granted": 640, "owners": 12, "owners_refused": 0,
                        "checked_at_ms": 1_767_225_600_000,
                        "ledger": "flywheel.consent.ledger.v1", "refused_records": 4}}


def make() -> dict[str, Any]:
    rng = np.random.default_rng(21)
    data = split_rows(rng)
    results = offline_results(rng, data)
    sim = shadow(rng)
    side = next(r for r in results if r["method"] == "sidecar")
    recall = side["splits"]
    return rounded({
        "snapshot_id": "snap-0001", "checkpoint_lineage": ["ckpt-b", "ckpt-a"],
        "identity": {"runtime": "rt-7f3a9c", "teacher": "teacher-11aa", "tokenizer": "tok-22bb",
                     "model_family": "qwen3_next", "teacher_name": "tiny-qwen3-next"},
        "geometry": GEOMETRY.to_dict(),
        "expert_bytes": SIM.expert_bytes, "dtype_bytes": SIM.dtype_bytes,
        "parity": {"authoritative": True, "compared": 240, "mismatches": 0,
                   "per_layer_mismatch_rate": {str(k): 0.0 for k in range(LAYERS)},
                   "margin_quantiles": {"p01": 0.0031, "p50": 0.084}, "tokens_compared": 60,
                   "token_mismatches": 0, "position_mismatches": 0,
                   "prefix_digest_mismatches": 0},
        "determinism": {"snapshot_digest": "sha256-aa11", "rebuild_digest": "sha256-aa11",
                        "shards_compared": 4, "shards_differing": 0},
        "fail_closed": {"records_seen": 1000, "records_accepted": 990,
                        "quarantined": {"counter_regression": 4, "identity_digest_mismatch": 6}},
        "opaque_ids": [{"kind": "window_id", "checked": 48, "reused": 0,
                        "source": "window lineage columns of the snapshot's shards"},
                       {"kind": "sequence_id", "checked": 18, "reused": 0,
                        "source": "Window.turns[].sequence_id of the runtime_holdout windows"}],
        "integrity": integrity(data),
        "offline": {"candidate": "sidecar", "features": {"sidecar": "pre_attention"},
                    "results": results},
        "decode": {"budget": TOP_K,
                   "replay_validation_recall": recall["validation"]["overall"]["recall"]["4"],
                   "real_decode_recall": recall["runtime_holdout"]["overall"]["recall"]["4"],
                   "timely_recall": sim["metrics"]["timely_recall"],
                   "real_decode_rows": recall["runtime_holdout"]["overall"]["rows"]},
        "shadow_io": sim,
        "objective": {"name": "hide-ssd-wait", "min_exposed_wait_reduction": 0.2,
                      "max_p95_regression": 0.0, "max_p99_regression": 0.0},
        "throughput": {"loader_examples_per_s": 5200.0, "trainer_examples_per_s": 3100.0,
                       "device": "2-core CPU (not the 3090s)"},
        "collection": {"path": "clean", "tokens": 51200, "rows": 12800, "seconds": 64.0,
                       "tokens_per_s": 800.0, "rows_per_s": 200.0, "shards_measured": 4,
                       "shards": 4, "machines": ["x86_64 (2 CPUs)"],
                       "measured": "teacher prefill wall seconds (fixture)"},
    })


if __name__ == "__main__":
    OUT.write_text(json.dumps(make(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(OUT)
