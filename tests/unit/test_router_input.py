"""The gain the native-gate control applies is that of the norm the router really
reads, found by running the teacher (train.router_input): post_attention_layernorm for
most families, Jamba's pre_ff_layernorm, LFM2-MoE's ffn_norm, and none for FlexOLMo,
whose post-norm layers feed the MLP the residual stream itself. The router's weight is
read through the family adapter (LongCat's router is not a Linear)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hebrus_flywheel.replay.teacher import init_teacher, load_teacher
from hebrus_flywheel.train.evaluate import router_weights

EXPECTED = {"qwen3_moe": "post_attention_layernorm", "jamba": "pre_ff_layernorm",
            "lfm2_moe": "ffn_norm", "flex_olmo": None, "nemotron_h": "norm",
            # two sublayers per decoder layer, and a router with no .weight of its own
            "longcat_flash": "post_attention_layernorm.0"}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_gain_is_that_of_the_norm_feeding_the_router(tmp_path: Path, family: str) -> None:
    init_teacher(tmp_path / family, family=family, seed=0)
    teacher = load_teacher(tmp_path / family)
    layers = teacher.adapter.decoder_layers(teacher.model)
    generator = torch.Generator().manual_seed(1)
    for module in teacher.model.modules():  # distinct gains, so a wrong norm shows
        weight = getattr(module, "weight", None)
        if "norm" in type(module).__name__.lower() and isinstance(weight, torch.Tensor):
            with torch.no_grad():
                weight.copy_(torch.rand(weight.shape, generator=generator) + 0.5)
    gains = router_weights(teacher).norm_gain_LH
    assert gains is not None and len(gains) == len(teacher.geometry.routed_layers)
    for slot, index in enumerate(teacher.geometry.routed_layers):
        name = EXPECTED[family]
        want = (np.ones(gains.shape[1]) if name is None
                else layers[index].get_submodule(name).weight.detach().float().numpy())
        np.testing.assert_allclose(gains[slot], want, rtol=1e-4, err_msg=f"layer {index}")
