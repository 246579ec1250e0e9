"""Model-family route adapters: where the routers are and how their decisions are read.

An adapter knows, for one transformers ``model_type``: which decoder layers are routed
(sparse MoE), the expert count, top-k, the weight rule, the per-expert intermediate
width, and where each routed layer's gate (router) and input layernorm live.

Reading routes needs no model surgery. :class:`RouteCapture` registers forward hooks on
the routed layers' gate modules (``layer.mlp.gate``) and records the router logits each
gate computes during ONE ordinary forward pass; with ``capture_hidden=True`` it also
registers forward PRE-hooks on each routed layer's ``input_layernorm`` and records its
input, i.e. the residual stream entering the layer (the pre-attention hidden state, the
route sidecar's feature). The gate of layer l reads ``post_attention_layernorm`` of the
stream after attention, not this pre-attention state; applying it to the pre-attention
state is the "earlier representation" baseline of the design note.

Why hooks and not ``output_router_logits=True``: in transformers 5.x that flag returns a
tuple with one ``[B*T, E]`` logits tensor per *router module call* (only sparse layers,
batch and time flattened), recorded by the same kind of hook; it also makes
``*ForCausalLM`` compute the load-balancing loss, and it cannot hand back the
pre-attention states in the same pass. Hooks give both with one forward and also see the
indices the model actually executed (the gate's third output).

Executing the rule: :func:`install_exact_routing` (used by ``load_teacher`` by default)
replaces each routed gate's forward with the same logits and weights but the identity's
tie-break rule instead of ``torch.topk``, so the experts executed on an exact score tie
are the ones recorded. Outputs are bitwise identical to the native gate otherwise.

Tensor legend: B batch, T tokens, L routed layers, E experts, K top-k, H hidden.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.replay.adapter_base import (
    DeepseekV3Adapter,
    FamilyAdapter,
    Qwen3MoeAdapter,
    sparse_mlp_layers,
)
from hebrus_flywheel.replay.adapters_c import C_ADAPTERS, COMPOSITE_TEXT_FAMILIES
from hebrus_flywheel.replay.adapters_extra import EXTRA_ADAPTERS
from hebrus_flywheel.replay.adapters_hybrid import HYBRID_ADAPTERS
from hebrus_flywheel.replay.adapters_more import MORE_ADAPTERS
from hebrus_flywheel.replay.adapters_vl import VL_ADAPTERS
from hebrus_flywheel.replay.exceptions import UnsupportedModelError
from hebrus_flywheel.replay.refused import REFUSED_FAMILIES
from hebrus_flywheel.replay.routing import (
    RouterRule,
    parse_rule,
    router_logit_width,
    topk_with_tie_break,
)

__all__ = ["ADAPTERS", "DeepseekV3Adapter", "FamilyAdapter", "RouteCapture", "RouterPass",
           "adapter_for", "capture_routes", "check_dense_layers", "expert_scale_LE",
           "forward_routes", "install_exact_routing", "score_bias_LE"]


class Qwen3NextAdapter(Qwen3MoeAdapter):
    """Qwen3-Next: Qwen3-MoE's sparsity rule, hybrid linear/full attention, shared expert."""

    model_type = "qwen3_next"


class Qwen2MoeAdapter(Qwen3MoeAdapter):
    """Qwen2-MoE: Qwen3-MoE's router and sparsity rule plus a sigmoid-gated shared expert
    (which every token executes, so it is not part of the route)."""

    model_type = "qwen2_moe"


class MixtralAdapter(FamilyAdapter):
    """Mixtral: every layer routed; weights always renormalised over the top-k."""

    model_type = "mixtral"
    expert_count_field = "num_local_experts"
    weights_in_logit_dtype = False

    def rule(self, config: Any) -> RouterRule:
        return RouterRule(scoring="softmax", normalize=True)


class OlmoeAdapter(FamilyAdapter):
    """OLMoE: every layer routed; renormalised only if ``norm_topk_prob`` (default off)."""

    model_type = "olmoe"


class Glm4MoeAdapter(DeepseekV3Adapter):
    """GLM-4-MoE: DeepSeek-V3's router and first-k-dense layout."""

    model_type = "glm4_moe"


