"""Reference predictors over a trace: an oracle (for upper bounds and tests) and the
previous-token same-layer history control. Both return a
:class:`~train.sim.trace.PredictionSet` the simulator can replay."""

from __future__ import annotations

import numpy as np

from hebrus_flywheel.train.sim.errors import TraceError
from hebrus_flywheel.train.sim.trace import DecodeTrace, PredictionBuilder, PredictionSet


def _step_first_rows(trace: DecodeTrace) -> np.ndarray:
    return np.flatnonzero(np.diff(trace.step_index, prepend=-1))


def oracle_predictions(trace: DecodeTrace, *, priority: int = 1,
                       lead_boundaries: int = 0) -> PredictionSet:
    """The exact route of every (row, layer), issued ``lead_boundaries`` event
    boundaries before the start of that layer (0: at the layer's pre-attention feature;
    counting back across steps, each step having ``layers + 1`` boundaries; clamped to
    the trace's first boundary)."""
    if isinstance(lead_boundaries, bool) or not isinstance(lead_boundaries, int) \
            or lead_boundaries < 0:
        raise TraceError(f"lead_boundaries must be an integer >= 0, got {lead_boundaries!r}")
    first_rows = _step_first_rows(trace)
    span = trace.num_layers + 1
    builder = PredictionBuilder()
    for row in range(trace.num_rows):
        step = int(trace.step_index[row])
        for layer in range(trace.num_layers):
            ready = max(step * span + layer - lead_boundaries, 0)
            builder.add(target_row=row, target_layer=layer,
                        experts=trace.routes[row, layer].tolist(), priority=priority,
                        ready_row=int(first_rows[ready // span]),
                        ready_boundary=ready % span)
    return builder.build()


def previous_token_predictions(trace: DecodeTrace, *, priority: int = 1) -> PredictionSet:
    """For every row with an earlier row in its sequence, that row's route at the same
    layer, issued at the start of the layer (the history control of Gate 3)."""
    builder = PredictionBuilder()
    last: dict[int, int] = {}
    for row in range(trace.num_rows):
        seq = int(trace.sequence[row])
        previous = last.get(seq)
        if previous is not None and trace.step_index[previous] < trace.step_index[row]:
            for layer in range(trace.num_layers):
                builder.add(target_row=row, target_layer=layer,
                            experts=trace.routes[previous, layer].tolist(),
                            priority=priority, ready_row=row, ready_boundary=layer)
        if trace.accepted[row]:
            last[seq] = row
    return builder.build()
