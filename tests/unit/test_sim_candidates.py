"""Model B's predictions as P2 hints in the shadow I/O simulator."""

from __future__ import annotations

import numpy as np
import pytest

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.train.candidates.rows import load_candidate_rows
from hebrus_flywheel.train.sim import SimConfig
from hebrus_flywheel.train.sim.candidates import candidate_block_trace, model_b_shadow, p2_hints
from tests.support.candidates import candidate_table

SHAPE = RouteGeometry(family="t", routed_layers=(0, 1), layer_count=2, expert_count=16,
                      top_k=2, hidden_size=10, routed_intermediate_size=10)
MS = 1e-3


def _config() -> SimConfig:
    return SimConfig(geometry=SHAPE, dtype_bytes=1.0, attention_time_s=MS, moe_time_s=MS,
                     step_overhead_s=0.0, ssd_bandwidth_bytes_per_s=300 / MS,
                     ssd_latency_s=0.0, ssd_queue_depth=4, cache_capacity_experts=64,
                     eviction="priority")


@pytest.fixture(scope="module")
def rows():
    return load_candidate_rows(candidate_table(proposals=12, experts=16, top_k=2, layers=2,
                                               block=4, validation_share=0.0), "train")


def test_the_trace_holds_one_block_per_proposal_on_its_committed_path(rows):
    trace, starts = candidate_block_trace(rows, expert_count=16)
    assert trace.num_steps == 12 and trace.num_rows == 12 * 4
    assert (trace.accepted == (rows.position_N[starts] <= rows.accepted_length_N[starts])).all()
    for step in range(12):
        at = starts[trace.step_index == step]
        lengths = rows.accepted_length_N[at]
        proposal = rows.path_N[at[0]].rsplit("/", 1)[0]
        siblings = [i for i in np.flatnonzero(rows.layer_N == 0)
                    if rows.path_N[i].startswith(proposal + "/")]
        assert lengths[0] == max(rows.accepted_length_N[siblings])
    assert (trace.routes[:, 1] == rows.target_NK[starts + 1]).all()


def test_hints_are_p2_and_issued_a_step_ahead(rows):
    trace, starts = candidate_block_trace(rows, expert_count=16)
    ranked = np.stack([rows.target_NK[starts + layer] for layer in (0, 1)], axis=1)
    hints = p2_hints(trace, ranked)
    assert set(hints.priority.tolist()) == {2}
    later = trace.step_index[hints.target_row] > 0
    assert (hints.ready_boundary[later] == trace.num_layers).all()
    assert (trace.step_index[hints.ready_row[later]]
            == trace.step_index[hints.target_row[later]] - 1).all()


def test_exact_hints_hide_wait_and_useless_ones_do_not(rows):
    exact = model_b_shadow(rows, rows.target_NK, expert_count=16, config=_config())
    wrong = (rows.target_NK + 5) % 16  # other experts (they may serve later rows)
    useless = model_b_shadow(rows, wrong, expert_count=16, config=_config())
    assert exact["timely_recall"] > 0.5 > useless["timely_recall"]
    assert exact["exposed_wait_reduction"] > useless["exposed_wait_reduction"]
    assert exact["exposed_wait_reduction"] > 0
