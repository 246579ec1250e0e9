"""Route adapters of further MoE families of the installed transformers (issue 16, part 3).

Same contract as :mod:`replay.adapters_hybrid`: each class names where its family's router
sits, what it returns and in which order, and the rule it executes, read from the
family's ``modeling_*.py``; :mod:`replay.adapters` registers ``C_ADAPTERS``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.replay.adapter_base import (
    DeepseekV3Adapter,
    FamilyAdapter,
    sparse_mlp_layers,
)
from hebrus_flywheel.replay.composites import COMPOSITE_TEXT_TEACHERS
from hebrus_flywheel.replay.exceptions import UnsupportedModelError
from hebrus_flywheel.replay.routing import (
    RouterRule,
    router_logit_width,
    sink_softmax,
    topk_with_tie_break,
)


class DbrxAdapter(FamilyAdapter):
    """DBRX: every block routed; ``ffn.router`` (a module holding the ``layer`` Linear)
    returns the model-dtype logits only, and the block's ``route_tokens_to_experts``
    takes the softmax (logit dtype), its top-k, and divides the top-k weights by their
    ``moe_normalize_expert_weights``-norm (1: the sum, i.e. renormalised; None: raw).
    Geometry lives in ``ffn_config``; blocks at ``transformer.blocks``, each starting
    with ``norm_attn_norm.norm_1``. Exact routing replaces the block method."""

    model_type = "dbrx"
    router_path = ("ffn", "router")
    pre_attention_norm_path = ("norm_attn_norm", "norm_1")

    def geometry(self, config: Any) -> RouteGeometry:
        ffn = config.ffn_config
        return RouteGeometry(
            family=self.model_type, layer_count=int(config.n_layers),
            routed_layers=self.routed_layers(config), expert_count=int(ffn.moe_num_experts),
            top_k=int(ffn.moe_top_k), weight_rule=self.weight_rule(config),
            hidden_size=int(config.d_model), routed_intermediate_size=int(ffn.ffn_hidden_size),
        )

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return tuple(range(int(config.n_layers)))

    def rule(self, config: Any) -> RouterRule:
        norm = config.ffn_config.moe_normalize_expert_weights
        if norm is not None and float(norm) != 1.0:
            raise UnsupportedModelError(
                f"dbrx moe_normalize_expert_weights {norm!r} (a p-norm other than 1) has no "
                "route rule; supported are 1.0 (renormalised) and None (raw softmax)")
        return RouterRule(scoring="softmax", normalize=norm is not None)

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        blocks = getattr(getattr(model, "transformer", model), "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise UnsupportedModelError(
                f"{type(model).__name__} has no transformer.blocks ModuleList; the dbrx "
                "adapter expects a DbrxForCausalLM checkpoint")
        return blocks

    def router_weight(self, gate: nn.Module) -> torch.Tensor:
        return cast(torch.Tensor, cast(Any, gate).layer.weight)

    def gate_logits(self, gate: nn.Module, hidden_NH: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_NH, self.router_weight(gate))

    def check_gate(self, gate: nn.Module, geometry: RouteGeometry) -> str | None:
        layer = getattr(gate, "layer", None)
        if type(layer) is not nn.Linear or layer.bias is not None:
            return "has no bias-free layer Linear"
        return super().check_gate(gate, geometry)  # router_weight reads gate.layer

    def executed_ids_module(self, layer: nn.Module) -> nn.Module | None:
        """The block's experts, called with the ids the block selected."""
        experts = getattr(getattr(layer, "ffn", None), "experts", None)
        return experts if isinstance(experts, nn.Module) else None

    def install_exact_gate(self, layer: nn.Module, gate: nn.Module, forward: Any,
                           geometry: RouteGeometry) -> None:
        """Replace the block's ``route_tokens_to_experts``: the same softmax and p-norm
        division, the declared tie-break for the top-k."""
        ffn = cast(Any, layer).ffn

        def route(router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            probs = F.softmax(router_logits, dim=1, dtype=router_logits.dtype)
            ids_NK, _ = topk_with_tie_break(router_logits, geometry.top_k,
                                            weight_rule=geometry.weight_rule)
            top = probs.gather(-1, ids_NK)
            norm = ffn.moe_normalize_expert_weights
            if norm is not None:
                top = top / torch.norm(top, p=norm, dim=-1, keepdim=True)
            return top, ids_NK

        ffn.route_tokens_to_experts = route


class HunYuanMoEV1Adapter(FamilyAdapter):
    """Hunyuan-A13B (HunYuan-MoE-V1): every layer routed by ``mlp.gate``, whose ``wg``
    Linear is kept in float32 (the input is upcast when it is: float32 logits; else
    logits in the weight's dtype); float32 softmax, top-``moe_topk``, renormalised by
    the sum, cast to the logits' dtype; a dense shared MLP always runs. Per-layer
    ``num_experts``/``moe_topk`` lists are accepted only when every layer agrees."""

    model_type = "hunyuan_v1_moe"

    @staticmethod
    def _one(config: Any, name: str) -> int:
        value = getattr(config, name)
        values = set(value) if isinstance(value, (list, tuple)) else {value}
        if len(values) != 1:
            raise UnsupportedModelError(
                f"hunyuan_v1_moe {name} differs per layer ({value!r}); a route geometry has "
                "one expert count and one top-k")
        return int(values.pop())

    def geometry(self, config: Any) -> RouteGeometry:
        return RouteGeometry(
            family=self.model_type, layer_count=int(config.num_hidden_layers),
            routed_layers=self.routed_layers(config),
            expert_count=self._one(config, "num_experts"), top_k=self._one(config, "moe_topk"),
            weight_rule=self.weight_rule(config), hidden_size=int(config.hidden_size),
            routed_intermediate_size=int(config.intermediate_size),
        )

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True)

    def router_weight(self, gate: nn.Module) -> torch.Tensor:
        return cast(torch.Tensor, cast(Any, gate).wg.weight)

    def gate_logits(self, gate: nn.Module, hidden_NH: torch.Tensor) -> torch.Tensor:
        weight = self.router_weight(gate)
        if weight.dtype == torch.float32:
            hidden_NH = hidden_NH.float()
        return F.linear(hidden_NH, weight)

    def check_gate(self, gate: nn.Module, geometry: RouteGeometry) -> str | None:
        wg = getattr(gate, "wg", None)
        if type(wg) is not nn.Linear or wg.bias is not None:
            return "has no bias-free wg Linear"
        return super().check_gate(gate, geometry)  # router_weight reads gate.wg


