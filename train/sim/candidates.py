"""Model B's predictions as P2 hints in the shadow I/O simulator.

:func:`candidate_block_trace` turns candidate-path rows into a speculative decode trace:
one forward step per proposal, whose rows are the candidate positions 1..B of the path
the verifier commits (the longest accepted prefix, the lowest path id on a tie); rows
past the accepted prefix are executed but not accepted (rejected suffix).

:func:`p2_hints` issues each row's ranked candidate experts at priority 2, ready at the
end of the previous step's target forward (boundary L, where a DFlash drafter reads its
context taps and proposes the next block; the first step: its own boundary 0). Hints
for rejected rows are rejected-suffix reads (the simulator counts their bytes as such).

Legend: T trace rows, L layers, K top-k, C ranked candidates per row.
"""

from __future__ import annotations

import numpy as np

from hebrus_flywheel.train.candidates.rows import CandidateRows
from hebrus_flywheel.train.sim.config import SimConfig
from hebrus_flywheel.train.sim.metrics import Metrics
from hebrus_flywheel.train.sim.sweep import shadow_io
from hebrus_flywheel.train.sim.trace import DecodeTrace, PredictionBuilder, PredictionSet


def _committed_rows(rows: CandidateRows) -> np.ndarray:
    """Indices (into the candidate rows, layer 0 of each) of the committed paths' positions,
    proposal by proposal, position order."""
    first = np.flatnonzero(rows.layer_N == 0)
    proposal = np.array([p.rsplit("/", 1)[0] for p in rows.path_N[first]])
    order = np.lexsort((rows.position_N[first], rows.path_N[first].astype(str), proposal))
    chosen: dict[str, str] = {}
    best: dict[str, tuple[int, str]] = {}
    for i in order:
        key = (-int(rows.accepted_length_N[first[i]]), str(rows.path_N[first[i]]))
        if proposal[i] not in best or key < best[proposal[i]]:
            best[proposal[i]] = key
            chosen[proposal[i]] = key[1]
    keep = [i for i in order if str(rows.path_N[first[i]]) == chosen[proposal[i]]]
    return first[np.asarray(keep, np.int64)]


def candidate_block_trace(rows: CandidateRows, *, expert_count: int,
                          skip_expert: int | None = None) -> tuple[DecodeTrace, np.ndarray]:
    """The speculative trace and, per trace row, the index of its layer-0 candidate row
    (its layer-l row is that index + l)."""
    starts = _committed_rows(rows)
    L = int(rows.layer_N.max()) + 1
    routes = np.stack([rows.target_NK[starts + layer] for layer in range(L)], axis=1)
    proposal = np.array([p.rsplit("/", 1)[0] for p in rows.path_N[starts]])
    step = np.unique(proposal, return_inverse=True)[1].reshape(-1)
    order = np.argsort(step, kind="stable")
    trace = DecodeTrace(routes=routes[order], num_experts=expert_count,
                        step=step[order].astype(np.int64),
                        accepted=rows.accepted_N[starts][order].astype(bool),
                        sequence=np.zeros(len(starts), np.int64), skip_expert=skip_expert)
    return trace, starts[order]


def p2_hints(trace: DecodeTrace, ranked_TLC: np.ndarray) -> PredictionSet:
    """Ranked candidates ``(T, L, C)`` as P2 predictions (see the module doc)."""
    first_row = np.flatnonzero(np.diff(trace.step_index, prepend=-1))
    builder = PredictionBuilder()
    for row in range(trace.num_rows):
        step = int(trace.step_index[row])
        ready_row, boundary = ((int(first_row[step - 1]), trace.num_layers) if step > 0
                               else (int(first_row[0]), 0))
        for layer in range(trace.num_layers):
            builder.add(target_row=row, target_layer=layer,
                        experts=ranked_TLC[row, layer].tolist(), priority=2,
                        ready_row=ready_row, ready_boundary=boundary)
    return builder.build()


def model_b_shadow(rows: CandidateRows, ranked_NC: np.ndarray, *, expert_count: int,
                   config: SimConfig) -> Metrics:
    """Shadow I/O of Model B's P2 hints (``ranked_NC``: its ranked candidates for every
    candidate row, aligned with ``rows``) against no prediction, on the committed paths."""
    trace, starts = candidate_block_trace(rows, expert_count=expert_count,
                                          skip_expert=config.geometry.skip_expert)
    ranked = np.stack([ranked_NC[starts + layer] for layer in range(trace.num_layers)], axis=1)
    return shadow_io(trace, p2_hints(trace, ranked), config)
