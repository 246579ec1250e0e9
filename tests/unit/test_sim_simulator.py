"""The simulator on hand-made traces whose answers are known.

Unless a test says otherwise: one expert is 300 bytes (10 × 10 × 3 × 1), attention and
MoE take 1 ms per layer, there is no step overhead and no SSD latency.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.train.sim import (
    DecodeTrace,
    PredictionBuilder,
    PredictionSet,
    SimConfig,
    SimulationError,
    oracle_predictions,
    previous_token_predictions,
    shadow_io,
    simulate,
    summarize,
)

MS = 1e-3
EXPERT = 300

SHAPE = RouteGeometry(family="t", routed_layers=(0,), layer_count=1, expert_count=4, top_k=2,
                      hidden_size=10, routed_intermediate_size=10)
"""10 x 10 x 3 x 1 byte = 300-byte experts."""


def _config(**overrides: Any) -> SimConfig:
    fields: dict[str, Any] = {
        "geometry": SHAPE, "dtype_bytes": 1.0,
        "attention_time_s": MS, "moe_time_s": MS, "step_overhead_s": 0.0,
        "ssd_bandwidth_bytes_per_s": EXPERT / MS, "ssd_latency_s": 0.0,
        "ssd_queue_depth": 4, "cache_capacity_experts": 64, "eviction": "priority",
    }
    fields.update(overrides)
    return SimConfig(**fields)


def _distinct_trace(tokens: int = 5, layers: int = 3, k: int = 2) -> DecodeTrace:
    """Every token uses new experts at every layer: no cache reuse is possible."""
    routes = np.arange(tokens * k).reshape(tokens, 1, k).repeat(layers, axis=1)
    return DecodeTrace(routes=routes, num_experts=tokens * k)


def _three_tokens(**kwargs: Any) -> DecodeTrace:
    routes = np.array([[[0, 1], [0, 1]], [[1, 2], [0, 1]], [[2, 3], [4, 5]]])
    return DecodeTrace(routes=routes, num_experts=32, **kwargs)


def _one_layer(experts: list[int], num_experts: int = 8) -> DecodeTrace:
    return DecodeTrace(routes=np.array(experts).reshape(-1, 1, 1), num_experts=num_experts)


def test_perfect_predictor_with_ample_bandwidth_hides_everything() -> None:
    trace = _distinct_trace()
    config = _config(ssd_bandwidth_bytes_per_s=1e12, ssd_latency_s=1e-6)
    metrics = shadow_io(trace, oracle_predictions(trace, lead_boundaries=3), config)
    assert metrics["timely_recall"] == 1.0
    assert metrics["recall"] == 1.0
    assert metrics["exposed_wait_s"] == 0.0
    assert metrics["exposed_wait_step_p99_s"] == 0.0
    assert metrics["hidden_fraction"] == 1.0
    assert metrics["useful_prefetch_ratio"] == 1.0
    assert metrics["exact_misses"] == 0
    assert metrics["exact_misses_avoided"] == metrics["baseline_exact_misses"] == 30
    earliest = metrics["slack_p05_s"]
    assert isinstance(earliest, float) and earliest > 0
    assert metrics["p0_starvation_attempts"] == 0


def test_almost_zero_bandwidth_makes_every_prediction_late() -> None:
    trace = _distinct_trace()
    config = _config(ssd_bandwidth_bytes_per_s=1.0)
    metrics = summarize(simulate(trace, oracle_predictions(trace, lead_boundaries=3), config))
    assert metrics["recall"] == 1.0
    assert metrics["timely_recall"] == 0.0
    assert metrics["late_prefetches"] == metrics["exact_misses"] == 30
    latest = metrics["slack_p95_s"]
    assert isinstance(latest, float) and latest < 0


def test_huge_latency_makes_layer_start_predictions_late() -> None:
    trace = _distinct_trace()
    metrics = summarize(simulate(trace, oracle_predictions(trace), _config(ssd_latency_s=1e9)))
    assert metrics["timely_recall"] == 0.0
    assert metrics["hidden_fraction"] == pytest.approx(0.0, abs=1e-9)


def test_byte_amplification_arithmetic_on_three_tokens() -> None:
    metrics = summarize(simulate(_three_tokens(), None, _config()))
    # distinct (layer, expert): layer 0 {0,1,2,3}, layer 1 {0,1,4,5} -> 8 reads
    assert metrics["physical_bytes_read"] == 8 * EXPERT
    assert metrics["byte_amplification"] == 8 * EXPERT / 3
    assert metrics["byte_amplification_vs_topk"] == pytest.approx((8 / 3) / (2 * 2))
    assert (metrics["demands"], metrics["exact_misses"], metrics["demands_ready"]) == (12, 8, 4)
    assert metrics["useful_prefetch_ratio"] is None
    assert metrics["timely_recall"] == 0.0


def test_byte_amplification_counts_only_accepted_tokens() -> None:
    # rows 0 and 1 are one verification step; row 1 was rejected
    trace = _three_tokens(step=np.array([0, 0, 1]), accepted=np.array([True, False, True]))
    metrics = summarize(simulate(trace, None, _config()))
    assert metrics["physical_bytes_read"] == 8 * EXPERT
    assert metrics["byte_amplification"] == 8 * EXPERT / 2
    # step 0 needs the union per layer: {0,1,2} and {0,1}; step 1: {2,3} and {4,5}
    assert (metrics["demands"], metrics["exact_misses"]) == (9, 8)


def _oracle_plus(extra: int, *, rejected: bool) -> PredictionSet:
    builder = PredictionBuilder()
    trace = _three_tokens()
    for row in range(3):
        for layer in range(2):
            builder.add(target_row=row, target_layer=layer,
                        experts=trace.routes[row, layer].tolist(), priority=1,
                        ready_row=row, ready_boundary=layer)
    builder.add(target_row=2, target_layer=1, experts=[extra], priority=2, ready_row=2,
                ready_boundary=0, rejected_suffix=rejected)
    return builder.build()


def test_useful_prefetch_ratio_with_one_wasted_prediction() -> None:
    config = _config(ssd_bandwidth_bytes_per_s=1e12)
    metrics = summarize(simulate(_three_tokens(), _oracle_plus(7, rejected=False), config))
    assert metrics["predicted_bytes_read"] == 9 * EXPERT
    assert metrics["useful_bytes"] == 8 * EXPERT
    assert metrics["useful_prefetch_ratio"] == pytest.approx(8 / 9)
    assert metrics["rejected_suffix_bytes"] == 0
    assert metrics["timely_recall"] == 1.0


def test_rejected_suffix_bytes_are_counted_and_never_credited() -> None:
    config = _config(ssd_bandwidth_bytes_per_s=1e12)
    trace = _three_tokens()
    metrics = summarize(simulate(trace, _oracle_plus(4, rejected=True), config))
    # expert 4 of layer 1 *is* needed by row 2, but only the rejected path named it first:
    # its bytes are rejected-suffix bytes, yet the row's own prediction still counts.
    assert metrics["rejected_suffix_bytes"] == EXPERT
    assert metrics["recall"] == 1.0
    only_rejected = _oracle_plus(7, rejected=True).select(np.arange(13) == 12)
    metrics = summarize(simulate(trace, only_rejected, config))
    assert metrics["recall"] == 0.0
    assert metrics["rejected_suffix_bytes"] == EXPERT


def _wrong_p2(trace: DecodeTrace, per_target: int, first_expert: int) -> PredictionSet:
    builder = PredictionBuilder()
    expert = first_expert
    for row in range(trace.num_rows):
        for layer in range(trace.num_layers):
            experts = list(range(expert, expert + per_target))
            expert += per_target
            builder.add(target_row=row, target_layer=layer, experts=experts, priority=2,
                        ready_row=0, ready_boundary=0)
    return builder.build()


@pytest.mark.parametrize("depth", [1, 3])
def test_p0_is_never_delayed_by_queued_p2(depth: int) -> None:
    trace = _three_tokens()
    config = _config(ssd_queue_depth=depth, ssd_latency_s=0.2 * MS)
    baseline = simulate(trace, None, config)
    noisy = simulate(trace, _wrong_p2(trace, per_target=4, first_expert=8), config)
    assert noisy.counters["predictions_issued"] == 24
    assert noisy.counters["p0_starvation_attempts"] > 0
    assert noisy.counters["exact_misses"] == baseline.counters["exact_misses"]
    np.testing.assert_allclose(noisy.step_wait_s, baseline.step_wait_s, rtol=1e-9)


def test_lru_eviction_counts() -> None:
    metrics = summarize(simulate(_one_layer([0, 1, 2, 3, 0]), None,
                                 _config(cache_capacity_experts=2, eviction="lru")))
    assert (metrics["evictions"], metrics["exact_misses"]) == (3, 5)
    assert metrics["evictions_by_prefetch"] == 0


def _early_p2(target_row: int, expert: int, ready_row: int, boundary: int) -> PredictionSet:
    builder = PredictionBuilder()
    builder.add(target_row=target_row, target_layer=0, experts=[expert], priority=2,
                ready_row=ready_row, ready_boundary=boundary)
    return builder.build()


def test_priority_eviction_protects_a_live_prefetch_that_lru_evicts() -> None:
    trace = _one_layer([0, 1, 2])
    predictions = _early_p2(target_row=2, expert=2, ready_row=0, boundary=0)
    lru = simulate(trace, predictions, _config(cache_capacity_experts=2, eviction="lru"))
    aware = simulate(trace, predictions, _config(cache_capacity_experts=2))
    assert (lru.counters["evictions"], lru.counters["exact_misses"]) == (2, 3)
    assert (aware.counters["evictions"], aware.counters["exact_misses"]) == (1, 2)
    assert aware.counters["demands_predicted_ready"] == 1


def test_priority_eviction_drops_a_dead_prefetch_first() -> None:
    trace = _one_layer([0, 1, 0])
    predictions = _early_p2(target_row=1, expert=5, ready_row=1, boundary=0)  # wrong
    lru = simulate(trace, predictions, _config(cache_capacity_experts=2, eviction="lru"))
    aware = simulate(trace, predictions, _config(cache_capacity_experts=2))
    assert lru.counters["exact_misses"] == 3  # evicted expert 0, needed again
    assert aware.counters["exact_misses"] == 2  # evicted the unused expert 5
    assert (aware.counters["evictions"], lru.counters["evictions"]) == (1, 2)


def test_evictions_caused_by_prefetch_and_the_misses_they_cause() -> None:
    trace = _one_layer([0, 1, 0])
    predictions = _early_p2(target_row=2, expert=5, ready_row=1, boundary=1)  # end of step 1
    result = simulate(trace, predictions, _config(cache_capacity_experts=2, eviction="lru"))
    assert result.counters["evictions_by_prefetch"] == 1
    assert result.counters["pollution_misses"] == 1
    baseline = simulate(trace, None, _config(cache_capacity_experts=2, eviction="lru"))
    assert summarize(result, baseline)["pollution_misses_vs_baseline"] == 1
    assert result.demand_polluted.tolist() == [False, False, True]
    assert baseline.demand_ready.tolist() == [False, False, True]


def test_a_miss_the_cache_would_have_taken_anyway_is_no_pollution() -> None:
    """Expert 0 is evicted by a prefetch, but without it expert 2 would have evicted it
    before its next use: the miss on 0 counts in the gross figure only."""
    trace = _one_layer([0, 1, 2, 0])
    predictions = _early_p2(target_row=2, expert=5, ready_row=1, boundary=1)
    config = _config(cache_capacity_experts=2, eviction="lru")
    result = simulate(trace, predictions, config)
    metrics = summarize(result, simulate(trace, None, config))
    assert result.counters["pollution_misses"] == 1
    assert metrics["pollution_misses_vs_baseline"] == 0


def test_undispatched_prefetch_expires_and_partial_bytes_count() -> None:
    trace = _one_layer([0])
    predictions = _early_p2(target_row=0, expert=7, ready_row=0, boundary=0)  # wrong
    config = _config(ssd_queue_depth=1, ssd_bandwidth_bytes_per_s=EXPERT / (10 * MS))
    metrics = summarize(simulate(trace, predictions, config))
    # the P2 read moved 30 bytes in the first 1 ms, then gave its slot to the P0
    assert metrics["p0_starvation_attempts"] == 1
    assert metrics["predictions_expired"] == 1
    assert metrics["physical_bytes_read"] == EXPERT + 30
    assert metrics["predicted_bytes_read"] == 30
    assert metrics["useful_prefetch_ratio"] == 0.0
    assert metrics["exposed_wait_s"] == pytest.approx(10 * MS)


def test_hidden_fraction_and_slack_of_a_late_prefetch() -> None:
    trace = _one_layer([0])
    config = _config(ssd_bandwidth_bytes_per_s=EXPERT / (3 * MS))
    metrics = summarize(simulate(trace, oracle_predictions(trace), config))
    assert metrics["late_prefetches"] == 1
    assert metrics["exposed_wait_s"] == pytest.approx(2 * MS)
    assert metrics["exact_io_wall_time_s"] == pytest.approx(3 * MS)
    assert metrics["hidden_fraction"] == pytest.approx(1 / 3)
    assert metrics["slack_p50_s"] == pytest.approx(-2 * MS)
    assert (metrics["recall"], metrics["timely_recall"]) == (1.0, 0.0)


def test_predictor_latency_past_the_deadline_is_counted() -> None:
    trace = _distinct_trace(tokens=2, layers=1, k=1)
    config = _config(predictor_latency_s=5 * MS)
    result = simulate(trace, oracle_predictions(trace), config)
    assert result.counters["predictions_issued_after_deadline"] == 2
    assert result.counters["predictions_issued"] == 0


def test_cache_smaller_than_one_layer_is_refused() -> None:
    with pytest.raises(SimulationError, match="cache_capacity_experts"):
        simulate(_three_tokens(), None, _config(cache_capacity_experts=1))


def test_same_inputs_give_identical_results() -> None:
    rng = np.random.default_rng(7)
    routes = np.stack([[rng.choice(24, 3, replace=False) for _ in range(4)]
                       for _ in range(40)])
    trace = DecodeTrace(routes=routes, num_experts=24, sequence=np.arange(40) % 2)
    oracle = oracle_predictions(trace, priority=2, lead_boundaries=6)
    history = previous_token_predictions(trace)
    predictions = PredictionSet.concatenate(oracle, history)
    config = _config(cache_capacity_experts=20, ssd_latency_s=0.1 * MS,
                     predictor_latency_s=0.3 * MS, ssd_queue_depth=2)
    first = shadow_io(trace, predictions, config)
    second = shadow_io(trace, predictions, config)
    assert first == second
    assert first["predictions_issued"] and first["evictions_by_prefetch"]


def test_prefetch_still_in_flight_at_the_end_counts_its_bytes_so_far() -> None:
    trace = _one_layer([0])
    predictions = _early_p2(target_row=0, expert=7, ready_row=0, boundary=0)  # wrong
    config = _config(ssd_queue_depth=4, ssd_bandwidth_bytes_per_s=EXPERT / (10 * MS))
    metrics = summarize(simulate(trace, predictions, config))
    # 30 bytes before the P0 took the channel at 1 ms, 30 more during the 1 ms MoE
    assert metrics["predictions_expired"] == 0
    assert metrics["predicted_bytes_read"] == 60
    assert metrics["physical_bytes_read"] == EXPERT + 60
    assert metrics["p0_starvation_attempts"] == 1


SKIPPING = RouteGeometry(family="zaya", routed_layers=(0,), layer_count=1, expert_count=4,
                         top_k=1, hidden_size=10, routed_intermediate_size=10,
                         weight_rule="softmax+bias_topk_skiplast")
"""Three experts and a skip class (id 3), top-1."""


def test_a_skip_class_needs_no_read_and_a_predicted_skip_is_not_fetched() -> None:
    """Tokens that select the skip class run no expert: no demand, no miss, no bytes;
    a prediction naming it names no weights, so it issues no read either."""
    routes = [0, 3, 3, 1, 3]
    trace = DecodeTrace(routes=np.array(routes).reshape(-1, 1, 1), num_experts=4,
                        skip_expert=3)
    config = _config(geometry=SKIPPING)
    result = simulate(trace, None, config)
    assert result.counters["demands"] == 2 == result.counters["exact_misses"]
    assert result.counters["physical_bytes_read"] == 2 * EXPERT
    oracle = simulate(trace, oracle_predictions(trace), config)
    assert len(oracle_predictions(trace)) == 5  # the oracle names the skips too
    assert oracle.counters["predictions_total"] == 2  # but only experts are read
    assert oracle.counters["physical_bytes_read"] == 2 * EXPERT
    assert oracle.counters["demands_predicted"] == 2
    with pytest.raises(SimulationError, match="skip class"):
        simulate(DecodeTrace(routes=trace.routes, num_experts=4), None, config)
    with pytest.raises(SimulationError, match="skip class"):
        simulate(trace, None, _config())
