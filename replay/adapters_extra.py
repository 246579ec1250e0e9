"""Route adapters of the MoE families added after the first eight (issue 16).

Each class names where its family's router sits, what the router returns and in which
order, and the rule it executes, read from the family's ``modeling_*.py`` in the
installed transformers; :mod:`replay.adapters` registers them in ``ADAPTERS``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hebrus_flywheel.replay.adapter_base import FamilyAdapter
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


EXTRA_ADAPTERS: tuple[FamilyAdapter, ...] = (
    GptOssAdapter(), GraniteMoeAdapter(), GraniteMoeSharedAdapter(), MiniMaxAdapter(),
)
