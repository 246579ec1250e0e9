"""Route adapters of further MoE families of the installed transformers (issue 16, part 2).

Same contract as :mod:`replay.adapters_extra`: each class names where its family's router
sits, what it returns and in which order, and the rule it executes, read from the
family's ``modeling_*.py``; :mod:`replay.adapters` registers ``HYBRID_ADAPTERS``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.replay.adapter_base import (
    ROUTER_OUTPUT,
    DeepseekV3Adapter,
    FamilyAdapter,
    sparse_mlp_layers,
)
from hebrus_flywheel.replay.adapters_extra import (
    DeepseekV32Adapter,
    Glm4MoeLiteAdapter,
    GraniteMoeAdapter,
    GraniteMoeSharedAdapter,
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
    logits, selects the top-k of sigmoid + ``e_score_correction_bias`` (over all experts
    when ``n_group`` is None, the A.X-K2-Light layout; else within the best
    ``topk_group`` of ``n_group`` groups, the dropped groups' experts scored 0.0, not
    -inf: the ``_fill0`` rule), weights the sigmoid scores renormalised x
    ``routed_scaling_factor``; shared expert, gated RMSNorms, DSA attention."""

    model_type = "axk2"

    def rule(self, config: Any) -> RouterRule:
        groups = int(config.n_group or 1)
        return RouterRule(scoring="sigmoid", bias=True, normalize=bool(config.norm_topk_prob),
                          scale=float(config.routed_scaling_factor), groups=groups,
                          topk_groups=int(config.topk_group or 1) if groups > 1 else 1,
                          group_fill_zero=groups > 1)


class GlmMoeDsaAdapter(DeepseekV32Adapter):
    """GLM-MoE-DSA (GLM-5): DeepSeek-V3's router (float32 sigmoid + correction bias, top-k
    in the best ``topk_group`` of ``n_group`` groups, renormalised x
    ``routed_scaling_factor``) where ``mlp_layer_types`` says ``sparse``; shared expert;
    DSA attention whose ``shared`` indexer layers reuse the previous layer's top-k keys."""

    model_type = "glm_moe_dsa"


class LongcatFlashAdapter(FamilyAdapter):
    """LongCat-Flash: ``num_layers`` decoder layers, each two attention + dense-MLP
    sublayers and one shortcut MoE (``mlp.router``) fed by the first sublayer's
    ``post_attention_layernorm``. The router takes float32 logits of its ``classifier``
    weight (its bias unused), ranks experts by the softmax over ALL experts plus
    ``e_score_correction_bias``, and weighs them by the raw softmax x
    ``routed_scaling_factor`` (float32). Its ``zero_expert_num`` zero-compute (identity)
    experts are experts like the others: ids from ``n_routed_experts`` on. The router
    returns ``(weights, ids)`` only, so the logits are recomputed from the call's input
    with the router's own arithmetic."""

    model_type = "longcat_flash"
    router_path = ("mlp", "router")
    router_output = ("weights", "ids")
    logits_in_float32 = True

    def geometry(self, config: Any) -> RouteGeometry:
        layers = int(config.num_layers)
        return RouteGeometry(
            family=self.model_type, layer_count=layers, routed_layers=tuple(range(layers)),
            expert_count=int(config.n_routed_experts) + int(config.zero_expert_num or 0),
            top_k=int(config.moe_topk), weight_rule=self.weight_rule(config),
            hidden_size=int(config.hidden_size),
            routed_intermediate_size=int(config.expert_ffn_hidden_size),
        )

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(range(int(config.num_layers)))

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", bias=True, normalize=False,
                          scale=float(config.routed_scaling_factor))

    def router_weight(self, gate: nn.Module) -> torch.Tensor:
        return cast(torch.Tensor, cast(Any, gate).classifier.weight)

    def gate_logits(self, gate: nn.Module, hidden_NH: torch.Tensor) -> torch.Tensor:
        """``F.linear`` of the float32 input and classifier weight, as the router does."""
        return F.linear(hidden_NH.to(torch.float32), self.router_weight(gate).to(torch.float32))

    def router_call_output(self, gate: nn.Module, args: Any, output: Any) -> Any:
        """``(logits, weights, ids)``: the logits recomputed from the router's input."""
        weights, ids = output
        hidden_NH = args[0].reshape(-1, self.router_weight(gate).shape[-1])
        return self.gate_logits(gate, hidden_NH), weights, ids

    def split_router_output(self, output: Any, top_k: int) -> tuple[torch.Tensor, Any, Any]:
        logits, weights, ids = output
        return logits, weights, ids

    def pre_attention_norm(self, layer: nn.Module) -> nn.Module:
        """The first sublayer's ``input_layernorm`` (the layer holds a pair)."""
        return cast(nn.ModuleList, cast(Any, layer).input_layernorm)[0]

    def check_gate(self, gate: nn.Module, geometry: RouteGeometry) -> str | None:
        weight = self.router_weight(gate)
        if tuple(weight.shape) != (geometry.expert_count, geometry.hidden_size):
            return "has no [E, H] classifier weight"
        return None