class DeepseekV2Adapter(DeepseekV3Adapter):
    """DeepSeek-V2: softmax router, ``greedy`` or ``group_limited_greedy`` (groups scored by
    their best probability), raw weights times ``routed_scaling_factor``."""

    model_type = "deepseek_v2"

    def rule(self, config: Any) -> RouterRule:
        grouped = config.topk_method == "group_limited_greedy"
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(
                f"deepseek_v2 topk_method {config.topk_method!r} has no route rule; supported "
                "are 'greedy' and 'group_limited_greedy'"
            )
        return RouterRule(
            scoring="softmax", normalize=False, scale=float(config.routed_scaling_factor),
            groups=int(config.n_group) if grouped else 1,
            topk_groups=int(config.topk_group) if grouped else 1, group_score="max",
        )


class DeepseekOcr2TextAdapter(DeepseekV2Adapter):
    """DeepSeek-OCR-2's language model (a composite's, :mod:`replay.composites`):
    DeepSeek-V2's router (``mlp.gate``: float32 logits, softmax, ``greedy`` or
    ``group_limited_greedy`` top-k, raw weights x ``routed_scaling_factor``) and shared
    experts, where ``mlp_layer_types`` says ``sparse`` (not ``first_k_dense_replace``)."""

    model_type = "deepseek_ocr2_text"

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return sparse_mlp_layers(config)


ADAPTERS: dict[str, FamilyAdapter] = {
    a.model_type: a
    for a in (Qwen3NextAdapter(), Qwen3MoeAdapter(), Qwen2MoeAdapter(), MixtralAdapter(),
              OlmoeAdapter(), DeepseekV3Adapter(), DeepseekV2Adapter(), Glm4MoeAdapter(),
              DeepseekOcr2TextAdapter(),
              *EXTRA_ADAPTERS, *HYBRID_ADAPTERS, *MORE_ADAPTERS, *C_ADAPTERS,
              *VL_ADAPTERS)
}


def adapter_for(model_type: str) -> FamilyAdapter:
    """The adapter for a ``config.model_type`` (a composite type's text family, see
    :data:`replay.adapters_c.COMPOSITE_TEXT_FAMILIES`); UnsupportedModelError if none."""
    adapter = ADAPTERS.get(COMPOSITE_TEXT_FAMILIES.get(model_type, model_type))
    if model_type in REFUSED_FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} cannot be a teacher: {REFUSED_FAMILIES[model_type]}")
    if adapter is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no route adapter; supported families are "
            f"{sorted(ADAPTERS)} (add a FamilyAdapter in replay/adapters.py)"
        )
    return adapter


def _exact_gate_forward(
    gate: nn.Module, geometry: RouteGeometry, adapter: FamilyAdapter, bias: torch.Tensor | None
) -> Any:
    """The family's gate computation with :mod:`replay.routing`'s top-k in place of topk.

    Same logits (:meth:`FamilyAdapter.gate_logits`: the gate's linear, in float32 where
    the family does so) and same weights as the native gate wherever scores are
    distinct; on exact ties the executed experts follow the declared rule (lower id
    first) instead of ``torch.topk``'s unspecified order. The correction bias is the
    layer's own tensor (:meth:`FamilyAdapter.layer_bias`), so updates to it are seen;
    further arguments (LFM2-MoE passes that same bias) are ignored.
    """

    def forward(hidden_states: torch.Tensor, *_args: Any) -> tuple[torch.Tensor, ...]:
        hidden_NH = hidden_states.reshape(-1, geometry.hidden_size)
        router_logits_NE = adapter.gate_logits(gate, hidden_NH)
        ids_NK, weights_NK = topk_with_tie_break(
            router_logits_NE, geometry.top_k, weight_rule=geometry.weight_rule, bias_TE=bias
        )
        weights_NK = adapter.gate_weights(weights_NK, router_logits_NE, hidden_NH)
        return adapter.pack_router_output(router_logits_NE, weights_NK, ids_NK)

    return forward


