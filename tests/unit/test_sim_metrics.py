"""Break-even check, metric edge cases and sweeps."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.train.sim import (
    DecodeTrace,
    SimConfig,
    TraceError,
    break_even,
    oracle_predictions,
    simulate,
    summarize,
    supported_block_sizes,
    sweep,
    unique_experts_per_layer,
)
from hebrus_flywheel.train.sim.simulator import _union_length

SHAPE = RouteGeometry(family="t", routed_layers=(0,), layer_count=1, expert_count=4, top_k=2,
                      hidden_size=10, routed_intermediate_size=10)
"""10 x 10 x 3 x 1 byte = 300-byte experts."""


def _config(**overrides: Any) -> SimConfig:
    fields: dict[str, Any] = {
        "geometry": SHAPE, "dtype_bytes": 1.0,
        "attention_time_s": 1e-3, "moe_time_s": 1e-3, "step_overhead_s": 0.0,
        "ssd_bandwidth_bytes_per_s": 3e5, "ssd_latency_s": 0.0, "ssd_queue_depth": 4,
        "cache_capacity_experts": 64,
    }
    fields.update(overrides)
    return SimConfig(**fields)


def _paired_trace() -> DecodeTrace:
    # one layer, top-2: tokens reuse their pair, then switch
    routes = np.array([[[0, 1]], [[1, 0]], [[2, 3]], [[3, 2]]])
    return DecodeTrace(routes=routes, num_experts=8)


def test_unique_experts_over_sliding_windows() -> None:
    trace = _paired_trace()
    assert unique_experts_per_layer(trace, 1) == (2.0, 4)
    # windows (0,1)=2, (1,2)=4, (2,3)=2
    u_b, windows = unique_experts_per_layer(trace, 2)
    assert windows == 3
    assert u_b == pytest.approx(8 / 3)
    assert unique_experts_per_layer(trace, 5) == (None, 0)


def test_break_even_verdicts() -> None:
    rows = break_even(_paired_trace(), {2: 1.5, 1: 1.0, 5: 2.0})
    assert [row["block_size"] for row in rows] == [1, 2, 5]
    by_size = {row["block_size"]: row for row in rows}
    assert by_size[1]["holds"] is False  # 2 < 2 * 1.0 is false
    assert by_size[2]["threshold"] == 3.0
    assert by_size[2]["holds"] is True  # 8/3 < 3
    assert by_size[5]["supported"] is False and by_size[5]["holds"] is None
    assert supported_block_sizes(_paired_trace(), [1, 2, 4, 5]) == [1, 2, 4]


def test_break_even_windows_stay_within_a_sequence_and_skip_rejected_rows() -> None:
    routes = np.array([[[0, 1]], [[2, 3]], [[0, 1]], [[4, 5]]])
    trace = DecodeTrace(routes=routes, num_experts=8, sequence=np.array([0, 1, 0, 0]),
                        accepted=np.array([True, True, True, False]))
    # sequence 0 accepted rows: 0 and 2 (same pair); sequence 1 has one row
    assert unique_experts_per_layer(trace, 2) == (2.0, 1)


def test_break_even_refuses_impossible_tau() -> None:
    with pytest.raises(TraceError, match="tau"):
        break_even(_paired_trace(), {2: 3.0})
    with pytest.raises(TraceError, match="block size"):
        unique_experts_per_layer(_paired_trace(), 0)


def test_union_length_merges_overlaps() -> None:
    assert _union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == 4.0
    assert _union_length([]) == 0.0


def test_summary_is_json_ready_and_ratios_of_nothing_are_none() -> None:
    trace = DecodeTrace(routes=np.array([[[0]], [[0]]]), num_experts=2)
    metrics = summarize(simulate(trace, None, _config()))
    json.dumps(metrics, allow_nan=False)
    assert metrics["useful_prefetch_ratio"] is None
    assert metrics["slack_p50_s"] is None
    assert metrics["recall"] == 0.0
    assert metrics["ready_fraction"] == 0.5


def test_sweep_rows_cover_the_grid() -> None:
    routes = np.arange(12).reshape(6, 1, 2) % 10
    trace = DecodeTrace(routes=routes.repeat(2, axis=1), num_experts=10)
    rows = sweep(trace, oracle_predictions(trace, lead_boundaries=2), _config(),
                 bandwidths=[3e4, 3e8], budgets=[0, 1, None])
    assert [(r["ssd_bandwidth_bytes_per_s"], r["candidate_budget"]) for r in rows] == [
        (3e4, 0), (3e4, 1), (3e4, None), (3e8, 0), (3e8, 1), (3e8, None)]
    for row in rows:
        if row["candidate_budget"] == 0:
            assert row["exact_misses_avoided"] == 0
            assert row["exposed_wait_s"] == row["baseline_exposed_wait_s"]
    slow_full = rows[2]["timely_recall"]
    assert rows[-1]["timely_recall"] == 1.0
    assert isinstance(slow_full, float) and slow_full < 1.0
    assert rows[4]["recall"] == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        sweep(trace, oracle_predictions(trace), _config(), bandwidths=[], budgets=[None])
