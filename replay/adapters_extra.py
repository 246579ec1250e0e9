"""Route adapters of the MoE families added after the first eight (issue 16).

Each class names where its family's router sits, what the router returns and in which
order, and the rule it executes, read from the family's ``modeling_*.py`` in the
installed transformers; :mod:`replay.adapters` registers them in ``ADAPTERS``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from hebrus_flywheel.replay.adapter_base import DeepseekV3Adapter, FamilyAdapter, sparse_mlp_layers
from hebrus_flywheel.replay.exceptions import UnsupportedModelError
from hebrus_flywheel.replay.routing import RouterRule


class GptOssAdapter(FamilyAdapter):
    """GPT-OSS: every layer routed by ``mlp.router``, whose linear has a bias (part of
    the logits); softmax over the top-k logits, i.e. the renormalised top-k softmax."""

    model_type = "gpt_oss"
    expert_count_field = "num_local_experts"
    router_path = ("mlp", "router")
    logit_bias = True

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True)


class GraniteMoeAdapter(FamilyAdapter):
    """Granite-MoE: every layer routed by ``block_sparse_moe.router``, which returns
    ``(ids, weights, logits)``; logits are the model-dtype linear upcast to float32,
    weights the softmax over the top-k logits cast to the hidden states' dtype."""

    model_type = "granitemoe"
    expert_count_field = "num_local_experts"
    router_path = ("block_sparse_moe", "router")
    router_output = ("ids", "weights", "logits")
    logits_upcast = True
    weights_in_hidden_dtype = True

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True)


class GraniteMoeSharedAdapter(GraniteMoeAdapter):
    """Granite-MoE-Shared: Granite-MoE's router plus a dense ``shared_mlp`` every token
    runs (not part of the route)."""

    model_type = "granitemoeshared"


class MiniMaxAdapter(FamilyAdapter):
    """MiniMax: Mixtral's router (``mlp.gate``, softmax over all experts in float32, top-k
    renormalised, float32 weights) on every layer; hybrid lightning/full attention."""

    model_type = "minimax"
    expert_count_field = "num_local_experts"
    weights_in_logit_dtype = False

    def new_cache(self, model: nn.Module) -> Any:
        """MiniMax's forward refuses any cache but its own (it holds the lightning state)."""
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True)


class PhimoeAdapter(FamilyAdapter):
    """PhiMoE: every layer routed by ``mlp.router`` (an ``nn.Linear`` subclass) through
    the sparsemixer, which at inference takes the best two logits and weighs each by its
    softmax among the not-yet-chosen experts within a relative gap of
    ``2 * router_jitter_noise`` (:mod:`replay.routing`). The sparsemixer always picks two
    experts whatever ``num_experts_per_tok`` says, so any other top-k is refused."""

    model_type = "phimoe"
    expert_count_field = "num_local_experts"
    router_path = ("mlp", "router")

    def rule(self, config: Any) -> RouterRule:
        if int(config.num_experts_per_tok) != 2:
            raise UnsupportedModelError(
                f"phimoe num_experts_per_tok={config.num_experts_per_tok}: the sparsemixer "
                "router always executes two experts, so a top-k label would not be what ran"
            )
        return RouterRule(scoring="sparsemixer", normalize=False,
                          jitter_eps=float(config.router_jitter_noise))