def score_bias_LE(
    model: nn.Module, adapter: FamilyAdapter, geometry: RouteGeometry
) -> torch.Tensor | None:
    """Every routed gate's correction bias stacked ``[L, E]`` (None if the rule has none)."""
    if not parse_rule(geometry.weight_rule).bias:
        return None
    layers = adapter.decoder_layers(model)
    rows = []
    for index in geometry.routed_layers:
        bias = adapter.layer_bias(layers[index])
        if bias is None or tuple(bias.shape) != (geometry.expert_count,):
            raise UnsupportedModelError(
                f"layer {index}'s gate has no [E] e_score_correction_bias although the "
                f"{geometry.family} rule {geometry.weight_rule!r} needs one"
            )
        rows.append(bias.detach().to(torch.float32))
    return torch.stack(rows)


def expert_scale_LE(
    model: nn.Module, adapter: FamilyAdapter, geometry: RouteGeometry
) -> torch.Tensor | None:
    """Every routed gate's per-expert weight scale stacked ``[L, E]`` (None unless the
    rule has one, ``_pes``)."""
    if not parse_rule(geometry.weight_rule).expert_scale:
        return None
    layers = adapter.decoder_layers(model)
    rows = []
    for index in geometry.routed_layers:
        scale = adapter.expert_scale(adapter.router(layers[index]))
        if scale is None or tuple(scale.shape) != (geometry.expert_count,):
            raise UnsupportedModelError(
                f"layer {index}'s gate has no [E] per-expert scale although the "
                f"{geometry.family} rule {geometry.weight_rule!r} needs one")
        rows.append(scale.detach().to(torch.float32))
    return torch.stack(rows)


def check_dense_layers(model: nn.Module, adapter: FamilyAdapter, geometry: RouteGeometry) -> None:
    """Fail unless exactly the routed layers have a router (the map slot -> layer is right)."""
    layers = adapter.decoder_layers(model)
    for index, layer in enumerate(layers):
        has_router = adapter.find_router(layer) is not None
        if has_router != (index in geometry.routed_layers):
            raise UnsupportedModelError(
                f"layer {index} of the {geometry.family} checkpoint "
                f"{'has' if has_router else 'lacks'} a router, but the config routes layers "
                f"{list(geometry.routed_layers)}; the checkpoint and its config.json disagree"
            )


def install_exact_routing(
    model: nn.Module, adapter: FamilyAdapter, geometry: RouteGeometry
) -> None:
    """Make every routed gate EXECUTE the identity's tie-break rule (see the gate below).

    ``torch.topk`` leaves the order of equal scores unspecified, so without this the
    experts a model executes on an exact tie may differ from the recorded label. Only
    gates of the transformers 5.x shape (``weight [E, H]``, no bias, returning
    ``(logits, weights, ids)``) are replaced; anything else is refused.
    """
    layers = adapter.decoder_layers(model)
    for index in geometry.routed_layers:
        gate = adapter.router(layers[index])
        why = adapter.check_gate(gate, geometry)
        if why is not None:
            raise UnsupportedModelError(
                f"layer {index}'s gate {type(gate).__name__} {why}; load the teacher with "
                "exact_tie_break=False"
            )
        bias = adapter.layer_bias(layers[index])
        adapter.install_exact_gate(layers[index], gate,
                                   _exact_gate_forward(gate, geometry, adapter, bias), geometry)


