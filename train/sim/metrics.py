"""The design note's I/O metrics from a :class:`~train.sim.simulator.SimResult`, and the
speculative-block break-even check.

Definitions (AFN-021, "Metrics that prevent self-deception"):

* timely recall = exact selected experts ready before their deadline / exact selected
  experts. Here "ready" means resident when the MoE was due, and the numerator counts
  only experts a (non-rejected) prediction named for that MoE, so it is the predictor's
  timely recall: ``recall`` drops the timing condition, ``ready_fraction`` drops the
  prediction condition (cache reuse alone earns it).
* useful prefetch ratio = predicted physical bytes consumed / predicted bytes read.
* byte amplification = total physical expert bytes read / accepted output tokens
  (``byte_amplification_vs_topk`` divides it by the bytes of one token's top-K experts
  at every layer, the cold autoregressive cost).
* hidden fraction = 1 - exposed exact wait / exact I/O wall time (the union of the
  [submit, land] intervals of reads that served exact experts).

Per-step figures (``exposed_wait_step_p95_s``/``p99``, over forward steps) are per
token in plain decode, where a step is one token; ``exposed_wait_per_token_s`` is the
total over accepted tokens. A ratio whose denominator is zero is ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hebrus_flywheel.train.sim.errors import TraceError
from hebrus_flywheel.train.sim.simulator import SimResult
from hebrus_flywheel.train.sim.trace import DecodeTrace

Metrics = dict[str, float | int | bool | None]


def _ratio(numerator: float, denominator: float) -> float | None:
    return None if denominator == 0 else float(numerator) / float(denominator)


def _percentile(values: np.ndarray, q: float) -> float | None:
    return None if values.size == 0 else float(np.percentile(values, q))


def _hidden_fraction(exposed: float, io_wall: float) -> float | None:
    if io_wall == 0:
        return None
    # exposed wait lies inside the I/O intervals; clamp float round-off only
    return min(1.0, max(0.0, 1.0 - exposed / io_wall))


def summarize(result: SimResult, baseline: SimResult | None = None) -> Metrics:
    """Flat metrics of ``result``; with ``baseline`` (the same trace and config without
    predictions) also misses avoided and the exposed-wait reduction."""
    c = result.counters
    waits = result.step_wait_s
    exposed = float(waits.sum())
    per_token_cold = result.num_layers * result.top_k * result.expert_bytes
    amplification = _ratio(c["physical_bytes_read"], result.accepted_tokens)
    metrics: Metrics = {
        "accepted_tokens": result.accepted_tokens,
        "steps": result.num_steps,
        "expert_bytes": result.expert_bytes,
        "timely_recall": _ratio(c["demands_predicted_ready"], c["demands"]),
        "recall": _ratio(c["demands_predicted"], c["demands"]),
        "ready_fraction": _ratio(c["demands_ready"], c["demands"]),
        "useful_prefetch_ratio": _ratio(c["useful_bytes"], c["predicted_bytes_read"]),
        "byte_amplification": amplification,
        "byte_amplification_vs_topk": None if amplification is None
        else amplification / per_token_cold,
        "hidden_fraction": _hidden_fraction(exposed, result.exact_io_wall_time_s),
        "exposed_wait_s": exposed,
        "exposed_wait_per_token_s": _ratio(exposed, result.accepted_tokens),
        "exposed_wait_step_p95_s": _percentile(waits, 95),
        "exposed_wait_step_p99_s": _percentile(waits, 99),
        "exact_io_wall_time_s": result.exact_io_wall_time_s,
        "slack_p05_s": _percentile(result.slack_s, 5),
        "slack_p50_s": _percentile(result.slack_s, 50),
        "slack_p95_s": _percentile(result.slack_s, 95),
        "sim_time_s": result.sim_time_s,
        "tokens_per_s": _ratio(result.accepted_tokens, result.sim_time_s),
    }
    metrics.update(c)
    if baseline is not None:
        metrics.update(_versus(result, baseline, exposed))
    return metrics


def _versus(result: SimResult, baseline: SimResult, exposed: float) -> Metrics:
    if (baseline.num_rows, baseline.num_layers) != (result.num_rows, result.num_layers):
        raise TraceError("the baseline was simulated on a different trace; simulate the "
                         "same trace without predictions")
    base_exposed = float(baseline.step_wait_s.sum())
    base_misses = baseline.counters["exact_misses"]
    reduction = _ratio(base_exposed - exposed, base_exposed)
    if result.demand_polluted.shape != baseline.demand_ready.shape:
        raise TraceError("the baseline served a different number of exact demands; "
                         "simulate the same trace without predictions")
    # Pollution proper: a miss a prefetch's eviction caused, i.e. one the no-prediction
    # cache would have served. The gross counter also holds misses that LRU alone
    # would have taken, because the expert aged out of the cache anyway.
    caused = int(np.count_nonzero(result.demand_polluted & baseline.demand_ready))
    return {
        "baseline_exact_misses": base_misses,
        "exact_misses_avoided": base_misses - result.counters["exact_misses"],
        "pollution_misses_vs_baseline": caused,
        "baseline_exposed_wait_s": base_exposed,
        "exposed_wait_reduction": reduction,
        "baseline_exposed_wait_step_p95_s": _percentile(baseline.step_wait_s, 95),
        "baseline_exposed_wait_step_p99_s": _percentile(baseline.step_wait_s, 99),
        "baseline_physical_bytes_read": baseline.counters["physical_bytes_read"],
        "baseline_tokens_per_s": _ratio(baseline.accepted_tokens, baseline.sim_time_s),
    }


def unique_experts_per_layer(trace: DecodeTrace, block_size: int) -> tuple[float | None, int]:
    """``(U_B, windows)``: the mean over every window of ``block_size`` consecutive
    accepted rows of one sequence (sliding, in trace order) and over layers of the number
    of distinct experts the window's rows route to at that layer. ``U_B`` is None when
    no sequence has ``block_size`` accepted rows."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise TraceError(f"block size must be a positive integer, got {block_size!r}")
    total, windows = 0.0, 0
    for seq in np.unique(trace.sequence).tolist():
        routes = trace.routes[(trace.sequence == seq) & trace.accepted]
        if routes.shape[0] < block_size:
            continue
        view = sliding_window_view(routes, block_size, axis=0)
        flat = np.sort(view.reshape(view.shape[0], trace.num_layers, -1), axis=2)
        distinct = 1 + np.count_nonzero(flat[:, :, 1:] != flat[:, :, :-1], axis=2)
        total += float(distinct.sum())
        windows += int(view.shape[0])
    if windows == 0:
        return None, 0
    return total / (windows * trace.num_layers), windows


