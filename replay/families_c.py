"""Tiny presets of the families of :mod:`replay.adapters_c` (``teacher init --family``).

Plain keyword sets of :class:`replay.families.FamilySpec`, merged into ``FAMILIES`` by
:mod:`replay.families` as :mod:`replay.families_hybrid`'s are. Widths follow its
``_COMMON`` toy geometry (hidden 64, 4 layers).
"""

from __future__ import annotations

from typing import Any

GEMMA4_TEXT_FIELDS: dict[str, Any] = {
    "head_dim": 32, "intermediate_size": 32, "enable_moe_block": True, "num_experts": 16,
    "top_k_experts": 4, "moe_intermediate_size": 16, "hidden_size_per_layer_input": 0,
    "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}
"""Gemma 4's tiny text geometry (also its composite's, :mod:`replay.families_vl`)."""

INKLING_TEXT_FIELDS: dict[str, Any] = {
    "head_dim": 32, "swa_num_attention_heads": 2, "swa_num_key_value_heads": 1,
    "swa_head_dim": 32, "sliding_window_size": 16, "d_rel": 8, "rel_extent": 64,
    "intermediate_size": 32, "moe_intermediate_size": 16, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "n_shared_experts": 1, "route_scale": 2.0,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "local_layer_ids": [0, 1, 2]}
"""Inkling's tiny text geometry (its composite, ``inkling_mm_model``, is refused)."""

C_FAMILIES: tuple[dict[str, Any], ...] = (
    {"name": "dbrx", "config_class": "DbrxConfig", "fields": {
        "d_model": 64, "n_heads": 2, "attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0,
                                                      "clip_qkv": 8.0},
        "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 16,
                       "moe_normalize_expert_weights": 1.0}},
     "summary": "softmax top-4 of 16 (router returns logits; the block selects), "
                "weights divided by their 1-norm (renormalised); every block sparse"},
    {"name": "hunyuan_v1_moe", "config_class": "HunYuanMoEV1Config", "fields": {
        "head_dim": 32, "num_experts": 16, "moe_topk": 4, "intermediate_size": 16},
     "summary": "float32 router (wg kept in float32), softmax top-4 of 16, renormalised, "
                "dense shared MLP; every layer sparse"},
    {"name": "mistral4", "config_class": "Mistral4Config", "fields": {
        "num_key_value_heads": 2, "kv_lora_rank": 16, "q_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8,
        "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "n_shared_experts": 1, "moe_intermediate_size": 16,
        "intermediate_size": 32, "norm_topk_prob": True, "routed_scaling_factor": 1.5},
     "summary": "softmax top-4 of 32 inside the best 2 of 4 groups (two best), "
                "renormalised x1.5, shared expert, MLA; layer 0 dense"},
    {"name": "gemma4_text", "config_class": "Gemma4TextConfig", "fields": GEMMA4_TEXT_FIELDS,
     "summary": "float32 softmax top-4 of 16 on a scaled, normalised stream, renormalised, "
                "each weight times a learned per-expert scale; a dense MLP beside the "
                "experts in every layer; sliding attention"},
    {"name": "inkling_text", "config_class": "InklingTextConfig", "fields": INKLING_TEXT_FIELDS,
     "summary": "sigmoid + correction bias selects top-4 of 16; weights a softmax of the "
                "chosen and the shared expert's log-sigmoids, x2 x a learned global scale; "
                "layer 0 dense; short convolutions, relative positions, sliding attention"},
    {"name": "zaya", "config_class": "ZayaConfig", "fields": {
        "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 1,
        "moe_intermediate_size": 16, "router_hidden_size": 32, "sliding_window": 16,
        "layer_types": ["hybrid_sliding", "hybrid"] * 2},
     "score_bias_std": 0.02, "score_bias_mean": -0.1,
     "summary": "MLP router over 16 experts + a skip class (runs no expert, weight 0), "
                "carrying its state to the next layer; float32 softmax + balancing bias "
                "selects top-1, raw weight; convolutional attention with a delayed value"},
)

C_REFUSED: dict[str, str] = {
    "openai_privacy_filter": (
        "it is a token classifier, not a generative model: its attention is bidirectional "
        "(a sliding window both ways), so there is no decode to capture and a token's route "
        "depends on the tokens after it"),
    "diffusion_gemma": (
        "it is a block-diffusion model: it writes a block of tokens by repeated denoising "
        "passes that attend both ways inside the block, not one token per decode step, so "
        "a route per decoded token replayed as causal prefill is not what it executed; and "
        "its router, like gemma4_text's, scales the top-k weights by a learned "
        "per_expert_scale"),
}
"""Merged into :data:`replay.families_hybrid.REFUSED_FAMILIES`."""
