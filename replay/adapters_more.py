"""Route adapters of further MoE families (issue 16), after :mod:`replay.adapters_extra`.

Each class names where its family's router sits, what the router returns and in which
order, and the rule it executes, read from the family's ``modeling_*.py`` in the
installed transformers; :mod:`replay.adapters` registers them in ``ADAPTERS``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from hebrus_flywheel.replay.adapter_base import DeepseekV3Adapter, FamilyAdapter, sparse_mlp_layers
from hebrus_flywheel.replay.adapters_extra import DeepseekV32Adapter
from hebrus_flywheel.replay.exceptions import UnsupportedModelError
from hebrus_flywheel.replay.routing import RouterRule, topk_with_tie_break


class Cohere2MoeAdapter(FamilyAdapter):
    """Cohere2-MoE: routed where ``mlp_layer_types`` says ``sparse``; ``mlp.gate`` ranks
    the raw logits, weighs the top-k by the softmax over their logits (the renormalised
    softmax) or by their sigmoid (renormalised if ``norm_topk_prob``, no epsilon), cast
    to the hidden dtype; shared experts always run. Attention and the MoE block both
    read ``input_layernorm``'s output (a parallel block)."""

    model_type = "cohere2_moe"
    weights_in_hidden_dtype = True

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)

    def rule(self, config: Any) -> RouterRule:
        if config.expert_selection_fn == "softmax":
            return RouterRule(scoring="softmax", normalize=True)
        if config.expert_selection_fn == "sigmoid":
            return RouterRule(scoring="sigmoid", normalize=bool(config.norm_topk_prob))
        raise UnsupportedModelError(
            f"cohere2_moe expert_selection_fn {config.expert_selection_fn!r} has no route "
            "rule; supported are 'softmax' and 'sigmoid'")


class AfmoeAdapter(FamilyAdapter):
    """AFMoE: layers from ``num_dense_layers`` on routed by ``mlp.router``, whose inner
    ``gate`` Linear gives model-dtype logits upcast to float32; selection by sigmoid +
    the block's ``expert_bias`` (handed to the router as an argument), weights the
    sigmoid scores renormalised (``+ 1e-20``) times ``route_scale``; shared experts
    always run; pre/post norms around attention and the MoE block."""

    model_type = "afmoe"
    intermediate_field = "moe_intermediate_size"
    router_path = ("mlp", "router")
    logits_upcast = True

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(range(int(config.num_dense_layers or 0), int(config.num_hidden_layers)))

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="sigmoid", bias=True, normalize=True,
                          scale=float(config.route_scale))

    def router_weight(self, gate: nn.Module) -> Any:
        return getattr(getattr(gate, "gate", None), "weight", None)

    def layer_bias(self, layer: nn.Module) -> torch.Tensor | None:
        """The MoE block's ``expert_bias`` (the block passes it to the router)."""
        bias = getattr(getattr(layer, "mlp", None), "expert_bias", None)
        return bias if isinstance(bias, torch.Tensor) else None


