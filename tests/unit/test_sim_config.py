"""SimConfig: geometry arithmetic and field validation."""

from __future__ import annotations

import dataclasses

import pytest

from hebrus_flywheel.core.errors import ConfigError, FlywheelError
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.train.exceptions import TrainError
from hebrus_flywheel.train.sim import SimConfig, SimulationError, TraceError


def test_default_expert_bytes_follow_the_geometry() -> None:
    config = SimConfig()
    assert config.expert_bytes == 640 * 2048 * 3 * 2
    assert config.capacity_experts == 3072


def shape(hidden: int, intermediate: int) -> RouteGeometry:
    return RouteGeometry(family="t", routed_layers=(0,), layer_count=1, expert_count=4,
                         top_k=2, hidden_size=hidden, routed_intermediate_size=intermediate)


def test_the_model_shape_is_the_base_geometry() -> None:
    config = SimConfig(geometry=shape(8, 4), dtype_bytes=0.5)
    assert config.expert_bytes == round(shape(8, 4).expert_bytes(0.5)) == 48
    record = config.to_dict()
    assert record["geometry"] == shape(8, 4).to_dict() and "hidden_size" not in record
    with pytest.raises(TypeError):
        SimConfig(hidden_size=64)  # type: ignore[call-arg]


def test_capacity_in_bytes_is_floored_to_whole_experts() -> None:
    config = SimConfig(geometry=shape(10, 10), dtype_bytes=1.0,
                       cache_capacity_experts=None, cache_capacity_bytes=1000)
    assert config.expert_bytes == 300
    assert config.capacity_experts == 3


def test_fractional_dtype_bytes_round_the_expert_size() -> None:
    config = SimConfig(geometry=shape(3, 3), dtype_bytes=0.5)
    assert config.expert_bytes == round(3 * 3 * 3 * 0.5)


def test_per_layer_times_expand_and_check_length() -> None:
    config = SimConfig(attention_time_s=(1.0, 2.0), moe_time_s=0.5)
    assert config.attention_times(2) == (1.0, 2.0)
    assert config.moe_times(3) == (0.5, 0.5, 0.5)
    with pytest.raises(ConfigError, match="attention_time_s"):
        config.attention_times(3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("geometry", {"hidden_size": 64}),
        ("dtype_bytes", 0.0),
        ("ssd_bandwidth_bytes_per_s", 0.0),
        ("ssd_bandwidth_bytes_per_s", float("inf")),
        ("ssd_latency_s", -1e-3),
        ("ssd_latency_s", float("nan")),
        ("ssd_queue_depth", 0),
        ("ssd_queue_depth", True),
        ("attention_time_s", -1.0),
        ("moe_time_s", (0.1, float("inf"))),
        ("step_overhead_s", -1.0),
        ("predictor_latency_s", -1.0),
        ("cache_capacity_experts", 0),
        ("eviction", "fifo"),
    ],
)
def test_invalid_fields_raise_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        SimConfig(**{field: value})  # type: ignore[arg-type]


def test_exactly_one_capacity_must_be_set() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        SimConfig(cache_capacity_experts=10, cache_capacity_bytes=10**9)
    with pytest.raises(ConfigError, match="exactly one"):
        SimConfig(cache_capacity_experts=None)


def test_config_is_frozen_and_keyword_only() -> None:
    config = SimConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        SimConfig(2048)  # type: ignore[call-arg]


def test_error_hierarchy() -> None:
    assert issubclass(SimulationError, TrainError)
    assert issubclass(SimulationError, FlywheelError)
    assert issubclass(TraceError, SimulationError)
    assert issubclass(TraceError, ValueError)
