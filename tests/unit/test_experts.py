"""tiled_mm experts: the transformers experts result, independent of every other token."""

from __future__ import annotations

from types import MethodType

import pytest
import torch
from torch import nn

from hebrus_flywheel.replay.experts import TILE_ROWS, tiled_mm_experts_forward

E, H, INTER, K = 64, 32, 8, 4


class Experts(nn.Module):
    """The attribute shape transformers' ``use_experts_implementation`` gives a module."""

    def __init__(self, *, transposed: bool, bias: bool, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        if transposed:
            up, down = (E, H, 2 * INTER), (E, INTER, H)
        else:
            up, down = (E, 2 * INTER, H), (E, H, INTER)
        self.gate_up_proj = nn.Parameter(torch.randn(up, generator=gen) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(down, generator=gen) * 0.2)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * INTER, generator=gen))
        self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=gen))
        self.num_experts, self.has_gate, self.has_bias = E, True, bias
        self.is_transposed = transposed
        self.act_fn = nn.functional.silu

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def reference(self, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                  weights_TK: torch.Tensor) -> torch.Tensor:
        """The plain per-pair loop (transformers' eager experts)."""
        out = torch.zeros_like(x_TH)
        for t in range(x_TH.shape[0]):
            for k in range(ids_TK.shape[1]):
                e = int(ids_TK[t, k])
                up_w = self.gate_up_proj[e] if self.is_transposed else self.gate_up_proj[e].T
                down_w = self.down_proj[e] if self.is_transposed else self.down_proj[e].T
                h = x_TH[t] @ up_w + (self.gate_up_proj_bias[e] if self.has_bias else 0)
                y = self._apply_gate(h) @ down_w + (self.down_proj_bias[e] if self.has_bias else 0)
                out[t] += weights_TK[t, k] * y
        return out


def _routes(tokens: int, seed: int, hot: int | None = None) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(tokens, H, generator=gen)
    scores = torch.rand(tokens, E, generator=gen)
    if hot is not None:
        scores[:, hot] += 2.0  # every token picks this expert: many tiles of one expert
    weights, ids_TK = torch.topk(torch.softmax(scores, -1), K)
    return x_TH, ids_TK, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize(("transposed", "bias"), [(False, False), (True, False), (False, True)])
def test_tiled_mm_computes_the_experts_output(transposed: bool, bias: bool) -> None:
    experts = Experts(transposed=transposed, bias=bias)
    forward = MethodType(tiled_mm_experts_forward, experts)
    x_TH, ids_TK, weights_TK = _routes(50, seed=1, hot=3)
    with torch.no_grad():
        torch.testing.assert_close(forward(x_TH, ids_TK, weights_TK),
                                   experts.reference(x_TH, ids_TK, weights_TK),
                                   rtol=1e-5, atol=1e-5)


def test_a_token_gets_the_same_bits_alone_and_in_any_batch() -> None:
    torch.set_num_threads(1)
    experts = Experts(transposed=False, bias=False)
    forward = MethodType(tiled_mm_experts_forward, experts)
    x_TH, ids_TK, weights_TK = _routes(3 * TILE_ROWS + 5, seed=2, hot=7)
    with torch.no_grad():
        alone = [forward(x_TH[t:t + 1], ids_TK[t:t + 1], weights_TK[t:t + 1])
                 for t in range(len(x_TH))]
        for seed, size in ((3, 1), (4, TILE_ROWS), (5, 4 * TILE_ROWS + 1), (6, 300)):
            others = _routes(size, seed=seed, hot=7 if seed % 2 else None)
            for t in (0, len(x_TH) // 2, len(x_TH) - 1):
                at = seed % (size + 1)
                batch = [torch.cat([o[:at], s[t:t + 1], o[at:]])
                         for o, s in zip(others, (x_TH, ids_TK, weights_TK), strict=True)]
                got = forward(*batch)[at]
                assert torch.equal(got, alone[t][0]), (seed, size, t)


def test_the_one_token_shortcut_gives_the_bits_of_the_general_packing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import hebrus_flywheel.replay.experts as experts_module

    experts = Experts(transposed=False, bias=False)
    forward = MethodType(tiled_mm_experts_forward, experts)
    x_TH, ids_TK, weights_TK = _routes(8, seed=9)
    with torch.no_grad():
        fast = [forward(x_TH[t:t + 1], ids_TK[t:t + 1], weights_TK[t:t + 1]) for t in range(8)]
        general = experts_module._pack
        monkeypatch.setattr(experts_module, "_pack", lambda ids, n, _one: general(ids, n, False))
        slow = [forward(x_TH[t:t + 1], ids_TK[t:t + 1], weights_TK[t:t + 1]) for t in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))
