"""Which normalisation feeds each routed layer's router, found by running the teacher.

The ``native_gate`` control (and the gate prior of the learned predictors) applies a
layer's router to the stored pre-attention feature, scaled by the gain of the norm the
router reads: most families route ``post_attention_layernorm(h)``, but Jamba reads
``pre_ff_layernorm``, LFM2-MoE ``ffn_norm``, and FlexOLMo's post-norm layers feed the
MLP the residual stream itself (its ``post_attention_layernorm`` normalises the
attention output instead). Rather than a table per family, one short forward with hooks
compares every norm's output in a routed layer with what that layer's router received:
the norm whose output *is* the router's input gives the gain; a router fed by no norm
gets unit gain (it reads an un-normalised stream).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

PROBE_TOKENS = 8


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _gain(norm: nn.Module, width: int, dtype: torch.dtype) -> np.ndarray:
    """The norm applied to a unit-RMS probe: its per-channel gain (a ``1/rms`` factor
    does not change rankings). A mean-subtracting norm maps the probe to zeros, so its
    ``weight`` stands in."""
    with torch.no_grad():
        gain = norm(torch.ones(1, width, dtype=dtype)).float().cpu().numpy()[0]
    weight = getattr(norm, "weight", None)
    if not np.any(gain) and isinstance(weight, torch.Tensor) and weight.numel() == width:
        gain = weight.detach().float().cpu().numpy()
    return np.asarray(gain, dtype=np.float32)


def _same(a: Any, b: torch.Tensor | None) -> bool:
    if not isinstance(a, torch.Tensor) or b is None or a.shape[-1] != b.shape[-1]:
        return False
    x, y = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    return x.shape == y.shape and bool(torch.equal(x, y))


def router_input_gains(teacher: Any, width: int, dtype: torch.dtype) -> list[np.ndarray]:
    """Per routed layer (``teacher.geometry.routed_layers`` order), the ``(H,)`` gain of
    the norm whose output the router reads; ones where no norm feeds it."""
    layers = teacher.adapter.decoder_layers(teacher.model)
    routed = list(teacher.geometry.routed_layers)
    seen: dict[int, torch.Tensor] = {}
    outputs: dict[int, list[tuple[nn.Module, Any]]] = {i: [] for i in routed}
    hooks = []
    for slot, index in enumerate(routed):
        def record_input(_m: nn.Module, args: tuple[Any, ...], slot: int = slot) -> None:
            if args and isinstance(args[0], torch.Tensor):
                seen.setdefault(slot, args[0].detach())
        hooks.append(teacher.adapter.router(layers[index]).register_forward_pre_hook(
            record_input))
        for module in (m for _, m in layers[index].named_modules() if _is_norm(m)):
            def record_output(m: nn.Module, _a: Any, out: Any, index: int = index) -> None:
                outputs[index].append((m, out.detach() if isinstance(out, torch.Tensor)
                                       else None))
            hooks.append(module.register_forward_hook(record_output))
    try:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, teacher.vocab_size, (1, PROBE_TOKENS), generator=generator)
        with torch.no_grad():
            teacher.model(ids.to(teacher.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    gains = []
    for slot, index in enumerate(routed):
        feeding = next((m for m, out in outputs[index] if _same(out, seen.get(slot))), None)
        gains.append(np.ones(width, dtype=np.float32) if feeding is None
                     else _gain(feeding, width, dtype))
    return gains
