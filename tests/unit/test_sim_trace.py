"""DecodeTrace and PredictionSet: the simulator's documented input format."""

from __future__ import annotations

import numpy as np
import pytest

from hebrus_flywheel.train.sim import (
    DecodeTrace,
    PredictionBuilder,
    PredictionSet,
    TraceError,
    boundary_key,
    moe_key,
    oracle_predictions,
    previous_token_predictions,
)


def _trace(**kwargs: object) -> DecodeTrace:
    routes = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 4]], [[0, 4], [1, 2]]])
    return DecodeTrace(routes=routes, num_experts=8, **kwargs)  # type: ignore[arg-type]


def test_trace_defaults_one_row_per_step_all_accepted() -> None:
    trace = _trace()
    assert (trace.num_rows, trace.num_layers, trace.top_k, trace.num_steps) == (3, 2, 2, 3)
    assert trace.accepted_tokens == 3
    assert trace.step_index.tolist() == [0, 1, 2]
    assert not trace.routes.flags.writeable


def test_trace_steps_are_densified() -> None:
    trace = _trace(step=np.array([4, 4, 9]), accepted=np.array([True, False, True]))
    assert trace.step_index.tolist() == [0, 0, 1]
    assert trace.num_steps == 2
    assert trace.accepted_tokens == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"routes": np.zeros((2, 2)), "num_experts": 4}, "routes"),
        ({"routes": np.array([[[0, 5]]]), "num_experts": 4}, "routes"),
        ({"routes": np.array([[[1, 1]]]), "num_experts": 4}, "repeats"),
        ({"routes": np.array([[[0.0, 1.0]]]), "num_experts": 4}, "integers"),
        ({"routes": np.array([[[0, 1]]]), "num_experts": 0}, "num_experts"),
        ({"routes": np.array([[[0]], [[1]]]), "num_experts": 2,
          "step": np.array([1, 0])}, "non-decreasing"),
        ({"routes": np.array([[[0]], [[1]]]), "num_experts": 2,
          "accepted": np.array([1, 0])}, "accepted"),
        ({"routes": np.array([[[0]], [[1]]]), "num_experts": 2,
          "sequence": np.array([0])}, "sequence"),
    ],
)
def test_malformed_traces_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(TraceError, match=match):
        DecodeTrace(**kwargs)  # type: ignore[arg-type]


def test_event_keys_order_boundaries_and_moes() -> None:
    layers = 2
    keys = [boundary_key(0, 0, layers), moe_key(0, 0, layers), boundary_key(0, 1, layers),
            moe_key(0, 1, layers), boundary_key(0, 2, layers), boundary_key(1, 0, layers)]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)


def test_builder_ranks_candidates_in_list_order() -> None:
    builder = PredictionBuilder()
    builder.add(target_row=1, target_layer=0, experts=[5, 3, 7], priority=1,
                ready_row=1, ready_boundary=0)
    builder.add(target_row=2, target_layer=1, experts=[2], priority=2, ready_row=0,
                ready_boundary=2, rejected_suffix=True)
    predictions = builder.build()
    assert len(predictions) == 4
    assert predictions.rank.tolist() == [0, 1, 2, 0]
    assert predictions.rejected_suffix.tolist() == [False, False, False, True]
    assert len(predictions.within_budget(1)) == 2
    assert predictions.within_budget(None) is predictions
    predictions.validate_for(_trace())


def test_prediction_ready_after_its_deadline_is_refused() -> None:
    builder = PredictionBuilder()
    builder.add(target_row=0, target_layer=0, experts=[1], priority=1, ready_row=0,
                ready_boundary=1)
    with pytest.raises(TraceError, match="before its deadline"):
        builder.build().validate_for(_trace())


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("priority", 0, "priority"), ("expert", 8, "expert"), ("target_row", 3, "target_row"),
     ("ready_boundary", 3, "ready_boundary"), ("rank", -1, "rank")],
)
def test_prediction_values_are_checked(field: str, value: int, match: str) -> None:
    columns = {"target_row": 1, "target_layer": 0, "expert": 1, "rank": 0, "priority": 1,
               "ready_row": 0, "ready_boundary": 0}
    columns[field] = value
    with pytest.raises(TraceError, match=match):
        PredictionSet(**{k: np.array([v]) for k, v in columns.items()}).validate_for(_trace())


def test_prediction_fields_must_share_one_length() -> None:
    with pytest.raises(TraceError, match="shape"):
        PredictionSet(target_row=np.array([0, 1]), target_layer=np.array([0]),
                      expert=np.array([0]), rank=np.array([0]), priority=np.array([1]),
                      ready_row=np.array([0]), ready_boundary=np.array([0]))


def test_oracle_lead_counts_back_across_steps() -> None:
    trace = _trace()
    predictions = oracle_predictions(trace, lead_boundaries=4)
    predictions.validate_for(trace)
    row2_layer0 = (predictions.target_row == 2) & (predictions.target_layer == 0)
    # step 2 layer 0 is boundary 2*3+0 = 6; 4 back is boundary 2 = step 0, boundary 2.
    assert set(predictions.ready_row[row2_layer0].tolist()) == {0}
    assert set(predictions.ready_boundary[row2_layer0].tolist()) == {2}
    assert sorted(predictions.expert[row2_layer0].tolist()) == [0, 4]


def test_previous_token_uses_the_same_sequence() -> None:
    trace = _trace(sequence=np.array([0, 1, 0]))
    predictions = previous_token_predictions(trace)
    assert set(predictions.target_row.tolist()) == {2}
    layer1 = predictions.target_layer == 1
    assert predictions.expert[layer1].tolist() == [2, 3]
