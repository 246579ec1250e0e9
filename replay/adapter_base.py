"""The base route adapter: where a family's routers sit and how their calls read and write.

Split from :mod:`replay.adapters` so that family adapters can live in several modules
(:mod:`replay.adapters`, :mod:`replay.adapters_extra`) registered in one ``ADAPTERS``
dict without an import cycle.

Families differ in more than the rule: the router may be ``layer.mlp.gate`` or
``layer.mlp.router`` or ``layer.block_sparse_moe.router``; it may return
``(logits, weights, ids)`` or ``(ids, weights, logits)``; its logits may carry a
per-expert bias added inside the linear (GPT-OSS), be computed in float32 (DeepSeek) or
upcast after the linear (Granite-MoE). The class attributes and the small methods
below name those differences, so route capture and the exact-routing gate replacement
read and return exactly what the family's own gate does. :class:`DeepseekV3Adapter`
lives here too because its router shape recurs in families of both adapter modules.

Tensor legend: N rows (batch x time), E experts, K top-k, H hidden.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.replay.exceptions import UnsupportedModelError
from hebrus_flywheel.replay.routing import RouterRule

ROUTER_OUTPUT = ("logits", "weights", "ids")


def sparse_mlp_layers(config: Any) -> tuple[int, ...]:
    """The layers a config's ``mlp_layer_types`` marks ``sparse`` (the routed ones)."""
    return tuple(i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse")


class FamilyAdapter:
    """Base adapter: decoder layers at ``model.model.layers``, gates at ``layer.mlp.gate``.

    A family's router rule (:class:`~replay.routing.RouterRule`) names how the gate ranks
    experts and weighs them; ``logits_in_float32`` says the gate computes its logits in
    float32 whatever the model dtype (DeepSeek-style routers); ``logits_upcast`` says it
    computes them in the model dtype and then casts them to float32 (Granite-MoE);
    ``weights_in_logit_dtype`` says it casts its top-k weights back to the logits' dtype
    (Mixtral keeps float32), ``weights_in_hidden_dtype`` to the hidden states' dtype;
    ``router_path`` is the attribute path from a decoder layer to its router,
    ``router_output`` the order of what the router returns and ``logit_bias`` that its
    linear has an ``[E]`` bias (part of the logits, unlike a selection-only bias).
    """

    model_type: ClassVar[str] = ""
    expert_count_field: ClassVar[str] = "num_experts"
    intermediate_field: ClassVar[str] = "intermediate_size"
    top_k_field: ClassVar[str] = "num_experts_per_tok"
    weights_in_logit_dtype: ClassVar[bool] = True
    weights_in_hidden_dtype: ClassVar[bool] = False
    logits_in_float32: ClassVar[bool] = False
    logits_upcast: ClassVar[bool] = False
    logit_bias: ClassVar[bool] = False
    router_path: ClassVar[tuple[str, ...]] = ("mlp", "gate")
    pre_attention_norm_path: ClassVar[tuple[str, ...]] = ("input_layernorm",)
    """Attribute path from a decoder layer to the norm its attention reads (whose input
    is the captured pre-attention feature)."""
    router_output: ClassVar[tuple[str, ...]] = ROUTER_OUTPUT

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(range(config.num_hidden_layers))

    def rule(self, config: Any) -> RouterRule:
        normalize = bool(getattr(config, "norm_topk_prob", False))
        return RouterRule(scoring="softmax", normalize=normalize)

    def weight_rule(self, config: Any) -> str:
        return self.rule(config).name

    def geometry(self, config: Any) -> RouteGeometry:
        return RouteGeometry(
            family=self.model_type,
            layer_count=int(config.num_hidden_layers),
            routed_layers=self.routed_layers(config),
            expert_count=int(getattr(config, self.expert_count_field)),
            top_k=int(getattr(config, self.top_k_field)),
            weight_rule=self.weight_rule(config),
            hidden_size=int(config.hidden_size),
            routed_intermediate_size=int(getattr(config, self.intermediate_field)),
        )

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        inner = getattr(model, "model", model)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise UnsupportedModelError(
                f"{type(model).__name__} has no model.layers ModuleList; the {self.model_type} "
                "adapter expects a transformers *ForCausalLM checkpoint"
            )
        return layers

    def find_router(self, layer: nn.Module) -> nn.Module | None:
        """The module at :attr:`router_path` if it is a router (not a dense Linear)."""
        found: Any = layer
        for name in self.router_path:
            found = getattr(found, name, None)
        # a plain Linear/Identity there is a dense layer's projection; a router may still
        # subclass nn.Linear (PhiMoE), so the type is compared exactly
        if not isinstance(found, nn.Module) or type(found) in (nn.Linear, nn.Identity):
            return None
        return found

    def router(self, layer: nn.Module) -> nn.Module:
        gate = self.find_router(layer)
        if gate is None:
            raise UnsupportedModelError(
                f"a routed {self.model_type} layer has no {'.'.join(self.router_path)} router; "
                "the checkpoint does not match its config (its dense-layer settings)"
            )
        return gate

    def score_bias(self, gate: nn.Module) -> torch.Tensor | None:
        """The gate's selection-correction bias ``[E]`` (bias-corrected rules), else None."""
        bias = getattr(gate, "e_score_correction_bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def expert_scale(self, gate: nn.Module) -> torch.Tensor | None:
        """The gate's learned per-expert weight scale ``[E]`` (``_pes`` rules), else None."""
        return None

    def layer_bias(self, layer: nn.Module) -> torch.Tensor | None:
        """The routed layer's selection-correction bias ``[E]`` (its gate's by default)."""
        return self.score_bias(self.router(layer))

    def pre_attention_norm(self, layer: nn.Module) -> nn.Module:
        norm: Any = layer
        for name in self.pre_attention_norm_path:
            norm = getattr(norm, name, None)
        if not isinstance(norm, nn.Module):
            raise UnsupportedModelError(f"a {self.model_type} layer has no "
                                        f"{'.'.join(self.pre_attention_norm_path)}")
        return norm

    def new_cache(self, model: nn.Module) -> Any:
        """An empty KV cache of the kind the family's forward accepts (decode, drafting)."""
        from transformers import DynamicCache

        return DynamicCache(config=cast(Any, model).config)

    def router_weight(self, gate: nn.Module) -> Any:
        """The router's ``[E, H]`` logit weight, None if it has none (a router may wrap its
        Linear, e.g. AFMoE's; LongCat's keeps a bare parameter); ``teacher init --family``
        redraws it."""
        return getattr(gate, "weight", None)

    def redraw_router(self, gate: nn.Module, std: float) -> None:
        """Redraw the router's logit weight (``teacher init --family``)."""
        cast(torch.Tensor, self.router_weight(gate)).normal_(0.0, std)

    def shape_tiny_model(self, model: nn.Module) -> None:
        """Family-specific init of a tiny random checkpoint beyond its routers
        (``teacher init --family``); nothing by default."""

    def draw_score_bias(self, bias: torch.Tensor, mean: float, std: float) -> None:
        """Redraw a correction bias (``teacher init --family``)."""
        bias.normal_(mean, std)

    def router_logit_bias(self, gate: nn.Module) -> torch.Tensor | None:
        """The router's ``[E]`` logit bias (added inside its linear, so part of the logits,
        unlike :meth:`score_bias`), None if its linear has none."""
        return cast(torch.Tensor, gate.bias) if self.logit_bias else None

    def gate_logits(self, gate: nn.Module, hidden_NH: torch.Tensor) -> torch.Tensor:
        """The router logits ``[N, E]`` exactly as the family's gate computes them."""
        weight = cast(torch.Tensor, self.router_weight(gate))
        bias = self.router_logit_bias(gate)
        if self.logits_in_float32:
            hidden_NH, weight = hidden_NH.to(torch.float32), weight.to(torch.float32)
            bias = None if bias is None else bias.to(torch.float32)
        logits_NE = F.linear(hidden_NH, weight, bias)
        return logits_NE.float() if self.logits_upcast else logits_NE

    def gate_weights(self, weights_NK: torch.Tensor, logits_NE: torch.Tensor,
                     hidden_NH: torch.Tensor) -> torch.Tensor:
        """The top-k weights cast as the family's gate returns them."""
        if self.weights_in_hidden_dtype:
            return weights_NK.to(hidden_NH.dtype)
        if self.weights_in_logit_dtype:
            return weights_NK.to(logits_NE.dtype)
        return weights_NK

    def pack_router_output(self, logits: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(logits, weights, ids)`` in the order the family's router returns them."""
        named = {"logits": logits, "weights": weights, "ids": ids}
        return tuple(named[name] for name in self.router_output)

    def router_call_output(self, gate: nn.Module, args: Any, output: Any) -> Any:
        """What a router call returned, as :meth:`split_router_output` reads it; a forward
        hook hands the call's ``args`` too (LongCat's router returns no logits, so its
        adapter recomputes them from the input)."""
        return output

    def split_router_output(self, output: Any, top_k: int) -> tuple[torch.Tensor, Any, Any]:
        """``(logits, weights or None, ids or None)`` from what the router returned."""
        if not isinstance(output, tuple):
            return output, None, None
        named = dict(zip(self.router_output, output, strict=False))
        return named["logits"], named.get("weights"), named.get("ids")

    def executed_ids_module(self, layer: nn.Module) -> nn.Module | None:
        """A module called as ``(hidden, ids, weights)`` whose ids are the executed ones,
        where the router does not return them (None: the router does)."""
        return None

    def executed_ids(self, module: nn.Module, args: Any) -> torch.Tensor:
        """The ids in a call of :meth:`executed_ids_module` (its second argument)."""
        return cast(torch.Tensor, args[1])

    def install_exact_gate(self, layer: nn.Module, gate: nn.Module, forward: Any,
                           geometry: RouteGeometry) -> None:
        """Make ``gate`` run ``forward`` (the exact-routing gate) in place of its own."""
        gate.forward = forward

    def check_gate(self, gate: nn.Module, geometry: RouteGeometry) -> str | None:
        """Why ``gate`` cannot be replaced by the exact-routing forward, or None."""
        weight = self.router_weight(gate)
        bias = getattr(gate, "bias", None)
        if not isinstance(weight, torch.Tensor) or \
                tuple(weight.shape) != (geometry.expert_count, geometry.hidden_size):
            return "has no [E, H] weight"
        if self.logit_bias:
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (geometry.expert_count,):
                return "has no [E] logit bias"
        elif bias is not None:
            return "has a bias the adapter does not model"
        return None


class DeepseekV3Adapter(FamilyAdapter):
    """DeepSeek-V3: the first ``first_k_dense_replace`` layers dense; a sigmoid router whose
    selection adds ``e_score_correction_bias`` inside the ``topk_group`` best of ``n_group``
    groups (each scored by its two best); weights are the sigmoid scores, renormalised if
    ``norm_topk_prob``, times ``routed_scaling_factor``; shared experts always run."""

    model_type = "deepseek_v3"
    expert_count_field = "n_routed_experts"
    intermediate_field = "moe_intermediate_size"
    logits_in_float32 = True

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(range(int(config.first_k_dense_replace), int(config.num_hidden_layers)))

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(
            scoring="sigmoid", bias=True, normalize=bool(config.norm_topk_prob),
            scale=float(config.routed_scaling_factor), groups=int(config.n_group or 1),
            topk_groups=int(config.topk_group or 1), group_score="top2sum",
        )


class Qwen3MoeAdapter(FamilyAdapter):
    """Qwen3-MoE: sparse unless in ``mlp_only_layers`` or off the ``decoder_sparse_step``."""

    model_type = "qwen3_moe"
    intermediate_field = "moe_intermediate_size"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        dense = set(config.mlp_only_layers or [])
        step = int(config.decoder_sparse_step)
        if int(config.num_experts) <= 0:
            return ()
        return tuple(
            i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0
        )
