"""Tiny presets of the families of :mod:`replay.adapters_hybrid` (``teacher init --family``).

Plain keyword sets of :class:`replay.families.FamilySpec` (which builds them; no import of
it here, so either module imports first), merged into ``FAMILIES`` by
:mod:`replay.families`. Widths follow its ``_COMMON`` toy geometry (hidden 64, 4 layers).
"""

from __future__ import annotations

from typing import Any

_MLA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16}
HYBRID_FAMILIES: tuple[dict[str, Any], ...] = (
    {"name": "granitemoe_swa", "config_class": "GraniteMoeSWAConfig", "fields": {
        "num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 16,
        "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"] * 2},
     "attention": "eager",
     "summary": "Granite-MoE's router (softmax over the top-4 of 16 float32 logits) "
                "returning (logits, weights, ids); sliding/full attention with sinks; eager"},
    {"name": "hy_v4", "config_class": "HYV4Config", "fields": {
        **_MLA, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1,
        "moe_intermediate_size": 16, "intermediate_size": 32, "routed_scaling_factor": 2.5,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "index_topk": 2048,
        "index_n_heads": 2, "index_head_dim": 16, "hc_mult": 2},
     "attention": "eager",
     "summary": "sigmoid + correction bias, top-4 of 16, renormalised x2.5, shared expert; "
                "layer 0 dense; DSA attention with sinks, hyper-connections; eager"},
    {"name": "axk1", "config_class": "AXK1Config", "fields": {
        **_MLA, "num_key_value_heads": 2, "n_routed_experts": 32, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "moe_intermediate_size": 16, "intermediate_size": 32, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5},
     "summary": "DeepSeek-V3's router (sigmoid + bias, top-4 of 32 in the best 2 of 4 "
                "groups, renormalised x2.5), shared expert, MoE output RMSNorm; layer 0 dense"},
    {"name": "axk2", "config_class": "AXK2Config", "fields": {
        **_MLA, "num_key_value_heads": 2, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
        "intermediate_size": 32, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "gated_norm_rank": 8,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "index_topk": 2048,
        "index_n_heads": 2, "index_head_dim": 16},
     "summary": "sigmoid + correction bias, top-4 of 16 in the best 2 of 4 groups (dropped "
                "groups score 0.0), renormalised x2.5, shared expert, gated RMSNorms, DSA "
                "attention; layer 0 dense"},
    {"name": "glm_moe_dsa", "config_class": "GlmMoeDsaConfig", "fields": {
        **_MLA, "num_key_value_heads": 2, "n_routed_experts": 32, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
        "intermediate_size": 32, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "index_topk": 2048,
        "index_n_heads": 2, "index_head_dim": 16,
        "indexer_types": ["full", "shared", "full", "shared"]},
     "summary": "DeepSeek-V3's router (sigmoid + bias, top-4 of 32 in the best 2 of 4 "
                "groups, renormalised x2.5), shared expert; layer 0 dense; DSA attention "
                "with shared indexer layers"},
    {"name": "longcat_flash", "config_class": "LongcatFlashConfig", "fields": {
        **_MLA, "num_layers": 4, "num_hidden_layers": 8, "num_key_value_heads": 2,
        "head_dim": 8, "n_routed_experts": 16, "zero_expert_num": 4, "moe_topk": 4,
        "expert_ffn_hidden_size": 16, "ffn_hidden_size": 32, "routed_scaling_factor": 2.0},
     "score_bias_std": 0.02,
     "summary": "float32 softmax + correction bias selects top-4 of 16 experts + 4 identity "
                "(zero) experts, raw softmax weights x2.0; shortcut MoE beside two "
                "MLA/MLP sublayers per layer"},
    {"name": "kimi_linear", "config_class": "KimiLinearConfig", "fields": {
        "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "num_key_value_heads": 2, "num_local_experts": 32,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 16, "intermediate_size": 32, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "layer_types": ["linear_attention", "full_attention"] * 2, "linear_head_dim": 16,
        "linear_num_heads": 2},
     "summary": "DeepSeek-V3's router (sigmoid + bias, top-4 of 32 in the best 2 of 4 "
                "groups, renormalised x2.5), shared expert; layer 0 dense; KDA linear and "
                "NoPE MLA attention layers alternate"},
    {"name": "granitemoehybrid", "config_class": "GraniteMoeHybridConfig", "fields": {
        "num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 16,
        "shared_intermediate_size": 32, "mamba_n_heads": 8, "mamba_d_state": 16,
        "mamba_chunk_size": 64, "layer_types": ["linear_attention", "full_attention"] * 2},
     "summary": "Granite-MoE's router (softmax over the top-4 of 16 float32 logits) plus a "
                "dense shared MLP, every layer sparse; mamba-2 and attention layers"},
    {"name": "nemotron_h", "config_class": "NemotronHConfig", "fields": {
        "head_dim": 32, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4,
        "topk_group": 2, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 32,
        "intermediate_size": 32, "routed_scaling_factor": 2.5, "use_mamba_kernels": False,
        "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
        "chunk_size": 64,
        "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"]},
     "summary": "sigmoid + correction bias, top-4 of 32 in the best 2 of 4 groups, "
                "renormalised x2.5, relu2 experts, shared expert; one mixer per block "
                "(mamba-2, attention, MoE): blocks 1 and 3 sparse"},
    {"name": "minimax_m3_vl_text", "config_class": "MiniMaxM3VLTextConfig", "fields": {
        "head_dim": 32, "num_local_experts": 16, "num_experts_per_tok": 4,
        "intermediate_size": 16, "shared_intermediate_size": 32, "dense_intermediate_size": 32,
        "routed_scaling_factor": 2.0, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "layer_types": ["full_attention", "minimax_m3_sparse"] * 2, "index_n_heads": 2,
        "index_head_dim": 16, "index_block_size": 8, "index_topk_blocks": 2},
     "summary": "sigmoid + correction bias, top-4 of 16, renormalised (the block scales "
                "the experts' output x2.0), shared expert, clamped swiglu; layer 0 dense; "
                "full and block-sparse (indexer, 2 blocks of 8 + local) attention"},
    {"name": "deepseek_v4", "config_class": "DeepseekV4Config", "fields": {
        "head_dim": 32, "q_lora_rank": 32, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 16, "routed_scaling_factor": 1.5, "o_groups": 2,
        "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 16, "sliding_window": 8,
        "hc_mult": 2, "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]},
     "attention": "eager",
     "summary": "sqrt(softplus) scores + correction bias, top-4 of 16, renormalised x1.5, "
                "shared expert; layer 0 hash-routed (token-id table, no label); "
                "compressed sparse attention, hyper-connections; eager"},
)

REFUSED_FAMILIES: dict[str, str] = {}
"""MoE model types of the installed transformers that are NOT teachers, and why:
``teacher init --family``, ``adapter_for`` and ``teacher families`` say so."""

