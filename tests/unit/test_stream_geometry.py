"""The I/O geometry of a teacher, from its identity: streamed routed experts only.

Tiny identities of families with different k, shared experts and dense layers are built
from each family's own transformers config through its route adapter (no weights), as
``build_runtime_identity`` records them; the simulator, the evaluation budgets and the
predictor figures' byte budgets are all sized from that one record.
"""

from __future__ import annotations

from typing import Any

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import StreamGeometry, teacher_budgets, weight_dtype_bytes
from hebrus_flywheel.replay.adapters import adapter_for
from hebrus_flywheel.replay.families import get_family
from hebrus_flywheel.train.figures import literature_budgets
from hebrus_flywheel.train.metrics import MetricsConfig
from hebrus_flywheel.train.sim import SimConfig
from hebrus_flywheel.train.sim.config import DEFAULT_CACHE_FRACTION


def family_identity(name: str, dtype: str = "float32") -> tuple[dict[str, Any], Any]:
    """The identity fields ``build_runtime_identity`` derives from the geometry of the
    tiny ``name`` config, and that config."""
    config = get_family(name).config(vocab_size=64, eos_id=1, pad_id=0)
    g = adapter_for(name).geometry(config)
    return {
        "model_family": g.family, "dtype": dtype, "quantization": "none",
        "routed_layer_count": g.routed_layer_count, "expert_count": g.expert_count,
        "top_k": g.top_k, "tie_break_rule": g.tie_break_rule, "weight_rule": g.weight_rule,
        "hidden_size": g.hidden_size, "routed_intermediate_size": g.routed_intermediate_size,
        "routed_layers": list(g.routed_layers), "layer_count": g.layer_count,
    }, config


def test_qwen2_moe_streams_routed_experts_not_the_shared_expert_or_dense_layers() -> None:
    identity, config = family_identity("qwen2_moe")
    stream = StreamGeometry.from_identity(identity)
    # every second layer sparse (decoder_sparse_step=2): 2 routed of 4, top-4 of 32
    assert (stream.route.routed_layers, stream.route.top_k) == ((1, 3), 4)
    assert stream.expert_bytes == 3 * 64 * config.moe_intermediate_size * 4 == 12288
    assert config.shared_expert_intermediate_size != config.moe_intermediate_size
    assert config.intermediate_size != config.moe_intermediate_size  # dense MLP width
    record = stream.to_dict()
    assert record["dense_layer_count"] == 2
    assert record["streamed_bytes_per_token"] == 2 * 4 * 12288
    assert record["routed_expert_bytes_total"] == 2 * 32 * 12288
    assert record["budgets"] == [4, 8, 12, 16]


def test_deepseek_v3_and_qwen3_moe_differ_in_k_and_budgets() -> None:
    ds, _ = family_identity("deepseek_v3", dtype="bfloat16")
    qw, _ = family_identity("qwen3_moe")
    ds_stream, qw_stream = StreamGeometry.from_identity(ds), StreamGeometry.from_identity(qw)
    # deepseek_v3: first_k_dense_replace=1 and a shared expert; bf16 weights
    assert ds_stream.route.routed_layers == (1, 2, 3)
    assert ds_stream.expert_bytes == 3 * 64 * 16 * 2
    assert ds_stream.budgets == (4, 8, 12, 16)
    # qwen3_moe: mlp_only_layers=[0], top-8 of 64, float32
    assert qw_stream.route.routed_layers == (1, 2, 3)
    assert qw_stream.expert_bytes == 3 * 64 * 16 * 4
    assert qw_stream.budgets == (8, 16, 24, 32)
    for stream in (ds_stream, qw_stream):
        k, e = stream.route.top_k, stream.route.expert_count
        assert MetricsConfig(expert_count=e, top_k=k).effective_budgets == stream.budgets
        assert literature_budgets(k) == stream.budgets


def test_the_simulator_takes_the_identity_geometry_and_a_cache_share() -> None:
    identity, _ = family_identity("qwen3_moe")
    stream = StreamGeometry.from_identity(identity)
    sim = SimConfig.for_teacher(stream, ssd_bandwidth_bytes_per_s=1e9)
    assert sim.expert_bytes == stream.expert_bytes and sim.geometry == stream.route
    assert sim.capacity_experts == round(0.125 * 3 * 64)
    assert SimConfig.for_teacher(stream, cache_capacity_bytes=10 * stream.expert_bytes
                                 ).capacity_experts == 10
    assert SimConfig.for_teacher(stream, cache_capacity_experts=7).capacity_experts == 7
    with pytest.raises(ConfigError, match="identity"):
        SimConfig.for_teacher(stream, dtype_bytes=0.5)


def test_unknown_dtypes_and_quantized_teachers_are_refused() -> None:
    assert weight_dtype_bytes("bfloat16") == 2.0
    with pytest.raises(ConfigError, match="dtype"):
        weight_dtype_bytes("int3")
    identity, _ = family_identity("mixtral")
    with pytest.raises(ConfigError, match="quantization"):
        StreamGeometry.from_identity({**identity, "quantization": "gptq-4bit"})
    with pytest.raises(ConfigError, match="top_k"):
        teacher_budgets(0)


def test_zaya_skip_class_is_a_label_but_never_streamed() -> None:
    """ZAYA's router has 16 experts and a skip class: the route's E is 17 router classes,
    of which 16 have weights to stream; the simulator's default cache is sized on those."""
    identity, config = family_identity("zaya")
    stream = StreamGeometry.from_identity(identity)
    route = stream.route
    assert (route.expert_count, route.top_k, route.skip_expert) == (17, 1, 16)
    assert route.streamed_expert_count == config.num_experts == 16
    record = stream.to_dict()
    assert record["skip_class"] and record["streamed_expert_count"] == 16
    assert record["routed_expert_bytes_total"] == 4 * 16 * stream.expert_bytes
    assert record["budgets"] == [1, 2, 3, 4]
    sim = SimConfig.for_teacher(stream)
    assert sim.geometry.skip_expert == 16
    assert sim.capacity_experts == round(DEFAULT_CACHE_FRACTION * 4 * 16)  # not 4 x 17
    plain, _ = family_identity("qwen2_moe")
    assert StreamGeometry.from_identity(plain).route.skip_expert is None
