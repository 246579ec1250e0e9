"""Route adapters of further MoE families (issue 16), after :mod:`replay.adapters_extra`.

Each class names where its family's router sits, what the router returns and in which
order, and the rule it executes, read from the family's ``modeling_*.py`` in the
installed transformers; :mod:`replay.adapters` registers them in ``ADAPTERS``.
"""

from __future__ import annotations

from typing import Any

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


MORE_ADAPTERS: tuple[FamilyAdapter, ...] = (
    Cohere2MoeAdapter(),
)