class AriaTextAdapter(FamilyAdapter):
    """Aria (text): every layer routed; ``mlp.router`` is a bare ``nn.Linear`` (its output
    is the logits) and the experts' own ``route_tokens_to_experts`` takes the top-k
    logits and weighs them by the softmax over those (the renormalised softmax) in the
    logits' dtype. Exact routing replaces that experts method; the executed ids are what
    it returns for the logits the experts are called with. Shared experts always run."""

    model_type = "aria_text"
    expert_count_field = "moe_num_experts"
    top_k_field = "moe_topk"

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True)

    def find_router(self, layer: nn.Module) -> nn.Module | None:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        return router if isinstance(router, nn.Linear) else None

    def executed_ids_module(self, layer: nn.Module) -> nn.Module | None:
        """The experts, called as ``(hidden, router_logits)``."""
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        return experts if isinstance(experts, nn.Module) else None

    def executed_ids(self, module: nn.Module, args: Any) -> torch.Tensor:
        """The ids the experts' own (possibly replaced) selection gives their logits."""
        return cast(torch.Tensor, cast(Any, module).route_tokens_to_experts(args[1])[0])

    def install_exact_gate(self, layer: nn.Module, gate: nn.Module, forward: Any,
                           geometry: Any) -> None:
        """Replace the experts' ``route_tokens_to_experts`` with the declared rule."""
        def route(router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ids_NK, weights_NK = topk_with_tie_break(router_logits, geometry.top_k,
                                                     weight_rule=geometry.weight_rule)
            return ids_NK, weights_NK.to(router_logits.dtype)

        cast(Any, layer).mlp.experts.route_tokens_to_experts = route


class MiniMaxM2Adapter(FamilyAdapter):
    """MiniMax-M2: every layer routed by ``mlp.gate``: logits in the weight's dtype,
    selection by their float32 sigmoid + the block's ``e_score_correction_bias`` (handed
    to the gate as an argument), weights the sigmoid scores renormalised with no epsilon
    (``_eps0.0``), kept in float32; q/k-normed attention."""

    model_type = "minimax_m2"
    expert_count_field = "num_local_experts"
    weights_in_logit_dtype = False

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="sigmoid", bias=True, normalize=True, norm_eps=0.0)

    def layer_bias(self, layer: nn.Module) -> torch.Tensor | None:
        """The MoE block's ``e_score_correction_bias`` (the block passes it to the gate)."""
        bias = getattr(getattr(layer, "mlp", None), "e_score_correction_bias", None)
        return bias if isinstance(bias, torch.Tensor) else None


class MiMoV2FlashAdapter(DeepseekV32Adapter):
    """MiMo-V2-Flash: DeepSeek-V3's router (``mlp.gate``, float32 sigmoid + correction
    bias, top-k in the best ``topk_group`` of ``n_group`` groups, renormalised if
    ``norm_topk_prob``, x ``routed_scaling_factor``) on the layers ``mlp_layer_types``
    marks ``sparse``, no shared experts; sliding/full attention with partial rotary."""

    model_type = "mimo_v2_flash"


class SolarOpenAdapter(DeepseekV3Adapter):
    """Solar-Open: DeepSeek-V3's router (``mlp.gate``, float32 sigmoid + correction bias,
    grouped top-k, renormalised if ``norm_topk_prob``, x ``routed_scaling_factor``) on
    every layer (no dense layers), shared experts always run."""

    model_type = "solar_open"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(range(int(config.num_hidden_layers)))


class LagunaAdapter(FamilyAdapter):
    """Laguna: routed where ``mlp_layer_types`` says ``sparse``; ``mlp.gate`` upcasts
    its model-dtype logits to float32 and soft-caps them (``tanh(x / c) * c`` when
    ``moe_router_logit_softcapping`` c > 0; the returned, recorded logits are the capped
    ones); selection by their sigmoid + the gate's ``e_score_correction_bias``, weights
    the sigmoid scores renormalised with no epsilon, cast to the hidden dtype. The block
    multiplies the routed sum by ``moe_routed_scaling_factor`` (not part of the
    weights the router hands the experts); shared experts always run."""

    model_type = "laguna"
    intermediate_field = "moe_intermediate_size"
    logits_upcast = True
    weights_in_hidden_dtype = True

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="sigmoid", bias=True, normalize=True, norm_eps=0.0)

    def gate_logits(self, gate: nn.Module, hidden_NH: torch.Tensor) -> torch.Tensor:
        logits_NE = super().gate_logits(gate, hidden_NH)
        cap = float(cast(Any, gate).router_logit_softcapping)
        return torch.tanh(logits_NE / cap) * cap if cap > 0.0 else logits_NE


class MellumAdapter(FamilyAdapter):
    """Mellum: Qwen3-MoE's router (``mlp.gate``: softmax over all experts in float32,
    top-k, renormalised if ``norm_topk_prob``, weights in the logits' dtype) on the
    layers ``mlp_layer_types`` marks ``sparse``; sliding/full attention."""

    model_type = "mellum"
    intermediate_field = "moe_intermediate_size"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)


