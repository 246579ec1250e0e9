"""KV-cache plumbing shared by candidate replay and teacher self-drafting.

The committed prefix is prefilled ONCE with ``use_cache=True`` (the adapter's
``new_cache``: a ``DynamicCache`` built from the model config unless the family needs
its own; for Qwen3-Next it holds the gated delta-net conv / recurrent states and the
full-attention KV), then the cache is expanded across the W candidate paths
(``reorder_cache`` with index 0 repeated W times: every path continues from the same
state) and the paths run as one ``[W, B]`` block with explicit positions. A tree
attention mask is not used: Qwen3-Next's linear-attention layers carry recurrent state
along a row, which a mask cannot branch.

Tensor legend: W paths, B block positions, V vocabulary.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from hebrus_flywheel.replay.teacher import Teacher


def prefill_prefix(teacher: Teacher, prefix_ids: list[int], first_ordinal: int) -> tuple[
        Any, torch.Tensor]:
    """``(cache, logits_V)``: the prefix's cache and its last position's float32 logits."""
    model = teacher.model
    cache = teacher.adapter.new_cache(model)
    device = model.device
    ids = torch.tensor([prefix_ids], dtype=torch.long, device=device)
    positions = torch.arange(first_ordinal, first_ordinal + len(prefix_ids),
                             dtype=torch.long, device=device).unsqueeze(0)
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return cache, out.logits[0, -1].to(device="cpu", dtype=torch.float32)


def expanded(cache: Any, width: int) -> Any:
    """A copy of a batch-1 ``cache`` repeated across ``width`` rows (the original is kept)."""
    copied = copy.deepcopy(cache)
    copied.reorder_cache(torch.zeros(width, dtype=torch.long, device=_cache_device(copied)))
    return copied


def _cache_device(cache: Any) -> torch.device:
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "conv_states"):
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                return value.device
            if isinstance(value, dict):
                for tensor in value.values():
                    if isinstance(tensor, torch.Tensor):
                        return tensor.device
    return torch.device("cpu")


def forward_block(teacher: Teacher, cache: Any, ids_WB: torch.Tensor, start: int) -> torch.Tensor:
    """One cached forward of ``ids_WB`` at positions ``start..start+B-1``: float32
    logits ``[W, B, V]`` on the CPU (the cache advances by B)."""
    model = teacher.model
    device = model.device
    width, block = ids_WB.shape
    positions = torch.arange(start, start + block, dtype=torch.long, device=device)
    out = model(input_ids=ids_WB.to(device), position_ids=positions.expand(width, block),
                past_key_values=cache, use_cache=True, logits_to_keep=0)
    return out.logits.to(device="cpu", dtype=torch.float32)