class KimiLinearAdapter(DeepseekV32Adapter):
    """Kimi-Linear: DeepSeek-V3's router (``mlp.gate``: float32 sigmoid + correction bias,
    top-k in the best ``topk_group`` of ``num_expert_group`` groups, renormalised if
    ``moe_renormalize``, x ``routed_scaling_factor``) where ``mlp_layer_types`` says
    ``sparse``; shared experts; KDA linear attention and NoPE MLA layers."""

    model_type = "kimi_linear"
    expert_count_field = "num_local_experts"


class GraniteMoeHybridAdapter(GraniteMoeSharedAdapter):
    """Granite-MoE-Hybrid (Granite 4.0): Granite-MoE's router (``block_sparse_moe.router``
    returning ``(ids, weights, logits)``; float32-upcast logits, softmax over the top-k
    logits in the hidden dtype) on every layer when ``num_local_experts > 0``, a dense
    ``shared_mlp`` beside it; mamba-2 and attention layers."""

    model_type = "granitemoehybrid"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        if int(config.num_local_experts or 0) <= 0:
            return ()
        return tuple(range(int(config.num_hidden_layers)))


class NemotronHAdapter(DeepseekV3Adapter):
    """Nemotron-H: each block is ONE mixer (mamba-2, attention, dense MLP or MoE) after
    the block's ``norm``; the ``moe`` blocks are routed by ``mixer.gate``, DeepSeek-V3's
    router (float32 sigmoid + correction bias, top-k in the best ``topk_group`` of
    ``n_group`` groups, renormalised x ``routed_scaling_factor``), with non-gated relu2
    experts and a shared expert. The pre-attention feature is the block's input."""

    model_type = "nemotron_h"
    router_path = ("mixer", "gate")
    pre_attention_norm_path = ("norm",)

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(config.layers_block_type) if kind == "moe")


class MiniMaxM3VLTextAdapter(FamilyAdapter):
    """MiniMax-M3 (text): routed where ``mlp_layer_types`` says ``sparse``; ``mlp.gate``
    computes logits in the model dtype, selects the top-k of float32 sigmoid +
    ``e_score_correction_bias`` and returns the float32 sigmoid weights renormalised
    (a plain division: adding 1e-20 to a sum of k sigmoids changes no float32 bit). The
    block multiplies the experts' OUTPUT by ``routed_scaling_factor``, so the gate's
    weights, the label, carry no scale; shared expert; full and block-sparse
    (``minimax_m3_sparse``, a block indexer) attention layers."""

    model_type = "minimax_m3_vl_text"
    weights_in_logit_dtype = False

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="sigmoid", bias=True, normalize=True)


class DeepseekV4Adapter(FamilyAdapter):
    """DeepSeek-V4: ``moe`` layers (``mlp_layer_types``) routed by ``mlp.gate``: logits in
    the model dtype, scores ``scoring_func`` of them (``sqrtsoftplus`` =
    sqrt(softplus), or sigmoid), top-k of score + ``e_score_correction_bias``, weights
    the scores renormalised (+1e-20) x ``routed_scaling_factor``; shared expert. The
    ``hash_moe`` layers pick experts by a frozen token-id table (``tid2eid``), not from
    logits: they are not routed layers (no label), as a dense layer is not. The
    residual stream is ``hc_mult`` hyper-connection channels: the pre-attention feature
    is their mix entering ``input_layernorm``; compressed sparse attention."""

    model_type = "deepseek_v4"
    expert_count_field = "n_routed_experts"
    intermediate_field = "moe_intermediate_size"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(config.mlp_layer_types) if kind == "moe")

    def rule(self, config: Any) -> RouterRule:
        scoring = str(config.scoring_func)
        if scoring not in ("sqrtsoftplus", "sigmoid"):
            raise UnsupportedModelError(
                f"deepseek_v4 scoring_func {scoring!r} has no route rule here; supported are "
                "'sqrtsoftplus' and 'sigmoid'")
        return RouterRule(scoring=scoring, bias=True, normalize=True,
                          scale=float(config.routed_scaling_factor))

    def find_router(self, layer: nn.Module) -> nn.Module | None:
        """The learned top-k gate; a hash layer's gate (no correction bias) is not one."""
        gate = super().find_router(layer)
        return gate if gate is not None and self.score_bias(gate) is not None else None


HYBRID_ADAPTERS: tuple[FamilyAdapter, ...] = (
    GraniteMoeSwaAdapter(), HYV4Adapter(), AXK1Adapter(), AXK2Adapter(), GlmMoeDsaAdapter(),
    LongcatFlashAdapter(), KimiLinearAdapter(), GraniteMoeHybridAdapter(), NemotronHAdapter(),
    MiniMaxM3VLTextAdapter(), DeepseekV4Adapter(),
)