class Llama4TextAdapter(FamilyAdapter):
    """Llama 4 (text): ``config.moe_layers`` routed by ``feed_forward.router`` (an
    ``nn.Linear`` subclass) returning ``(scores [N, E], logits)``: top-k by raw logit,
    each chosen expert's score ``sigmoid(logit)`` (unnormalised; Llama 4 scales the
    expert's INPUT by it), every other score exactly 0; a shared expert always runs."""

    model_type = "llama4_text"
    expert_count_field = "num_local_experts"
    router_path = ("feed_forward", "router")

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(sorted(int(i) for i in config.moe_layers))

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="sigmoid", normalize=False)

    def pack_router_output(self, logits: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Dense scores (the weights at the chosen ids, 0 elsewhere) and the logits."""
        scores_NE = torch.zeros_like(logits).scatter(1, ids, weights.to(logits.dtype))
        return scores_NE, logits

    def split_router_output(self, output: Any, top_k: int) -> tuple[torch.Tensor, Any, Any]:
        """The executed experts are the nonzero scores; ranked by score (lower id first
        on a tie), which is the logit order since sigmoid is monotonic."""
        scores_NE, logits_NE = output
        ids_NK = torch.sort(scores_NE, dim=-1, descending=True, stable=True).indices[:, :top_k]
        return logits_NE, torch.gather(scores_NE, -1, ids_NK), ids_NK


class Dots1Adapter(DeepseekV3Adapter):
    """dots.llm1: DeepSeek-V3's router (float32 sigmoid, correction bias, grouped top-k,
    optional renormalisation, ``routed_scaling_factor``), first-k-dense layers and
    shared experts; only the expert count is named ``num_local_experts`` by the model."""

    model_type = "dots1"


class Ernie45MoeAdapter(FamilyAdapter):
    """ERNIE-4.5-MoE: ``mlp.gate`` computes float32 logits, ranks experts by the float32
    softmax PLUS ``moe_statics.e_score_correction_bias`` and weighs them by the softmax
    renormalised over the top-k (the ``moe_norm_min`` clamp of the sum cannot bind:
    it is at least k/E), cast to the hidden dtype. Sparse on every
    ``moe_layer_interval``-th layer within ``[moe_layer_start_index,
    moe_layer_end_index]``; shared experts always run."""

    model_type = "ernie4_5_moe"
    intermediate_field = "moe_intermediate_size"
    logits_in_float32 = True
    weights_in_hidden_dtype = True

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        layers = int(config.num_hidden_layers)
        end = int(config.moe_layer_end_index)
        end = layers - 1 if end == -1 else end
        start, step = int(config.moe_layer_start_index), int(config.moe_layer_interval)
        return tuple(i for i in range(layers) if (i + 1) % step == 0 and start <= i <= end)

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", bias=True, normalize=True)

    def score_bias(self, gate: nn.Module) -> torch.Tensor | None:
        """The ``[1, E]`` statics bias as an ``[E]`` view (writes reach the parameter)."""
        bias = getattr(getattr(gate, "moe_statics", None), "e_score_correction_bias", None)
        return bias.view(-1) if isinstance(bias, torch.Tensor) else None


class Qwen35MoeTextAdapter(FamilyAdapter):
    """Qwen3.5-MoE (text): every layer routed by ``mlp.gate``: softmax over all experts in
    float32, top-k always renormalised, weights cast to the logits' dtype; a
    sigmoid-gated shared expert always runs; hybrid linear/full attention."""

    model_type = "qwen3_5_moe_text"
    intermediate_field = "moe_intermediate_size"

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True)


class FlexOlmoAdapter(FamilyAdapter):
    """FlexOlmo: every layer routed by ``mlp.gate`` (softmax over all experts in float32,
    top-k, renormalised only if ``norm_topk_prob``). Its layers are post-norm (no
    ``input_layernorm``): the router reads the raw residual stream after attention, and
    the pre-attention state is the decoder layer's own input."""

    model_type = "flex_olmo"

    def pre_attention_norm(self, layer: nn.Module) -> nn.Module:
        """The decoder layer itself: a pre-hook on it sees the residual stream entering
        the layer (its first positional argument), as ``input_layernorm`` does elsewhere."""
        return layer


class DeepseekV32Adapter(DeepseekV3Adapter):
    """DeepSeek-V3.2: DeepSeek-V3's router and shared experts; a layer is routed where
    ``config.mlp_layer_types`` says ``sparse``. Its sparse attention (a token indexer
    choosing ``index_topk`` keys) shapes the hidden states, not the route rule; but in
    transformers 5.17 KV-cache decode and prefill attend to different keys once the
    context exceeds ``index_topk`` (measured: 13 of 60 route pairs differ at index_topk=16),
    so only contexts within ``index_topk`` reach parity; the parity gate refuses others."""

    model_type = "deepseek_v32"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)


class Glm4MoeLiteAdapter(DeepseekV32Adapter):
    """GLM-4-MoE-Lite: DeepSeek-V3's router (float32 sigmoid + correction bias, groups,
    renormalised, scaled) on the layers ``mlp_layer_types`` marks ``sparse``; MLA
    attention, shared experts."""

    model_type = "glm4_moe_lite"


