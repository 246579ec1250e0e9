"""Tiny presets of the families of :mod:`replay.adapters_hybrid` (``teacher init --family``).

Plain keyword sets of :class:`replay.families.FamilySpec` (which builds them; no import of
it here, so either module imports first), merged into ``FAMILIES`` by
:mod:`replay.families`. Widths follow its ``_COMMON`` toy geometry (hidden 64, 4 layers).
"""

from __future__ import annotations

from typing import Any

HYBRID_FAMILIES: tuple[dict[str, Any], ...] = (
    {"name": "granitemoe_swa", "config_class": "GraniteMoeSWAConfig", "fields": {
        "num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 16,
        "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"] * 2},
     "attention": "eager",
     "summary": "Granite-MoE's router (softmax over the top-4 of 16 float32 logits) "
                "returning (logits, weights, ids); sliding/full attention with sinks; eager"},
)
