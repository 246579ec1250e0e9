"""Tiny-checkpoint rows of the MoE families added by :mod:`replay.adapters_more` (issue 16).

Each row holds the keyword arguments of one :class:`replay.families.FamilySpec`; plain
dicts, so that :mod:`replay.families` (which builds and registers them in ``FAMILIES``)
and this module import each other in one direction only.
"""

from __future__ import annotations

from typing import Any

MORE_FAMILIES: tuple[dict[str, Any], ...] = (
    {"name": "cohere2_moe", "config_class": "Cohere2MoeConfig", "fields": {
        "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 16,
        "num_shared_experts": 1, "shared_expert_combination_strategy": "average",
        "expert_selection_fn": "softmax", "prefix_dense_intermediate_size": 32,
        "sliding_window": 16, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
     "summary": "softmax over the top-4 of 16 logits, weights in the hidden dtype, shared "
                "expert averaged in; parallel attention + MoE block; layer 0 dense"},
    {"name": "afmoe", "config_class": "AfmoeConfig", "fields": {
        "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "num_shared_experts": 1,
        "moe_intermediate_size": 16, "intermediate_size": 32, "num_dense_layers": 1,
        "route_scale": 2.5, "sliding_window": 16, "global_attn_every_n_layers": 2},
     "summary": "float32 sigmoid + expert bias, top-4 of 16, renormalised x2.5, shared "
                "expert; layer 0 dense (num_dense_layers); sliding/full attention"},
    {"name": "aria_text", "config_class": "AriaTextConfig", "fields": {
        "head_dim": 32, "moe_num_experts": 16, "moe_topk": 4, "moe_num_shared_experts": 1,
        "intermediate_size": 16},
     "summary": "softmax over the top-4 of 16 logits, router a bare Linear (the experts "
                "select), shared experts, every layer sparse"},
    {"name": "minimax_m2", "config_class": "MiniMaxM2Config", "fields": {
        "head_dim": 32, "num_local_experts": 16, "num_experts_per_tok": 4,
        "intermediate_size": 16},
     "summary": "float32 sigmoid + correction bias, top-4 of 16, renormalised (no "
                "epsilon), every layer sparse, q/k-normed attention"},
    {"name": "mimo_v2_flash", "config_class": "MiMoV2FlashConfig", "fields": {
        "head_dim": 48, "v_head_dim": 32, "n_routed_experts": 32, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "moe_intermediate_size": 16, "intermediate_size": 32,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "sliding_window": 16,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                        "full_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}, "attention": "eager",
     "summary": "sigmoid + correction bias, top-4 of 32 in the best 2 of 4 groups, "
                "renormalised x2.5, no shared expert; layer 0 dense; sliding/full "
                "attention with partial rotary and attention sinks; eager attention"},
    {"name": "solar_open", "config_class": "SolarOpenConfig", "fields": {
        "head_dim": 32, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4,
        "topk_group": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5},
     "summary": "sigmoid + correction bias, top-4 of 32 in the best 2 of 4 groups, "
                "renormalised x2.5, shared expert; every layer sparse"},
    {"name": "laguna", "config_class": "LagunaConfig", "fields": {
        "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16, "intermediate_size": 32,
        "moe_router_logit_softcapping": 5.0, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
     "summary": "soft-capped float32 logits, sigmoid + correction bias, top-4 of 16, "
                "renormalised (no epsilon), shared expert; layer 0 dense; gated "
                "sliding/full attention"},
    {"name": "mellum", "config_class": "MellumConfig", "fields": {
        "head_dim": 32, "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
        "intermediate_size": 32, "norm_topk_prob": True, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
     "summary": "softmax top-4 of 32, renormalised; layer 0 dense (mlp_layer_types); "
                "sliding/full attention"},
    {"name": "qwen4_exp_text", "config_class": "Qwen4ExpTextConfig", "fields": {
        "head_dim": 32, "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "hc_count": 2, "hc_lowrank": 16, "indexer_n_heads": 2,
        "indexer_kv_heads": 1, "indexer_head_dim": 32, "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
        "layer_types": ["linear_attention", "qwen_sparse_attention"] * 2},
     "summary": "softmax top-4 of 32, renormalised, sigmoid-gated shared expert, every "
                "layer sparse; 2 hyper-connection streams; gated delta-net and full "
                "attention layers alternate"},
    {"name": "jetmoe", "config_class": "JetMoeConfig", "fields": {
        "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 16},
     "summary": "softmax over the top-2 of 8 float32 logits, router returns its choice "
                "grouped by expert, every layer sparse; mixture-of-heads attention (its "
                "own top-2 routing is not labelled)"},
)

REFUSED_FAMILIES: dict[str, str] = {
    "doge": "in the installed transformers (5.17) DogeCDMoE returns (hidden_states, "
            "router_logits) and DogeDecoderLayer hands that tuple to dropout, so a MoE Doge "
            "(is_moe=True) cannot run a forward; and its product-key router views the "
            "[tokens, 2 x keys] logits as [2, tokens, keys], so a token's experts depend on "
            "its neighbours in the pass and one-token decode routes differently from "
            "prefill (12 of 12 tokens measured), which no route label can make exact",
}
"""Transformers MoE families that cannot be teachers, with the reason ``teacher init``
and :func:`replay.adapters.adapter_for` give."""