class RouteCapture:
    """Records router logits (and optionally pre-attention states) of every routed layer.

    Use :func:`capture_routes`. After each forward, :meth:`router_logits_LNE` and
    :meth:`hidden_LNH` stack what the hooks saw (N = B*T rows in the model's flattening
    order, batch-major); :meth:`clear` empties them before the next forward.
    """

    def __init__(self, geometry: RouteGeometry, adapter: FamilyAdapter) -> None:
        self.geometry = geometry
        self.adapter = adapter
        self._width = router_logit_width(geometry.expert_count, geometry.weight_rule)
        self._logits: dict[int, torch.Tensor] = {}
        self._executed: dict[int, torch.Tensor] = {}
        self._hidden: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self._logits.clear()
        self._executed.clear()
        self._hidden.clear()

    def gate_hook(self, slot: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            logits, _weights, ids = self.adapter.split_router_output(
                self.adapter.router_call_output(module, args, output), self.geometry.top_k)
            self._logits[slot] = logits.detach().reshape(-1, self._width)
            if ids is not None:
                self._executed[slot] = ids.detach().reshape(-1, self.geometry.top_k)

        return hook

    def experts_pre_hook(self, slot: int) -> Any:
        """Records the ids an experts module is called with (``(hidden, ids, weights)``),
        for families whose router returns logits only (Jamba)."""
        def hook(module: nn.Module, args: Any) -> None:
            ids = self.adapter.executed_ids(module, args)
            self._executed[slot] = ids.detach().reshape(-1, self.geometry.top_k)

        return hook

    def norm_pre_hook(self, slot: int) -> Any:
        def hook(_module: nn.Module, args: Any) -> None:
            hidden = args[0]
            self._hidden[slot] = hidden.detach().reshape(-1, hidden.shape[-1])

        return hook

    def _stack(self, seen: dict[int, torch.Tensor], what: str) -> torch.Tensor:
        slots = range(self.geometry.routed_layer_count)
        missing = [self.geometry.routed_layers[s] for s in slots if s not in seen]
        if missing:
            raise UnsupportedModelError(
                f"no {what} was captured for routed layers {missing} during the last forward; "
                "the model did not call those modules (wrong adapter or a custom forward)"
            )
        return torch.stack([seen[s] for s in slots])

    def router_logits_LNE(self) -> torch.Tensor:
        return self._stack(self._logits, "router logits")

    def executed_ids_LNK(self) -> torch.Tensor | None:
        """The expert ids the model itself executed (its ``torch.topk``), if the gate says."""
        if len(self._executed) != self.geometry.routed_layer_count:
            return None
        return self._stack(self._executed, "executed expert ids")

    def hidden_LNH(self) -> torch.Tensor:
        return self._stack(self._hidden, "pre-attention hidden state")


@contextmanager
def capture_routes(
    model: nn.Module, adapter: FamilyAdapter, geometry: RouteGeometry, *,
    capture_hidden: bool = False,
) -> Iterator[RouteCapture]:
    """Hook the routed layers of ``model`` for the duration of the ``with`` block."""
    capture = RouteCapture(geometry, adapter)
    layers = adapter.decoder_layers(model)
    handles = []
    try:
        for slot, index in enumerate(geometry.routed_layers):
            layer = layers[index]
            handles.append(adapter.router(layer).register_forward_hook(capture.gate_hook(slot)))
            experts = adapter.executed_ids_module(layer)
            if experts is not None:
                handles.append(experts.register_forward_pre_hook(capture.experts_pre_hook(slot)))
            if capture_hidden:
                norm = adapter.pre_attention_norm(layer)
                handles.append(norm.register_forward_pre_hook(capture.norm_pre_hook(slot)))
        yield capture
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class RouterPass:
    """What one plain forward reported. ``executed_ids_BTLK`` is the model's own top-k."""

    router_logits_BTLE: torch.Tensor
    executed_ids_BTLK: torch.Tensor | None
    hidden_BTLH: torch.Tensor | None


def forward_routes(
    model: nn.Module, adapter: FamilyAdapter, geometry: RouteGeometry, input_ids_BT: torch.Tensor,
    *, attention_mask_BT: torch.Tensor | None = None, capture_hidden: bool = False,
) -> RouterPass:
    """ONE plain causal forward (no cache) and the router logits of every routed layer."""
    batch, tokens = input_ids_BT.shape
    with torch.inference_mode(), capture_routes(
        model, adapter, geometry, capture_hidden=capture_hidden
    ) as capture:
        model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False,
              logits_to_keep=1)
        logits_BTLE = _to_btl(capture.router_logits_LNE(), batch, tokens)
        executed = capture.executed_ids_LNK()
        hidden = capture.hidden_LNH() if capture_hidden else None
    return RouterPass(
        router_logits_BTLE=logits_BTLE,
        executed_ids_BTLK=None if executed is None else _to_btl(executed, batch, tokens),
        hidden_BTLH=None if hidden is None else _to_btl(hidden, batch, tokens),
    )


def _to_btl(x_LNX: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
    layers, _, width = x_LNX.shape
    return x_LNX.reshape(layers, batch, tokens, width).permute(1, 2, 0, 3).contiguous()