def break_even(trace: DecodeTrace, tau: Mapping[int, float]) -> list[Metrics]:
    """The routed-byte break-even ``U_B < K * tau(B)`` for each block size in ``tau``
    (expected accepted tokens per block of size B), one row per B in ascending order.
    ``supported`` is False (and ``holds`` None) when the trace has no window of size B.
    U_B comes from committed tokens, so it approximates the union a verifier would read
    when the whole proposed block is accepted."""
    rows: list[Metrics] = []
    for size in sorted(tau):
        expected = float(tau[size])
        if not np.isfinite(expected) or not 0.0 < expected <= size:
            raise TraceError(f"tau({size}) must lie in (0, {size}], got {tau[size]!r}")
        u_b, windows = unique_experts_per_layer(trace, size)
        threshold = trace.top_k * expected
        rows.append({
            "block_size": size, "tau": expected, "u_b": u_b, "threshold": threshold,
            "holds": None if u_b is None else bool(u_b < threshold),
            "windows": windows, "supported": u_b is not None,
        })
    return rows


def supported_block_sizes(trace: DecodeTrace, candidates: Sequence[int]) -> list[int]:
    """The sizes in ``candidates`` for which the trace has at least one window."""
    return [size for size in candidates if unique_experts_per_layer(trace, size)[1] > 0]