class Mistral4Adapter(DeepseekV3Adapter):
    """Mistral 4: DeepSeek-V3's layout (the first ``first_k_dense_replace`` layers dense,
    shared experts beside the routed ones, multi-head latent attention) with a softmax
    router: ``mlp.gate``'s weight in the model dtype, softmax over all experts, groups
    scored by their two best probabilities, top-k of the kept groups' experts (the gate
    scores dropped ones 0.0, below every kept probability, which is positive: the masked
    rule's ranking), the probabilities renormalised if ``norm_topk_prob`` and times
    ``routed_scaling_factor``, in the logits' dtype."""

    model_type = "mistral4"
    logits_in_float32 = False

    def rule(self, config: Any) -> RouterRule:
        groups = int(config.n_group or 1)
        return RouterRule(
            scoring="softmax", normalize=bool(config.norm_topk_prob),
            scale=float(config.routed_scaling_factor), groups=groups,
            topk_groups=int(config.topk_group or 1), group_score="top2sum",
        )


class Gemma4TextAdapter(FamilyAdapter):
    """Gemma 4 (``enable_moe_block``): every layer runs a dense MLP and, beside it, routed
    experts chosen by ``layer.router`` from the residual stream entering the MLP block:
    RMS-normalised without a gain, times a learned ``scale`` and ``hidden_size**-0.5``,
    projected to logits; float32 softmax, top-``top_k_experts``, renormalised, then each
    weight times its expert's learned ``per_expert_scale`` (rule suffix ``_pes``). The
    router returns ``(probabilities, weights, ids)``; capture recomputes the logits from
    its input. Without ``enable_moe_block`` the model is dense and refused."""

    model_type = "gemma4_text"
    router_path = ("router",)
    top_k_field = "top_k_experts"
    intermediate_field = "moe_intermediate_size"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        if not getattr(config, "enable_moe_block", False):
            raise UnsupportedModelError(
                "this gemma4_text checkpoint has enable_moe_block off: it is dense, there is "
                "no route to record")
        return tuple(range(int(config.num_hidden_layers)))

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True, expert_scale=True)

    def router_weight(self, gate: nn.Module) -> torch.Tensor:
        return cast(torch.Tensor, cast(Any, gate).proj.weight)

    def expert_scale(self, gate: nn.Module) -> torch.Tensor | None:
        scale = getattr(gate, "per_expert_scale", None)
        return scale if isinstance(scale, torch.Tensor) else None

    def redraw_router(self, gate: nn.Module, std: float) -> None:
        """``proj`` at ``std`` times ``sqrt(hidden)`` (the router divides its input by
        that) and the per-expert scales uniform in [0.5, 2), so that they matter."""
        router: Any = gate
        router.proj.weight.normal_(0.0, std * router.hidden_size ** 0.5)
        router.per_expert_scale.uniform_(0.5, 2.0)

    def shape_tiny_model(self, model: nn.Module) -> None:
        """Gemma 4 scales q.k by 1 on RMS-normed q and k, so at unit norm gains a random
        model's attention logits have std ``sqrt(head_dim)``, far sharper than any other
        family's random init: decode's and prefill's float32 rounding then differ ~10x
        more and flip near-tied routes (1 of 2,928 in a selftest). The tiny model gets
        q and k gains of ``head_dim ** -0.25``: the usual ``1/sqrt(head_dim)`` attention
        temperature, which trained gains set for a real checkpoint."""
        for layer in self.decoder_layers(model):
            attention: Any = cast(Any, layer).self_attn
            gain = attention.head_dim ** -0.25
            attention.q_norm.weight.fill_(gain)
            attention.k_norm.weight.fill_(gain)

    def gate_logits(self, gate: nn.Module, hidden_NH: torch.Tensor) -> torch.Tensor:
        router: Any = gate
        normed = router.norm(hidden_NH) * router.scale * router.scalar_root_size
        return F.linear(normed, self.router_weight(gate))

    def router_call_output(self, gate: nn.Module, args: Any, output: Any) -> Any:
        """The logits in place of the probabilities the router returns first."""
        return (self.gate_logits(gate, args[0]), *output[1:])

    def check_gate(self, gate: nn.Module, geometry: RouteGeometry) -> str | None:
        proj, scale = getattr(gate, "proj", None), self.expert_scale(gate)
        if type(proj) is not nn.Linear or proj.bias is not None:
            return "has no bias-free proj Linear"
        if scale is None or tuple(scale.shape) != (geometry.expert_count,):
            return "has no [E] per_expert_scale"
        return super().check_gate(gate, geometry)  # router_weight reads gate.proj

    def install_exact_gate(self, layer: nn.Module, gate: nn.Module, forward: Any,
                           geometry: RouteGeometry) -> None:
        """Gemma 4's router with the declared tie-break: it returns the float32
        probabilities first, as the native router does."""
        def route(hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
            logits_NE = self.gate_logits(gate, hidden_states)
            ids_NK, weights_NK = topk_with_tie_break(
                logits_NE, geometry.top_k, weight_rule=geometry.weight_rule,
                expert_scale_TE=self.expert_scale(gate))
            return F.softmax(logits_NE, dim=-1, dtype=torch.float32), weights_NK, ids_NK

        gate.forward = route


class InklingTextAdapter(FamilyAdapter):
    """Inkling: the ``sparse`` layers of ``mlp_layer_types`` routed by ``mlp.gate``, one
    Linear to ``n_routed_experts + n_shared_experts`` logits. It selects the top-k of
    ``sigmoid(routed logits) + e_score_correction_bias`` and weighs the chosen experts,
    together with the shared ones, by a softmax of their log-sigmoids, times
    ``route_scale`` and a learned ``global_scale``; the shared experts run on their own
    weights (gammas). The route's logits are all the gate's (rule suffix ``_sink<S>``:
    the last S are the shared experts', never selected); ``global_scale`` is the rule's
    learned per-expert scale (``_pes``), the same for every expert of a layer."""

    model_type = "inkling_text"
    expert_count_field = "n_routed_experts"
    intermediate_field = "moe_intermediate_size"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="sigmoid", bias=True, normalize=True,
                          scale=float(config.route_scale),
                          shared_sinks=int(config.n_shared_experts), expert_scale=True)

    def router_weight(self, gate: nn.Module) -> torch.Tensor:
        """The routed experts' rows of the gate (the native-gate control ranks them)."""
        router: Any = gate
        return cast(torch.Tensor, router.weight[: router.num_experts])

    def redraw_router(self, gate: nn.Module, std: float) -> None:
        """Every row, shared ones included, and a global scale that is not 1."""
        router: Any = gate
        router.weight.normal_(0.0, std)
        router.global_scale.fill_(0.75)

    def expert_scale(self, gate: nn.Module) -> torch.Tensor | None:
        router: Any = gate
        scale = getattr(router, "global_scale", None)
        return scale.expand(router.num_experts) if isinstance(scale, torch.Tensor) else None

    def gate_logits(self, gate: nn.Module, hidden_NH: torch.Tensor) -> torch.Tensor:
        """Routed then shared experts' logits ``[N, E + S]``."""
        router: Any = gate
        return F.linear(hidden_NH.reshape(-1, router.hidden_dim), router.weight)

    def router_call_output(self, gate: nn.Module, args: Any, output: Any) -> Any:
        """The routed and shared logits (the gate returns the routed ones only)."""
        return (self.gate_logits(gate, args[0]), output[1], output[2])

    def check_gate(self, gate: nn.Module, geometry: RouteGeometry) -> str | None:
        router: Any = gate
        weight = getattr(router, "weight", None)
        width = router_logit_width(geometry.expert_count, geometry.weight_rule)
        if not isinstance(weight, torch.Tensor) or \
                tuple(weight.shape) != (width, geometry.hidden_size):
            return "has no [E + shared, H] weight"
        if self.expert_scale(gate) is None or self.score_bias(gate) is None:
            return "has no global_scale and e_score_correction_bias"
        return None

    def install_exact_gate(self, layer: nn.Module, gate: nn.Module, forward: Any,
                           geometry: RouteGeometry) -> None:
        """Inkling's gate with the declared tie-break; it returns the routed logits, the
        rule's weights, the ids and the shared experts' gammas, as the native gate."""
        router: Any = gate
        experts, k = geometry.expert_count, geometry.top_k

        def route(hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
            logits_NX = self.gate_logits(gate, hidden_states)
            ids_NK, _ = topk_with_tie_break(
                logits_NX, k, weight_rule=geometry.weight_rule,
                bias_TE=router.e_score_correction_bias, expert_scale_TE=self.expert_scale(gate))
            weights_NX = sink_softmax(logits_NX, ids_NK, logits_NX.shape[-1] - experts)
            weights_NX = weights_NX * router.route_scale * router.global_scale
            return (logits_NX[:, :experts], weights_NX[:, :k].contiguous(), ids_NK,
                    weights_NX[:, k:].contiguous())

        gate.forward = route


SKIP_ROW_GAIN = 10.0
"""How much wider a tiny ZAYA's skip-class router row is drawn (some tokens skip)."""


class ZayaAdapter(FamilyAdapter):
    """ZAYA1: every layer routed by ``mlp.gate``, an MLP router over ``num_experts + 1``
    classes whose last is a skip class that runs no expert. The gate projects the
    hidden state down, adds the previous layer's router state (scaled; not in layer 0),
    runs its MLP to logits in the model dtype, ranks ``softmax(logits)`` in float32 plus
    the ``balancing_biases`` buffer (the skip class starts at -1), keeps the top-k
    (transformers allows k = 1 only) and weighs each by its raw probability, the skip
    class by 0. It returns ``(logits, weights, ids, router state)`` with a chosen skip
    written as expert 0 at weight 0, for the experts' one-hot; the route records it as
    the skip class (id ``num_experts``, :attr:`RouteGeometry.skip_expert`). Its router
    has no ``[E, H]`` matrix, so there is no native-gate control on early features."""

    model_type = "zaya"
    intermediate_field = "moe_intermediate_size"

    def geometry(self, config: Any) -> RouteGeometry:
        return RouteGeometry(
            family=self.model_type, layer_count=int(config.num_hidden_layers),
            routed_layers=self.routed_layers(config),
            expert_count=int(config.num_experts) + 1, top_k=int(config.num_experts_per_tok),
            weight_rule=self.weight_rule(config), hidden_size=int(config.hidden_size),
            routed_intermediate_size=int(config.moe_intermediate_size),
        )

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", bias=True, normalize=False, skip_last=True)

    def score_bias(self, gate: nn.Module) -> torch.Tensor | None:
        bias = getattr(gate, "balancing_biases", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def router_weight(self, gate: nn.Module) -> Any:
        return None  # an MLP over a state carried across layers, not one [E, H] matrix

    def redraw_router(self, gate: nn.Module, std: float) -> None:
        """The router MLP's hidden linears at unit gain and its output projection at
        ``std`` per unit of the hidden width (``std`` assumes a ``hidden_size`` input):
        at the default init its logits spread by ~0.005 and the bias alone routes. The
        skip class's row is :data:`SKIP_ROW_GAIN` times wider: transformers resets the
        skip class's balancing bias to -1 whenever it loads a ZAYA checkpoint, so only a
        skip probability near 1 (beating every expert's probability plus its bias, with
        the tiny preset's biases near -0.1) selects it, as a trained router learns to."""
        mlp = cast(Any, gate).router_mlp
        width, hidden = mlp.out_proj.weight.shape[1], cast(Any, gate).down_proj.in_features
        for linear in (mlp.fc1, mlp.fc2):
            linear.weight.normal_(0.0, linear.weight.shape[1] ** -0.5)
        mlp.out_proj.weight.normal_(0.0, std * (hidden / width) ** 0.5)
        mlp.out_proj.weight[-1].mul_(SKIP_ROW_GAIN)

    def draw_score_bias(self, bias: torch.Tensor, mean: float, std: float) -> None:
        """The experts' biases drawn, the skip class's -1 (what loading sets anyway)."""
        bias.normal_(mean, std)
        bias[-1] = -1.0

    def split_router_output(self, output: Any, top_k: int) -> tuple[torch.Tensor, Any, Any]:
        """The executed ids with a chosen skip class restored from the gate's
        ``(expert 0, weight 0)`` stand-in (a softmax probability is never exactly 0)."""
        logits, weights, ids = output[0], output[1], output[2]
        skip = (ids == 0) & (weights == 0)
        return logits, weights, ids.masked_fill(skip, logits.shape[-1] - 1)

    def check_gate(self, gate: nn.Module, geometry: RouteGeometry) -> str | None:
        parts = [getattr(gate, name, None) for name in ("down_proj", "router_mlp")]
        if not all(isinstance(p, nn.Module) for p in parts):
            return "has no down_proj and router_mlp"
        bias = self.score_bias(gate)
        if bias is None or tuple(bias.shape) != (geometry.expert_count,):
            return "has no [E + 1] balancing_biases"
        return None

    def install_exact_gate(self, layer: nn.Module, gate: nn.Module, forward: Any,
                           geometry: RouteGeometry) -> None:
        """ZAYA's gate with the declared tie-break for its top-k."""
        zaya: Any = gate
        skip = geometry.expert_count - 1

        def route(hidden_states: torch.Tensor, router_states: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, ...]:
            tokens = hidden_states.shape[1]
            state = zaya.down_proj(hidden_states)
            if zaya.use_eda and router_states is not None:
                state = state + router_states * zaya.router_states_scale
            logits_NE = zaya.router_mlp(state).reshape(-1, geometry.expert_count)
            ids_NK, weights_NK = topk_with_tie_break(
                logits_NE, geometry.top_k, weight_rule=geometry.weight_rule,
                bias_TE=zaya.balancing_biases)
            chosen_skip = ids_NK == skip
            weights_NK = weights_NK.to(logits_NE.dtype).masked_fill(chosen_skip, 0)
            return (logits_NE, weights_NK, ids_NK.masked_fill(chosen_skip, 0),
                    state[:, -tokens:].clone())

        gate.forward = route


COMPOSITE_TEXT_FAMILIES: dict[str, str] = {
    "llama4": "llama4_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen4_exp": "qwen4_exp_text",
    **COMPOSITE_TEXT_TEACHERS,
}
"""Composite (vision-language) ``model_type``s whose ``AutoModelForCausalLM`` class is the
text family's causal LM: transformers builds it from ``config.get_text_config()`` and
loads the language model's weights (vision weights unused), so a real checkpoint's
``config.json`` of that type routes exactly as the text family (:func:`text_config`);
and those without one, whose own class's language model is the teacher
(:mod:`replay.composites`)."""


def text_config(config: Any) -> Any:
    """The config the causal LM is built from: a composite config's text config."""
    if getattr(config, "model_type", None) in COMPOSITE_TEXT_FAMILIES:
        return config.get_text_config()
    return config


C_ADAPTERS: tuple[FamilyAdapter, ...] = (DbrxAdapter(), HunYuanMoEV1Adapter(),
                                         Mistral4Adapter(), ZayaAdapter(), Gemma4TextAdapter(),
                                         InklingTextAdapter())
