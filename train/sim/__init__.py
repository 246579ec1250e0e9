"""Trace-driven shadow SSD-prefetch simulator (Gate 4 timely recall, Gate 5 shadow I/O).

Pure functions over numpy arrays; no I/O. Typical use::

    from hebrus_flywheel.train.sim import DecodeTrace, PredictionBuilder, SimConfig, shadow_io

    trace = DecodeTrace(routes=routes, num_experts=512)   # routes: (rows, layers, K)
    metrics = shadow_io(trace, predictions, SimConfig(ssd_bandwidth_bytes_per_s=5e9))

See :mod:`train.sim.trace` for the data format, :mod:`train.sim.simulator` for the
timeline, :mod:`train.sim.ssd` and :mod:`train.sim.cache` for the device and cache
models, and :mod:`train.sim.metrics` for the metric definitions.
"""

from __future__ import annotations

from hebrus_flywheel.train.sim.config import EVICTION_POLICIES, SimConfig
from hebrus_flywheel.train.sim.errors import SimulationError, TraceError
from hebrus_flywheel.train.sim.metrics import (
    Metrics,
    break_even,
    summarize,
    supported_block_sizes,
    unique_experts_per_layer,
)
from hebrus_flywheel.train.sim.predictors import oracle_predictions, previous_token_predictions
from hebrus_flywheel.train.sim.simulator import COUNTERS, SimResult, simulate
from hebrus_flywheel.train.sim.sweep import shadow_io, sweep
from hebrus_flywheel.train.sim.trace import (
    DecodeTrace,
    PredictionBuilder,
    PredictionSet,
    boundary_key,
    moe_key,
)

__all__ = [
    "COUNTERS",
    "EVICTION_POLICIES",
    "DecodeTrace",
    "Metrics",
    "PredictionBuilder",
    "PredictionSet",
    "SimConfig",
    "SimResult",
    "SimulationError",
    "TraceError",
    "boundary_key",
    "break_even",
    "moe_key",
    "oracle_predictions",
    "previous_token_predictions",
    "shadow_io",
    "simulate",
    "summarize",
    "supported_block_sizes",
    "sweep",
    "unique_experts_per_layer",
]
