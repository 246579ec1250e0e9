"""Sweeps of the shadow simulation over SSD bandwidth and candidate budget."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.sim.config import SimConfig
from hebrus_flywheel.train.sim.metrics import Metrics, summarize
from hebrus_flywheel.train.sim.simulator import simulate
from hebrus_flywheel.train.sim.trace import DecodeTrace, PredictionSet


def shadow_io(trace: DecodeTrace, predictions: PredictionSet,
              config: SimConfig | None = None) -> Metrics:
    """Gate-5 shadow I/O: metrics of ``predictions`` against the no-prediction run of
    the same trace and config (for misses avoided and the exposed-wait reduction)."""
    config = SimConfig() if config is None else config
    baseline = simulate(trace, None, config)
    return summarize(simulate(trace, predictions, config), baseline=baseline)


def sweep(trace: DecodeTrace, predictions: PredictionSet, config: SimConfig, *,
          bandwidths: Sequence[float], budgets: Sequence[int | None]) -> list[Metrics]:
    """One tidy row per (bandwidth, budget): ``ssd_bandwidth_bytes_per_s``,
    ``candidate_budget`` (None = every candidate) and every :func:`summarize` metric
    against the no-prediction baseline at that bandwidth. Rows follow the order given."""
    if not bandwidths or not budgets:
        raise ConfigError("bandwidths and budgets must each name at least one value")
    rows: list[Metrics] = []
    for bandwidth in bandwidths:
        point = replace(config, ssd_bandwidth_bytes_per_s=bandwidth)
        baseline = simulate(trace, None, point)
        for budget in budgets:
            result = simulate(trace, predictions.within_budget(budget), point)
            row: Metrics = {"ssd_bandwidth_bytes_per_s": float(bandwidth),
                            "candidate_budget": budget}
            row.update(summarize(result, baseline=baseline))
            rows.append(row)
    return rows
