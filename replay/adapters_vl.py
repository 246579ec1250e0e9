"""Route adapters of the text parts of vision-language MoE composites (issue 16).

A composite of :mod:`replay.composites` is read through its language model, so its
adapter is its TEXT config's family: an existing family's adapter where the text
decoder is that family's code (``aria`` -> ``aria_text``), else one here, read from the
composite's ``modeling_*.py`` like those of :mod:`replay.adapters_c`;
:mod:`replay.adapters` registers ``VL_ADAPTERS``.
"""

from __future__ import annotations

from typing import Any

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.replay.adapter_base import FamilyAdapter, Qwen3MoeAdapter, sparse_mlp_layers
from hebrus_flywheel.replay.adapters_extra import DeepseekV32Adapter, Ernie45MoeAdapter
from hebrus_flywheel.replay.routing import RouterRule


class Qwen3VLMoeTextAdapter(Qwen3MoeAdapter):
    """Qwen3-VL-MoE's language model: Qwen3-MoE's layout (sparse unless in
    ``mlp_only_layers`` or off the ``decoder_sparse_step``) and router (``mlp.gate``,
    float32 softmax over all experts, top-k), but the top-k weights are ALWAYS
    renormalised (the config has no ``norm_topk_prob``), cast to the logits' dtype."""

    model_type = "qwen3_vl_moe_text"

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True)


class Glm5NextTextAdapter(DeepseekV32Adapter):
    """GLM-5-Next's language model: DeepSeek-V3's router (``mlp.gate``: float32 logits,
    sigmoid + ``e_score_correction_bias`` for selection, top-k in the best ``topk_group``
    of ``n_group`` groups, sigmoid weights renormalised x ``routed_scaling_factor``)
    where ``mlp_layer_types`` says ``sparse``; shared experts. KDA linear and NoPE DSA
    attention layers; the residual stream is ``hc_mult`` hyper-connection channels, so
    the pre-attention feature is their mix entering ``input_layernorm`` (as HY-V4's)."""

    model_type = "glm5_next_text"


class Step3p5Adapter(FamilyAdapter):
    """Step-3.7's language model (text config ``step3p5``): routed where
    ``mlp_layer_types`` says ``sparse``; ``mlp.gate`` takes logits in its weight's dtype,
    selects the top-k of their float32 sigmoid + the gate's ``e_score_correction_bias``,
    weighs by the sigmoid scores renormalised with no epsilon (``_eps0.0``), kept in
    float32 (MiniMax-M2's rule); the block scales the experts' output by
    ``moe_router_scaling_factor`` (not part of the route) and adds a shared expert."""

    model_type = "step3p5"
    expert_count_field = "num_local_experts"
    intermediate_field = "moe_intermediate_size"
    weights_in_logit_dtype = False

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="sigmoid", bias=True, normalize=True, norm_eps=0.0)


class Ernie45VLMoeTextAdapter(Ernie45MoeAdapter):
    """ERNIE-4.5-VL-MoE's language model: each sparse layer (``mlp_layer_types``) holds
    modality-isolated experts, and a text token (``mm_token_type_ids`` 0, or absent:
    text-only input) runs ONLY ``mlp.text_moe``, whose gate is ERNIE-4.5-MoE's (float32
    logits, softmax + ``moe_statics.e_score_correction_bias`` ranks, softmax
    renormalised over the top-k, cast to the hidden dtype); the vision experts never
    see it, so the text gate's route is the whole route of text decode. The per-expert
    width is the text experts' (``moe_intermediate_size[0]``)."""

    model_type = "ernie4_5_vl_moe_text"
    router_path = ("mlp", "text_moe", "gate")

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)

    def geometry(self, config: Any) -> RouteGeometry:
        return RouteGeometry(
            family=self.model_type, layer_count=int(config.num_hidden_layers),
            routed_layers=self.routed_layers(config), expert_count=int(config.num_experts),
            top_k=int(config.num_experts_per_tok), weight_rule=self.weight_rule(config),
            hidden_size=int(config.hidden_size),
            routed_intermediate_size=int(config.moe_intermediate_size[0]),  # [text, vision]
        )


PADDING_MASK_FAMILIES = frozenset({"glm5_next_text"})
"""Families whose every attention kind takes the 2D padding mask, causality applied
inside (GLM-5-Next's own forward hands its DSA and KDA layers that mask, never a 4D
one): :func:`replay.masks.attention_masks` gives them exactly that."""


VL_ADAPTERS: tuple[FamilyAdapter, ...] = (Qwen3VLMoeTextAdapter(), Glm5NextTextAdapter(),
                                         Step3p5Adapter(), Ernie45VLMoeTextAdapter())
