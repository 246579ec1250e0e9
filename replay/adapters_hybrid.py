"""Route adapters of further MoE families of the installed transformers (issue 16, part 2).

Same contract as :mod:`replay.adapters_extra`: each class names where its family's router
sits, what it returns and in which order, and the rule it executes, read from the
family's ``modeling_*.py``; :mod:`replay.adapters` registers ``HYBRID_ADAPTERS``.
"""

from __future__ import annotations

from typing import Any

from hebrus_flywheel.replay.adapter_base import ROUTER_OUTPUT, DeepseekV3Adapter, FamilyAdapter
from hebrus_flywheel.replay.adapters_extra import (
    DeepseekV32Adapter,
    Glm4MoeLiteAdapter,
    GraniteMoeAdapter,
)
from hebrus_flywheel.replay.exceptions import UnsupportedModelError
from hebrus_flywheel.replay.routing import RouterRule


class GraniteMoeSwaAdapter(GraniteMoeAdapter):
    """Granite-MoE-SWA: Granite-MoE's router (float32-upcast logits, softmax over the
    top-k logits cast to the hidden dtype) returning ``(logits, weights, ids)``; sliding
    window and full attention with per-head sinks (no sdpa path: eager)."""

    model_type = "granitemoe_swa"
    router_output = ROUTER_OUTPUT


class HYV4Adapter(Glm4MoeLiteAdapter):
    """Hunyuan-V4: DeepSeek-V3's router (``mlp.gate``: float32 logits, sigmoid + the gate's
    ``e_score_correction_bias`` for selection, top-k in the best ``topk_group`` of
    ``n_group`` groups, sigmoid weights renormalised x ``routed_scaling_factor``) where
    ``mlp_layer_types`` says ``sparse``; shared experts; DSA sparse attention with sinks
    (eager only). Its residual stream is ``hc_mult`` hyper-connection channels, so the
    pre-attention feature is the channels' mix entering ``input_layernorm`` (width H)."""

    model_type = "hy_v4"


class AXK1Adapter(DeepseekV3Adapter):
    """A.X-K1: DeepSeek-V3 (float32 sigmoid router + correction bias, grouped top-k,
    renormalised x ``routed_scaling_factor``, first-k-dense layers, shared expert) with
    an RMSNorm on the MoE block's output, which the route does not see."""

    model_type = "axk1"


class AXK2Adapter(DeepseekV32Adapter):
    """A.X-K2: routed where ``mlp_layer_types`` says ``sparse``; ``mlp.gate`` takes float32
    logits, selects the top-k of sigmoid + ``e_score_correction_bias`` over all experts
    (``n_group`` None, the A.X-K2-Light layout), weights the sigmoid scores renormalised
    x ``routed_scaling_factor``; shared expert, gated RMSNorms, DSA attention. Grouped
    configs are refused: their gate fills the masked groups' scores with 0.0, not -inf,
    so an expert of a dropped group outranks a kept one whose biased score is negative,
    which no route rule here models."""

    model_type = "axk2"

    def rule(self, config: Any) -> RouterRule:
        if config.n_group is not None and int(config.n_group) > 1:
            raise UnsupportedModelError(
                f"axk2 with n_group={config.n_group}: its grouped gate scores the experts of "
                "dropped groups 0.0 (not -inf), so they can outrank kept experts with a "
                "negative biased score; that selection has no route rule here"
            )
        return RouterRule(scoring="sigmoid", bias=True, normalize=bool(config.norm_topk_prob),
                          scale=float(config.routed_scaling_factor))


class GlmMoeDsaAdapter(DeepseekV32Adapter):
    """GLM-MoE-DSA (GLM-5): DeepSeek-V3's router (float32 sigmoid + correction bias, top-k
    in the best ``topk_group`` of ``n_group`` groups, renormalised x
    ``routed_scaling_factor``) where ``mlp_layer_types`` says ``sparse``; shared expert;
    DSA attention whose ``shared`` indexer layers reuse the previous layer's top-k keys."""

    model_type = "glm_moe_dsa"


HYBRID_ADAPTERS: tuple[FamilyAdapter, ...] = (
    GraniteMoeSwaAdapter(), HYV4Adapter(), AXK1Adapter(), AXK2Adapter(), GlmMoeDsaAdapter(),
)
