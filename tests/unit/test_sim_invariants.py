"""Accounting invariants of the simulator on small random traces and predictions."""

from __future__ import annotations

import numpy as np
import pytest

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.train.sim import (
    DecodeTrace,
    PredictionBuilder,
    PredictionSet,
    SimConfig,
    simulate,
)


def _case(seed: int) -> tuple[DecodeTrace, PredictionSet, SimConfig]:
    rng = np.random.default_rng(seed)
    rows, layers, k = int(rng.integers(1, 20)), int(rng.integers(1, 4)), 2
    experts = int(rng.integers(3, 10))
    routes = np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)]
                       for _ in range(rows)])
    step = np.sort(rng.integers(0, rows, rows)) if seed % 3 == 0 else np.arange(rows)
    trace = DecodeTrace(routes=routes, num_experts=experts, step=step,
                        accepted=rng.random(rows) < 0.8)
    span = layers + 1
    first_rows = np.flatnonzero(np.diff(trace.step_index, prepend=-1))
    builder = PredictionBuilder()
    for _ in range(2 * rows * layers):
        row, layer = int(rng.integers(rows)), int(rng.integers(layers))
        target = int(trace.step_index[row]) * span + layer
        ready = int(rng.integers(max(0, target - 2 * span), target + 1))
        builder.add(target_row=row, target_layer=layer,
                    experts=rng.choice(experts, 3, replace=False).tolist(),
                    priority=int(rng.integers(1, 3)), ready_row=int(first_rows[ready // span]),
                    ready_boundary=ready % span, rejected_suffix=bool(rng.random() < 0.2))
    config = SimConfig(
        geometry=RouteGeometry(family="t", routed_layers=(0,), layer_count=1,
                               expert_count=4, top_k=2, hidden_size=10,
                               routed_intermediate_size=10), dtype_bytes=1.0,
        attention_time_s=1e-3, moe_time_s=1e-3, step_overhead_s=0.0,
        predictor_latency_s=float(rng.choice([0.0, 5e-4])),
        ssd_bandwidth_bytes_per_s=float(rng.choice([3e3, 3e5, 1e12])),
        ssd_latency_s=float(rng.choice([0.0, 1e-4])), ssd_queue_depth=int(rng.integers(1, 4)),
        cache_capacity_experts=2 * k * rows + int(rng.integers(0, 6)),
        eviction="lru" if seed % 2 else "priority")
    return trace, builder.build(), config


@pytest.mark.parametrize("seed", range(40))
def test_accounting_invariants(seed: int) -> None:
    trace, predictions, config = _case(seed)
    result = simulate(trace, predictions, config)
    c = result.counters
    assert c["demands_predicted_ready"] <= min(c["demands_predicted"], c["demands_ready"])
    assert c["demands_ready"] + c["exact_misses"] == c["demands"]
    assert c["physical_bytes_read"] == c["predicted_bytes_read"] + c["exact_bytes_read"]
    assert c["useful_bytes"] <= c["predicted_bytes_read"]
    assert c["rejected_suffix_bytes"] <= c["predicted_bytes_read"]
    outcomes = ("predictions_issued", "predictions_already_cached",
                "predictions_dropped_no_space", "predictions_issued_after_deadline")
    assert sum(c[name] for name in outcomes) == c["predictions_total"]
    assert (result.step_wait_s >= 0).all()
    assert result.step_wait_s.sum() <= result.exact_io_wall_time_s * (1 + 1e-9) + 1e-12
