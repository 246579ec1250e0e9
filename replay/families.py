"""Tiny random checkpoints of every MoE family with a route adapter (``teacher init --family``).

Each :class:`FamilySpec` builds a transformers config of one family at toy widths
(hidden 64, 4 layers, a few dozen experts) that keeps the family's routing features: the
dense layers (``mlp_only_layers`` / ``decoder_sparse_step`` / ``first_k_dense_replace``),
softmax or sigmoid routers, expert groups, the selection-correction bias, raw or
renormalised weights, shared experts. Weights are drawn under a fixed seed (no download),
routers are redrawn so their logits have ``router_logit_std`` (see :mod:`replay.teacher`)
and bias-corrected routers get a random ``e_score_correction_bias`` (std
:data:`SCORE_BIAS_STD`), so the bias visibly changes the selection.

Qwen3-Next keeps its presets in :mod:`replay.teacher` (``--preset``); its entry here
uses the default preset.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.families_c import C_FAMILIES
from hebrus_flywheel.replay.families_hybrid import HYBRID_FAMILIES
from hebrus_flywheel.replay.families_more import MORE_FAMILIES
from hebrus_flywheel.replay.families_vl import VL_FAMILIES
from hebrus_flywheel.replay.refused import REFUSED_FAMILIES

SCORE_BIAS_STD = 0.1
HIDDEN = 64
_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "max_position_embeddings": 32768, "initializer_range": 0.02,
    "tie_word_embeddings": False, "bos_token_id": None, "dtype": "float32",
}


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """A family ``teacher init --family NAME`` can generate.

    Fields:
        name: the transformers ``model_type`` (also the ``--family`` name).
        config_class: name of the transformers config class.
        fields: config fields beyond :data:`_COMMON` (the family's tiny geometry).
        summary: one line on what the family's routing exercises.
        router_logit_std: std of router logits at init.
        attention: the attention kernel the family runs with (``eager`` where its
            transformers model has no sdpa path, e.g. GPT-OSS's attention sinks); its
            selftest and tests pass it as ``--attention``.
        score_bias_std: std of a correction bias at init (smaller where it is added to
            softmax probabilities, which are ~1/E, lest it decide every route alone).
        score_bias_mean: mean of a correction bias at init (ZAYA: below 0, so that a
            confident skip class, whose bias is -1, can win).
        sub_configs: for a vision-language composite (:mod:`replay.composites`), its
            config's other parts (a tiny ``vision_config``); ``fields`` then make its
            ``text_config``.
    """

    name: str
    config_class: str
    fields: dict[str, Any] = field(default_factory=dict)
    summary: str = ""
    router_logit_std: float = 2.0
    attention: str = "sdpa"
    score_bias_std: float = SCORE_BIAS_STD
    score_bias_mean: float = 0.0
    sub_configs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or not self.config_class:
            raise ConfigError("name and config_class must be non-empty")
        if not (self.router_logit_std > 0 and math.isfinite(self.router_logit_std)):
            raise ConfigError(
                f"router_logit_std must be positive, got {self.router_logit_std!r}")

    def config(self, *, vocab_size: int, eos_id: int, pad_id: int) -> Any:
        import transformers

        config_class: Callable[..., Any] = getattr(transformers, self.config_class)
        text = {**_COMMON, **self.fields, "vocab_size": vocab_size, "eos_token_id": eos_id,
                "pad_token_id": pad_id}
        if self.sub_configs:
            from hebrus_flywheel.replay.composites import composite_config_fields

            return config_class(**composite_config_fields(self.name, text, self.sub_configs),
                                eos_token_id=eos_id, pad_token_id=pad_id,
                                tie_word_embeddings=False)
        return config_class(**text)


_MLA = {"num_key_value_heads": 2, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16, "head_dim": 8}
FAMILIES: dict[str, FamilySpec] = {
    s.name: s
    for s in (
        FamilySpec(name="qwen3_next", config_class="Qwen3NextConfig",
                   summary="softmax top-10 of 512, renormalised, shared expert, hybrid "
                           "linear/full attention (the default teacher)"),
        FamilySpec(name="qwen3_moe", config_class="Qwen3MoeConfig", fields={
            "head_dim": 32, "num_experts": 64, "num_experts_per_tok": 8,
            "moe_intermediate_size": 16, "intermediate_size": 32, "decoder_sparse_step": 1,
            "mlp_only_layers": [0], "norm_topk_prob": True},
            summary="softmax top-8 of 64, renormalised; layer 0 dense (mlp_only_layers)"),
        FamilySpec(name="qwen2_moe", config_class="Qwen2MoeConfig", fields={
            "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
            "intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False},
            summary="softmax top-4 of 32, raw weights, sigmoid-gated shared expert; every "
                    "second layer sparse (decoder_sparse_step=2)"),
        FamilySpec(name="mixtral", config_class="MixtralConfig", fields={
            "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
            "intermediate_size": 16},
            summary="softmax top-2 of 8, renormalised, every layer sparse"),
        FamilySpec(name="olmoe", config_class="OlmoeConfig", fields={
            "num_experts": 64, "num_experts_per_tok": 8, "intermediate_size": 16,
            "norm_topk_prob": False},
            summary="softmax top-8 of 64, raw weights, every layer sparse"),
        FamilySpec(name="deepseek_v3", config_class="DeepseekV3Config", fields={
            **_MLA, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4,
            "topk_group": 2, "first_k_dense_replace": 1, "n_shared_experts": 1,
            "moe_intermediate_size": 16, "intermediate_size": 32, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5},
            summary="sigmoid + correction bias, top-4 of 32 inside the best 2 of 4 groups, "
                    "renormalised x2.5, shared expert; layer 0 dense (first_k_dense_replace)"),
        FamilySpec(name="deepseek_v2", config_class="DeepseekV2Config", fields={
            **_MLA, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4,
            "topk_group": 2, "topk_method": "group_limited_greedy",
            "first_k_dense_replace": 1, "n_shared_experts": 1, "moe_intermediate_size": 16,
            "intermediate_size": 32, "routed_scaling_factor": 1.5},
            summary="softmax top-4 of 32 inside the best 2 of 4 groups (group max), raw "
                    "weights x1.5, shared experts; layer 0 dense"),
        FamilySpec(name="glm4_moe", config_class="Glm4MoeConfig", fields={
            "head_dim": 32, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 1,
            "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
            "moe_intermediate_size": 16, "intermediate_size": 32, "norm_topk_prob": True,
            "routed_scaling_factor": 1.0},
            summary="sigmoid + correction bias, top-4 of 16, renormalised, shared expert; "
                    "layer 0 dense"),
        FamilySpec(name="gpt_oss", config_class="GptOssConfig", fields={
            "head_dim": 32, "num_local_experts": 16, "num_experts_per_tok": 4,
            "intermediate_size": 16, "sliding_window": 8, "max_position_embeddings": 131072,
            "layer_types": ["sliding_attention", "full_attention"] * 2}, attention="eager",
            summary="softmax over the top-4 of 16 logits (router linear has a bias), "
                    "every layer sparse, sliding/full attention with sinks; eager attention"),
        FamilySpec(name="granitemoe", config_class="GraniteMoeConfig", fields={
            "num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 16},
            summary="softmax over the top-4 of 16 float32 logits, router returns (ids, "
                    "weights, logits), every layer sparse"),
        FamilySpec(name="granitemoeshared", config_class="GraniteMoeSharedConfig", fields={
            "num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 16,
            "shared_intermediate_size": 32},
            summary="Granite-MoE's router (top-4 of 16) plus a dense shared MLP, every "
                    "layer sparse"),
        FamilySpec(name="minimax", config_class="MiniMaxConfig", fields={
            "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
            "intermediate_size": 16, "block_size": 16,
            "layer_types": ["linear_attention", "full_attention"] * 2},
            summary="softmax top-2 of 8, renormalised, every layer sparse; lightning "
                    "(linear) and full attention layers alternate"),
        FamilySpec(name="phimoe", config_class="PhimoeConfig", fields={
            "head_dim": 32, "num_local_experts": 16, "num_experts_per_tok": 2,
            "intermediate_size": 16, "router_jitter_noise": 0.01},
            summary="sparsemixer top-2 of 16 (each weight a softmax over the experts "
                    "within a relative gap of 0.02), every layer sparse, LayerNorm"),
        FamilySpec(name="llama4_text", config_class="Llama4TextConfig", fields={
            "head_dim": 32, "num_local_experts": 16, "num_experts_per_tok": 2,
            "intermediate_size": 16, "intermediate_size_mlp": 32,
            "interleave_moe_layer_step": 2, "attention_chunk_size": 16},
            summary="sigmoid top-2 of 16 by raw logit, unnormalised weights scaling the "
                    "expert input, shared expert; layers 1 and 3 sparse (moe_layers), "
                    "chunked attention"),
        FamilySpec(name="dots1", config_class="Dots1Config", fields={
            "head_dim": 32, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4,
            "topk_group": 2, "first_k_dense_replace": 1, "n_shared_experts": 1,
            "moe_intermediate_size": 16, "intermediate_size": 32, "norm_topk_prob": True,
            "routed_scaling_factor": 2.0},
            summary="sigmoid + correction bias, top-4 of 32 inside the best 2 of 4 groups, "
                    "renormalised x2.0, shared expert; layer 0 dense"),
        FamilySpec(name="ernie4_5_moe", config_class="Ernie4_5_MoeConfig", fields={
            "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 16, "intermediate_size": 32, "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1, "moe_layer_interval": 1}, score_bias_std=0.02,
            summary="float32 softmax + correction bias selects top-4 of 16, softmax "
                    "renormalised weights, shared expert; layer 0 dense"),
        FamilySpec(name="qwen3_5_moe_text", config_class="Qwen3_5MoeTextConfig", fields={
            "head_dim": 32, "num_experts": 32, "num_experts_per_tok": 4,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "layer_types": ["linear_attention", "full_attention"] * 2},
            summary="softmax top-4 of 32, renormalised, sigmoid-gated shared expert, every "
                    "layer sparse; gated delta-net and full attention layers alternate"),
        FamilySpec(name="flex_olmo", config_class="FlexOlmoConfig", fields={
            "num_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 16,
            "norm_topk_prob": False},
            summary="softmax top-4 of 16, raw weights, every layer sparse; post-norm "
                    "layers (no input_layernorm)"),
        FamilySpec(name="deepseek_v32", config_class="DeepseekV32Config", fields={
            **_MLA, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4,
            "topk_group": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
            "intermediate_size": 32, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "index_topk": 2048,
            "index_n_heads": 2, "index_head_dim": 16},
            summary="DeepSeek-V3's router (sigmoid + bias, top-4 of 32 in the best 2 of 4 "
                    "groups, renormalised x2.5); layers 1 and 3 sparse (mlp_layer_types); "
                    "sparse attention indexer"),
        FamilySpec(name="glm4_moe_lite", config_class="Glm4MoeLiteConfig", fields={
            **_MLA, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 1,
            "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 16,
            "intermediate_size": 32, "norm_topk_prob": True, "routed_scaling_factor": 1.8,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
            summary="sigmoid + correction bias, top-4 of 16, renormalised x1.8, shared "
                    "expert, MLA; layer 0 dense (mlp_layer_types)"),
        FamilySpec(name="lfm2_moe", config_class="Lfm2MoeConfig", fields={
            "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
            "intermediate_size": 32, "num_dense_layers": 1, "use_expert_bias": True,
            "norm_topk_prob": True, "routed_scaling_factor": 1.0,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
            summary="sigmoid + expert bias, top-4 of 16, renormalised (+1e-6); layer 0 "
                    "dense (num_dense_layers); short-conv and attention layers"),
        FamilySpec(name="hy_v3", config_class="HYV3Config", fields={
            "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4,
            "num_shared_experts": 1, "moe_intermediate_size": 16, "intermediate_size": 32,
            "router_scaling_factor": 2.5, "mlp_layer_types": ["dense", "sparse", "sparse",
                                                              "sparse"]},
            summary="float32 sigmoid + correction bias, top-4 of 16, renormalised x2.5, "
                    "shared expert; layer 0 dense (mlp_layer_types)"),
        FamilySpec(name="exaone_moe", config_class="ExaoneMoeConfig", fields={
            "num_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
            "num_shared_experts": 1, "moe_intermediate_size": 16, "intermediate_size": 32,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "sliding_window": 16,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
            summary="sigmoid + correction bias, top-4 of 32 in the best 2 of 4 groups, "
                    "renormalised x2.5, shared expert; layer 0 dense; sliding attention"),
        FamilySpec(name="jamba", config_class="JambaConfig", fields={
            "num_experts": 16, "num_experts_per_tok": 2, "intermediate_size": 16,
            "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 2,
            "attn_layer_offset": 1, "use_mamba_kernels": False, "mamba_d_state": 8,
            "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8},
            summary="softmax top-2 of 16, raw weights, router a bare Linear (the block "
                    "selects); layers 1 and 3 sparse; mamba and attention layers"),
        *(FamilySpec(**spec) for spec in HYBRID_FAMILIES),
        *(FamilySpec(**row) for row in MORE_FAMILIES),
        *(FamilySpec(**spec) for spec in C_FAMILIES),
        *(FamilySpec(**row) for row in VL_FAMILIES),
    )
}
DEFAULT_FAMILY = "qwen3_next"


def get_family(name: str) -> FamilySpec:
    """The spec of ``name``; ConfigError naming the choices if there is none."""
    if name in REFUSED_FAMILIES:
        raise ConfigError(f"family {name!r} cannot be a teacher: {REFUSED_FAMILIES[name]}")
    if name not in FAMILIES:
        raise ConfigError(
            f"family: no generator for {name!r}; choose one of {sorted(FAMILIES)} "
            "(`flywheel teacher families` lists them)"
        )
    return FAMILIES[name]


def build_family_model(spec: FamilySpec, config: Any, seed: int) -> Any:
    """Deterministic init of ``spec`` under ``seed`` (caller's RNG untouched), eval mode."""
    from hebrus_flywheel.replay.adapters import adapter_for
    from hebrus_flywheel.replay.adapters_c import text_config
    from hebrus_flywheel.replay.composites import (
        causal_lm_class,
        composite_from_config,
        text_model,
    )

    adapter = adapter_for(spec.name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = composite_from_config(config) if spec.sub_configs else \
            causal_lm_class(config)._from_config(config)
        lm = text_model(model)
        layers = adapter.decoder_layers(lm)
        text = text_config(config)
        router_std = spec.router_logit_std / math.sqrt(text.hidden_size)
        with torch.no_grad():
            for index in adapter.geometry(text).routed_layers:
                gate = adapter.router(layers[index])
                adapter.redraw_router(gate, router_std)
                bias = adapter.layer_bias(layers[index])
                if bias is not None:
                    adapter.draw_score_bias(bias, spec.score_bias_mean, spec.score_bias_std)
            adapter.shape_tiny_model(lm)
    return model.eval()
