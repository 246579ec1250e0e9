"""Tiny presets of the vision-language composites of :mod:`replay.composites`.

Plain keyword sets of :class:`replay.families.FamilySpec`, merged into ``FAMILIES`` by
:mod:`replay.families`. ``fields`` make the composite's ``text_config`` at
:mod:`replay.families`' toy widths (hidden 64, 4 layers); ``sub_configs`` hold a
one-block vision tower (its weights are saved and dropped on load). Each multimodal
RoPE section sums to half the head dim.
"""

from __future__ import annotations

from typing import Any

from hebrus_flywheel.replay.families_c import GEMMA4_TEXT_FIELDS
from hebrus_flywheel.replay.families_hybrid import HYBRID_FAMILIES
from hebrus_flywheel.replay.families_more import MORE_FAMILIES

_TINY_VIT = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
"""A one-layer ViT vision tower (Aria's, MiniMax-M3-VL's, Step3p7's vision config)."""


def _text_fields(name: str) -> dict[str, Any]:
    """The tiny preset fields of the text family ``name``: a composite whose language
    model is that family's code gets the same text geometry."""
    return dict(next(row["fields"] for row in (*HYBRID_FAMILIES, *MORE_FAMILIES)
                     if row["name"] == name))


VL_FAMILIES: tuple[dict[str, Any], ...] = (
    {"name": "qwen3_vl_moe", "config_class": "Qwen3VLMoeConfig", "fields": {
        "head_dim": 32, "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
        "intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [0],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [8, 4, 4], "mrope_interleaved": True}},
     "sub_configs": {"vision_config": {
         "depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
         "out_hidden_size": 64, "deepstack_visual_indexes": [0]}},
     "summary": "composite: softmax top-4 of 32, always renormalised; layer 0 dense "
                "(mlp_only_layers); interleaved multimodal RoPE (text: 1D positions)"},
    {"name": "glm4v_moe", "config_class": "Glm4vMoeConfig", "fields": {
        "head_dim": 32, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "moe_intermediate_size": 16, "intermediate_size": 32, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [4, 2, 2], "partial_rotary_factor": 0.5}},
     "sub_configs": {"vision_config": {
         "depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
         "out_hidden_size": 64}},
     "summary": "composite: GLM-4-MoE's router (sigmoid + correction bias, top-4 of 16, "
                "renormalised), shared expert; layer 0 dense; multimodal partial RoPE"},
    {"name": "aria", "config_class": "AriaConfig", "fields": {
        "model_type": "aria_text",  # AriaConfig builds a text config only from a typed dict
        **_text_fields("aria_text")},
     "sub_configs": {"vision_config": _TINY_VIT,
         "projector_patch_to_query_dict": {4: 2}},
     "summary": "composite: Aria's text model (softmax over the top-4 of 16 logits, router "
                "a bare Linear, shared experts, every layer sparse)"},
    {"name": "minimax_m3_vl", "config_class": "MiniMaxM3VLConfig",
     "fields": _text_fields("minimax_m3_vl_text"),
     "sub_configs": {"vision_config": _TINY_VIT,
         "projector_hidden_size": 32},
     "summary": "composite: MiniMax-M3's text model (sigmoid + correction bias, top-4 of "
                "16, renormalised, output x2.0, shared expert; layer 0 dense; full and "
                "block-sparse attention)"},
    {"name": "glm5_next", "config_class": "Glm5NextConfig", "fields": {
        "num_key_value_heads": 2, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 0,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 32,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 16, "intermediate_size": 32, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "layer_types": ["linear_attention", "deepseek_sparse_attention"] * 2,
        "index_topk": 2048, "index_n_heads": 2, "index_head_dim": 16, "linear_head_dim": 16,
        "linear_num_heads": 2, "hc_mult": 2},
     "sub_configs": {"vision_config": {
         "depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
         "out_hidden_size": 64}},
     "summary": "composite: DeepSeek-V3's router (sigmoid + bias, top-4 of 32 in the best 2 "
                "of 4 groups, renormalised x2.5), shared expert; layer 0 dense; KDA linear "
                "and NoPE DSA attention, 2 hyper-connection streams"},
    {"name": "step3p7", "config_class": "Step3p7Config", "fields": {
        "head_dim": 32, "n_routed_experts": 16, "num_experts_per_tok": 4,  # num_local_experts
        "moe_intermediate_size": 16, "share_expert_dim": 16, "intermediate_size": 32,
        "moe_router_scaling_factor": 2.0, "sliding_window": 16,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "layer_types": ["sliding_attention", "full_attention"] * 2},
     "sub_configs": {"vision_config": {**_TINY_VIT, "mlp_ratio": 1.0,
                                       "max_position_embeddings": 4}},
     "summary": "composite: sigmoid + correction bias, top-4 of 16, renormalised (no "
                "epsilon), float32 weights (the block scales the experts' output x2.0), "
                "shared expert; layer 0 dense; sliding/full attention"},
    {"name": "ernie4_5_vl_moe", "config_class": "Ernie4_5_VLMoeConfig", "fields": {
        "head_dim": 32, "moe_num_experts": 16, "moe_k": 4, "moe_intermediate_size": [16, 16],
        "moe_num_shared_experts": 1, "intermediate_size": 32,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                            "mrope_section": [6, 6, 4]}},
     "sub_configs": {"vision_config": {
         "depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2}},
     "score_bias_std": 0.02,
     "summary": "composite: text experts only (text tokens never reach the vision "
                "experts): float32 softmax + correction bias selects top-4 of 16, softmax "
                "renormalised weights, shared expert; layer 0 dense; multimodal RoPE"},
    {"name": "deepseek_ocr2", "config_class": "DeepseekOcr2Config", "fields": {
        "head_dim": 32, "num_key_value_heads": 2, "n_routed_experts": 32,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "topk_method": "group_limited_greedy", "n_shared_experts": 1,
        "moe_intermediate_size": 16, "intermediate_size": 32, "routed_scaling_factor": 1.5,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
     "sub_configs": {"vision_config": {
         "sam_config": {"hidden_size": 16, "output_channels": 16, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "image_size": 32, "patch_size": 16,
                        "window_size": 2, "global_attn_indexes": [0]},
         "encoder_config": {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 32,
                            "num_hidden_layers": 1, "num_attention_heads": 2,
                            "num_key_value_heads": 2}}},
     "summary": "composite: DeepSeek-V2's router (softmax top-4 of 32 inside the best 2 of 4 "
                "groups by group max, raw weights x1.5), shared expert; layer 0 dense"},
    {"name": "qwen3_omni_moe", "config_class": "Qwen3OmniMoeConfig", "fields": {
        "head_dim": 32, "num_experts": 64, "num_experts_per_tok": 8,
        "moe_intermediate_size": 16, "intermediate_size": 32, "decoder_sparse_step": 1,
        "mlp_only_layers": [0], "norm_topk_prob": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [8, 4, 4], "mrope_interleaved": True}},
     "sub_configs": {"enable_audio_output": False, "thinker_config": {
         "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 32,
                           "num_heads": 2, "out_hidden_size": 64,
                           "deepstack_visual_indexes": [0]},
         "audio_config": {"num_mel_bins": 16, "encoder_layers": 1,
                          "encoder_attention_heads": 2, "encoder_ffn_dim": 32, "d_model": 32,
                          "output_dim": 64, "downsample_hidden_size": 8}}},
     "summary": "composite: the thinker's text model, Qwen3-MoE's router (softmax top-8 of "
                "64, renormalised); layer 0 dense; no talker (enable_audio_output off)"},
    {"name": "gemma4", "config_class": "Gemma4Config", "fields": GEMMA4_TEXT_FIELDS,
     "sub_configs": {"vision_config": {
         "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16},
         "audio_config": None},
     "summary": "composite: Gemma 4's language model (float32 softmax top-4 of 16, "
                "renormalised, times a learned per-expert scale); no audio tower"},
)

VL_REFUSED_AS_TEXT: dict[str, str] = {}
"""Composites whose language model is a refused text family's: refused with its reason
(:mod:`replay.refused`)."""

VL_REFUSED: dict[str, str] = {
    "inkling_mm_model": (
        "on text its forward applies the language model's embed_norm to the embeddings "
        "and then runs the language model, which applies embed_norm again (transformers "
        "5.17): what it executes is not its language model's text forward, which "
        "inkling_text checkpoints replay exactly; load the language model's weights as an "
        "inkling_text checkpoint instead"),
    "gemma4_unified": (
        "not a mixture-of-experts model: its language model (gemma4_unified_text) has "
        "only dense MLPs, so there is no route to record"),
}
"""Composites refused for a reason of their own."""