class Lfm2MoeAdapter(FamilyAdapter):
    """LFM2-MoE: layers from ``num_dense_layers`` on routed by ``feed_forward.gate``:
    sigmoid of the logits, selection adding the block's ``expert_bias`` (if
    ``use_expert_bias``), weights the sigmoid scores renormalised with ``+ 1e-6`` in the
    denominator (if ``norm_topk_prob``) times ``routed_scaling_factor``. Its layers
    normalise with ``operator_norm`` before attention or the short convolution."""

    model_type = "lfm2_moe"
    intermediate_field = "moe_intermediate_size"
    router_path = ("feed_forward", "gate")
    pre_attention_norm_path = ("operator_norm",)

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(range(int(config.num_dense_layers), int(config.num_hidden_layers)))

    def rule(self, config: Any) -> RouterRule:
        normalize = bool(config.norm_topk_prob)
        return RouterRule(scoring="sigmoid", bias=bool(config.use_expert_bias),
                          normalize=normalize, norm_eps=1e-6 if normalize else 1e-20,
                          scale=float(config.routed_scaling_factor))

    def layer_bias(self, layer: nn.Module) -> torch.Tensor | None:
        """The MoE block's ``expert_bias`` buffer (the block passes it to the gate)."""
        bias = getattr(getattr(layer, "feed_forward", None), "expert_bias", None)
        return bias if isinstance(bias, torch.Tensor) else None


class HYV3Adapter(FamilyAdapter):
    """Hunyuan-V3: routed where ``mlp_layer_types`` says ``sparse``; ``mlp.gate`` takes
    float32 logits, selects by sigmoid + the block's ``e_score_correction_bias`` (handed
    to the gate as an argument), weighs by the sigmoid scores renormalised (``+ 1e-20``)
    times ``router_scaling_factor``; shared experts always run."""

    model_type = "hy_v3"
    intermediate_field = "moe_intermediate_size"
    logits_in_float32 = True

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="sigmoid", bias=True, normalize=True,
                          scale=float(config.router_scaling_factor))

    def layer_bias(self, layer: nn.Module) -> torch.Tensor | None:
        """The MoE block's ``e_score_correction_bias`` (the block passes it to the gate)."""
        bias = getattr(getattr(layer, "mlp", None), "e_score_correction_bias", None)
        return bias if isinstance(bias, torch.Tensor) else None


class ExaoneMoeAdapter(DeepseekV32Adapter):
    """EXAONE-MoE: DeepSeek-V3's router (float32 sigmoid + correction bias, groups,
    optional renormalisation, scaled) on the layers ``mlp_layer_types`` marks
    ``sparse``; shared experts; sliding-window and full attention layers."""

    model_type = "exaone_moe"
    expert_count_field = "num_experts"


class JambaAdapter(FamilyAdapter):
    """Jamba: layers with ``layers_num_experts > 1`` have a sparse ``feed_forward`` whose
    ``router`` is a bare ``nn.Linear`` (its output is the logits); the block's own
    ``route_tokens_to_experts`` takes the float32 softmax's top-k, raw weights cast to
    the hidden dtype. Exact routing therefore replaces that block method, not the
    router; mamba and attention layers both start with ``input_layernorm``."""

    model_type = "jamba"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(i for i, count in enumerate(config.layers_num_experts) if count > 1)

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=False)

    def find_router(self, layer: nn.Module) -> nn.Module | None:
        """The sparse block's ``router`` Linear (a dense layer's MLP has no experts)."""
        block = getattr(layer, "feed_forward", None)
        router = getattr(block, "router", None)
        return router if isinstance(router, nn.Module) and hasattr(block, "experts") else None

    def executed_ids_module(self, layer: nn.Module) -> nn.Module | None:
        """The block's experts, called with the ids the block selected."""
        experts = getattr(getattr(layer, "feed_forward", None), "experts", None)
        return experts if isinstance(experts, nn.Module) else None

    def install_exact_gate(self, layer: nn.Module, gate: nn.Module, forward: Any,
                           geometry: Any) -> None:
        """Replace the block's ``route_tokens_to_experts`` with the declared rule."""
        from hebrus_flywheel.replay.routing import topk_with_tie_break

        def route(hidden_states: torch.Tensor, router_logits: torch.Tensor) -> tuple[
                torch.Tensor, torch.Tensor]:
            ids_NK, weights_NK = topk_with_tie_break(router_logits, geometry.top_k,
                                                     weight_rule=geometry.weight_rule)
            return ids_NK, weights_NK.to(hidden_states.dtype)

        cast(Any, layer).feed_forward.route_tokens_to_experts = route


EXTRA_ADAPTERS: tuple[FamilyAdapter, ...] = (
    GptOssAdapter(), GraniteMoeAdapter(), GraniteMoeSharedAdapter(), MiniMaxAdapter(),
    PhimoeAdapter(), Llama4TextAdapter(), Dots1Adapter(), Ernie45MoeAdapter(),
    Qwen35MoeTextAdapter(), FlexOlmoAdapter(), DeepseekV32Adapter(), Glm4MoeLiteAdapter(),
    Lfm2MoeAdapter(), HYV3Adapter(), ExaoneMoeAdapter(), JambaAdapter(),
)