class Qwen4ExpTextAdapter(FamilyAdapter):
    """Qwen4-Exp (text): every layer routed by ``mlp.gate`` (softmax over all experts in
    float32, top-k, renormalised if ``norm_topk_prob``, weights in the logits' dtype); a
    sigmoid-gated shared expert always runs. Its layers have no ``input_layernorm``: the
    residual stream is ``hc_count`` hyper-connection streams (``hc_count x hidden`` wide),
    which ``attn_hyper_connection`` mixes into the one ``hidden``-wide input of the
    layer's attention; that input is the pre-attention state (the feature contract is
    ``hidden`` wide). The QSA indexer selects ``indexer_budget`` keys per query."""

    model_type = "qwen4_exp_text"
    intermediate_field = "moe_intermediate_size"

    def pre_attention_norm(self, layer: nn.Module) -> nn.Module:
        """The layer's attention (full or gated delta-net): a pre-hook on it sees the
        mixed ``hidden``-wide input as its first positional argument."""
        for name in ("self_attn", "linear_attn"):
            module = getattr(layer, name, None)
            if isinstance(module, nn.Module):
                return module
        raise UnsupportedModelError("a qwen4_exp_text layer has no self_attn or linear_attn")


class JetMoeAdapter(FamilyAdapter):
    """JetMoE: every layer's MLP routed by ``mlp.router``, whose inner ``layer`` Linear
    gives model-dtype logits upcast to float32; top-k by logit, weights the softmax
    over the top-k logits (the renormalised softmax) in the hidden dtype. The router
    returns its choice grouped by expert, ``(index_sorted_experts, batch_index,
    batch_gates, expert_size, logits)``: the adapter packs and unpacks that form. The
    attention's mixture of heads (``self_attention.experts``) routes too, top-k of its
    own router; that choice is not part of the route label (one router per layer)."""

    model_type = "jetmoe"
    expert_count_field = "num_local_experts"
    router_path = ("mlp", "router")
    logits_upcast = True
    weights_in_hidden_dtype = True

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True)

    def router_weight(self, gate: nn.Module) -> Any:
        return getattr(getattr(gate, "layer", None), "weight", None)

    def pack_router_output(self, logits: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor) -> tuple[Any, ...]:
        """The router's expert-grouped form, computed as its own forward does."""
        top_k = ids.shape[-1]
        flat_ids = ids.reshape(-1)
        expert_size = torch.bincount(flat_ids, minlength=logits.shape[-1]).tolist()
        _, index_sorted = flat_ids.sort(0)
        batch_index = index_sorted.div(top_k, rounding_mode="trunc")
        return index_sorted, batch_index, weights.reshape(-1)[index_sorted], expert_size, logits

    def split_router_output(self, output: Any, top_k: int) -> tuple[torch.Tensor, Any, Any]:
        """``(logits, weights, ids)`` per token in the router's top-k order."""
        index_sorted, _, batch_gates, expert_size, logits = output
        experts = torch.arange(logits.shape[-1], device=logits.device)
        sorted_ids = torch.repeat_interleave(experts, torch.tensor(expert_size,
                                                                   device=logits.device))
        ids = torch.empty_like(index_sorted)
        ids[index_sorted] = sorted_ids
        weights = torch.empty_like(batch_gates)
        weights[index_sorted] = batch_gates
        return logits, weights.reshape(-1, top_k), ids.reshape(-1, top_k)


MORE_ADAPTERS: tuple[FamilyAdapter, ...] = (
    Cohere2MoeAdapter(), AfmoeAdapter(), AriaTextAdapter(), MiniMaxM2Adapter(),
    MiMoV2FlashAdapter(), SolarOpenAdapter(), LagunaAdapter(), MellumAdapter(),
    Qwen4ExpTextAdapter(), JetMoeAdapter(),
)
