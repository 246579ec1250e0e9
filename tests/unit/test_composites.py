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

from hebrus_flywheel.replay.composites import TextCausalLM

_TEXT: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512, "tie_word_embeddings": False,
}
TINY_COMPOSITES = {  # composite config class: (text fields, tiny vision)
    "Qwen3VLMoeConfig": ({
        "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
        "intermediate_size": 32, "mlp_only_layers": [0],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [8, 4, 4], "mrope_interleaved": True}},
        {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
         "out_hidden_size": 64, "deepstack_visual_indexes": [0]}),
}


def tiny_composite(config_class: str) -> Any:
    """A random composite model of ``config_class`` with tiny text and vision parts."""
    import transformers
    from transformers import AutoModelForImageTextToText

    text, vision = TINY_COMPOSITES[config_class]
    config = getattr(transformers, config_class)(text_config={**_TEXT, **text},
                                                 vision_config=vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForImageTextToText.from_config(config).eval()


@pytest.mark.parametrize("config_class", sorted(TINY_COMPOSITES))
def test_text_causal_lm_computes_what_the_composite_does_on_text(config_class: str) -> None:
    from transformers import DynamicCache

    composite = tiny_composite(config_class)
    text = TextCausalLM(composite)
    assert text.config is composite.config.get_text_config()
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
