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


def test_gpt_oss_native_gate_carries_the_router_logit_bias(tmp_path: Path) -> None:
    """GPT-OSS's router linear has a bias: the native gate applied to the stream the
    router reads ranks experts exactly as the router does, and drops the bias nowhere
    (with the bias left out, the ranking differs)."""
    from hebrus_flywheel.train.baselines import NativeGateBaseline

    init_teacher(tmp_path / "gpt_oss", family="gpt_oss", seed=0)
    teacher = load_teacher(tmp_path / "gpt_oss")
    adapter, layers = teacher.adapter, teacher.adapter.decoder_layers(teacher.model)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # a real model's residual scale, where the norms' eps is noise
        teacher.model.get_input_embeddings().weight.mul_(50.0)
    for index in teacher.geometry.routed_layers:
        gate = adapter.router(layers[index])
        with torch.no_grad():  # a bias as large as the logits, so leaving it out shows
            gate.bias.copy_(torch.randn(gate.bias.shape, generator=generator) * 2.0)
    router = router_weights(teacher)
    assert router.bias_LE is not None and router.bias_LE.shape == router.router_LEH.shape[:2]
    streams, logits = [], []
    for index in teacher.geometry.routed_layers:

        def record(module: torch.nn.Module, args: tuple[torch.Tensor], out: torch.Tensor,
                   gate: torch.nn.Module = adapter.router(layers[index])) -> None:
            streams.append(args[0].reshape(-1, args[0].shape[-1]).float())
            logits.append(adapter.gate_logits(gate, out.reshape(-1, out.shape[-1])))

        layers[index].post_attention_layernorm.register_forward_hook(record)
    with torch.no_grad():
        teacher.model(torch.arange(3, 27).reshape(2, 12))
    k = teacher.geometry.top_k
    for slot, (stream, logit) in enumerate(zip(streams, logits, strict=True)):
        layer = np.full(len(stream), slot)
        want = torch.topk(logit.float(), k).indices.sort(dim=1).values.numpy()
        with_bias = NativeGateBaseline(router.router_LEH, norm_weight_LH=router.norm_gain_LH,
                                       bias_LE=router.bias_LE).scores(stream.numpy(), layer)
        without = NativeGateBaseline(router.router_LEH, norm_weight_LH=router.norm_gain_LH
                                     ).scores(stream.numpy(), layer)
        top = np.sort(np.argsort(-with_bias, axis=1)[:, :k], axis=1)
        np.testing.assert_array_equal(top, want, err_msg=f"slot {slot}")
        assert (np.sort(np.argsort(-without, axis=1)[:, :k], axis=1) != want).any()


def test_zaya_has_no_native_gate_control_and_says_why(tmp_path: Path) -> None:
    """ZAYA's router is an MLP over a state carried from the previous layer: no (E, H)
    matrix to apply to a feature, so the control is refused with its own error, which
    evaluation and qualification turn into a skipped control, not a crash."""
    from hebrus_flywheel.train.exceptions import BaselineError, NoNativeGateError

    init_teacher(tmp_path / "zaya", family="zaya", seed=0)
    teacher = load_teacher(tmp_path / "zaya")
    with pytest.raises(NoNativeGateError, match="zaya router of layer 0 is not one") as info:
        router_weights(teacher)
    assert isinstance(info.value, BaselineError)
