"""Vision-language composites as text teachers (:mod:`replay.composites`).

The text causal LM kept from a composite must compute what the composite itself
computes on text-only input: the same logits for one forward with explicit 1D
positions (prefill replay's) as for its own forward, which derives multimodal RoPE
positions itself, and the same logits step by step with a cache (decode's).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hebrus_flywheel.replay.composites import COMPOSITE_TEXT_TEACHERS, TextCausalLM
from hebrus_flywheel.replay.families import FAMILIES

COMPOSITES = sorted(name for name, spec in FAMILIES.items() if spec.sub_configs)


def tiny_composite(family: str) -> Any:
    """A random composite model of the tiny preset of ``family`` (its vision tower too)."""
    from hebrus_flywheel.replay.composites import composite_from_config

    config = FAMILIES[family].config(vocab_size=512, eos_id=1, pad_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return composite_from_config(config).eval()


def test_every_composite_text_teacher_has_a_tiny_preset() -> None:
    assert set(COMPOSITES) == set(COMPOSITE_TEXT_TEACHERS)


@pytest.mark.parametrize("family", COMPOSITES)
def test_text_causal_lm_computes_what_the_composite_does_on_text(family: str) -> None:
    from transformers import DynamicCache

    composite = tiny_composite(family)
    text = TextCausalLM(composite)
    assert text.config is composite.config.get_text_config()
    composite = getattr(composite, "thinker", composite)  # Qwen3-Omni's text forward
    ids_BT = torch.randint(2, 500, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = composite(input_ids=ids_BT, use_cache=False).logits
        got = text(ids_BT, position_ids=torch.arange(20)[None], use_cache=False).logits
        assert torch.equal(want, got)
        own, ours = (DynamicCache(config=text.config) for _ in range(2))
        composite(input_ids=ids_BT[:, :10], past_key_values=own, use_cache=True)
        text(ids_BT[:, :10], position_ids=torch.arange(10)[None], past_key_values=ours,
             use_cache=True)
        for t in range(10, 20):  # the composite derives the positions from its cache
            step = composite(input_ids=ids_BT[:, t:t + 1], past_key_values=own,
                             use_cache=True).logits
            mine = text(ids_BT[:, t:t + 1], position_ids=torch.tensor([[t]]),
                        past_key_values=ours, use_cache=True, logits_to_keep=1).logits
            assert torch.equal(step, mine), t


def test_ernie_vl_text_tokens_run_only_the_text_experts() -> None:
    """ERNIE-4.5-VL-MoE isolates experts by modality: on text the vision experts' gate
    is never called, so the text gate's route (adapters_vl) is the whole route."""
    composite = tiny_composite("ernie4_5_vl_moe")
    text = TextCausalLM(composite)
    calls = {"text": 0, "vision": 0}

    def counter(kind: str) -> Any:
        return lambda *_: calls.__setitem__(kind, calls[kind] + 1)

    for layer in text.model.layers[1:]:
        for kind in calls:
            getattr(layer.mlp, f"{kind}_moe").gate.register_forward_hook(counter(kind))
    with torch.no_grad():
        text(torch.tensor([[5, 6, 7, 8]]), use_cache=False)
    assert calls == {"text": 3, "vision": 0}
