"""Route adapters of further MoE families (issue 16), after :mod:`replay.adapters_extra`.

Each class names where its family's router sits, what the router returns and in which
order, and the rule it executes, read from the family's ``modeling_*.py`` in the
installed transformers; :mod:`replay.adapters` registers them in ``ADAPTERS``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hebrus_flywheel.replay.adapter_base import FamilyAdapter
from hebrus_flywheel.replay.exceptions import UnsupportedModelError
from hebrus_flywheel.replay.routing import RouterRule


def _sparse_layers(config: Any) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse")


class Cohere2MoeAdapter(FamilyAdapter):
    """Cohere2-MoE: routed where ``mlp_layer_types`` says ``sparse``; ``mlp.gate`` ranks
    the raw logits, weighs the top-k by the softmax over their logits (the renormalised
    softmax) or by their sigmoid (renormalised if ``norm_topk_prob``, no epsilon), cast
    to the hidden dtype; shared experts always run. Attention and the MoE block both
    read ``input_layernorm``'s output (a parallel block)."""

    model_type = "cohere2_moe"
    weights_in_hidden_dtype = True

    def routed_layers(self, config: Any) -> tuple[int, ...]:
        return _sparse_layers(config)

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


MORE_ADAPTERS: tuple[FamilyAdapter, ...] = (
    Cohere2MoeAdapter(), AfmoeAdapter(),
)
