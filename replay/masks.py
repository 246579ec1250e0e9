"""The attention masks one batched replay forward takes, always materialised.

Replay right-pads windows into one batch, so every attention layer needs an explicit
causal(+padding) mask; transformers' own mask builders make them from the 2D padding
mask, per layer type for hybrid models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hebrus_flywheel.replay.adapters_vl import PADDING_MASK_FAMILIES
from hebrus_flywheel.replay.exceptions import ReplayError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def attention_masks(
    model: PreTrainedModel, mask_BT: torch.Tensor, positions_BT: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Always-materialised masks: 4D causal(+padding) for attention, 2D for linear layers.

    Hybrid models (``linear_attention`` or LFM2's ``conv`` in ``config.layer_types``, e.g.
    Qwen3-Next) take a mapping per layer type; others take the 4D mask, which
    transformers uses as is.
    """
    from transformers.masking_utils import (
        create_causal_mask,
        create_chunked_causal_mask,
        create_sliding_window_causal_mask,
    )

    config = model.config
    shape_only = torch.empty((*mask_BT.shape, 0), dtype=model.dtype, device=mask_BT.device)

    def materialised(make: Any) -> torch.Tensor:
        mask_4d = make(config=config, inputs_embeds=shape_only, attention_mask=mask_BT,
                       past_key_values=None, position_ids=positions_BT,
                       allow_is_causal_skip=False)
        if not isinstance(mask_4d, torch.Tensor):
            raise ReplayError(
                f"attention implementation {config._attn_implementation!r} gave no "
                "materialised mask; replay needs explicit masks, load the teacher with sdpa "
                "or eager attention"
            )
        return mask_4d

    layer_types = set(getattr(config, "layer_types", None) or ())
    if config.model_type in PADDING_MASK_FAMILIES:  # they take the 2D mask, causal inside
        return {kind: mask_BT for kind in layer_types}
    if not layer_types:  # one mask for every layer; a window only if one is set (> 0)
        sliding = bool(getattr(config, "sliding_window", None))
        return materialised(create_sliding_window_causal_mask if sliding else create_causal_mask)
    if layer_types <= {"compressed_sparse_attention", "heavily_compressed_attention"}:
        # DeepSeek-V4 takes ONE sliding-window mask for every layer (a dict's first value)
        return materialised(create_sliding_window_causal_mask)
    if layer_types <= {"full_attention", "minimax_m3_sparse"}:
        # e.g. Qwen2-MoE keeps sliding_window=0 unused; MiniMax-M3 takes ONE causal mask
        # for its full and sparse (block-indexer) layers (a dict's first value)
        return materialised(create_causal_mask)
    makers = {"full_attention": create_causal_mask,
              "sliding_attention": create_sliding_window_causal_mask,
              "hybrid": create_causal_mask,  # ZAYA's attention layers (their convolution
              "hybrid_sliding": create_sliding_window_causal_mask,  # takes "conv": 2D)
              "chunked_attention": create_chunked_causal_mask,  # Llama 4
              "deepseek_sparse_attention": create_causal_mask,  # DeepSeek-V3.2
              "qwen_sparse_attention": create_causal_mask}  # Qwen4-Exp (QSA indexer)
    # Nemotron-H's "moe" and "mlp" blocks are a mixer alone: they take no mask
    unknown = layer_types - {"linear_attention", "conv", "moe", "mlp", *makers}
    if unknown:
        raise ReplayError(
            f"layer types {sorted(unknown)} have no replay mask rule; extend "
            "replay.masks.attention_masks before replaying this family"
        )
    masks: dict[str, torch.Tensor] = {"linear_attention": mask_BT, "conv": mask_BT}
    for kind in layer_types & set(makers):
        masks[kind] = materialised(makers[kind])
    # Inkling's "hybrid" layers look their masks up as full/sliding attention
    for kind, alias in (("hybrid", "full_attention"), ("hybrid_sliding", "sliding_attention")):
        if kind in masks:
            masks.setdefault(alias, masks[kind])
    return masks
