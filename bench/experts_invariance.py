"""Is ``tiled_mm`` batch-invariant on this device, at a real MoE's widths?

Replay's labels equal decode's only if a token's experts output has the same bits alone
(a decode step) and inside a prefill batch of any size. ``replay/experts.py`` gets that
by running every (token, expert) pair through the same batched product of identical
``[16, in] x [in, out]`` tiles; on the CPU's BLAS that is checked by
``tests/unit/test_experts.py``. On a GPU the library may pick its kernel by the NUMBER
of tiles as well, which this measures: for each dtype, ``--samples`` tokens of a
``--tokens`` batch are computed alone and inside batches of several sizes, and the
fraction with identical bits is printed.

Figures (one JSON line each): ``tiled_mm_batch_invariant/<device>/<dtype>/batch=<n>``
(fraction of sampled tokens whose row is bitwise the one computed alone) and
``…/max_abs_diff``. Defaults are Qwen3-Next-80B-A3B's widths (512 experts, hidden 2048,
expert width 512, top-10); about 6.4 GB of fp32 weights.

    python3 bench/experts_invariance.py --device cuda [--dtypes float32 bfloat16]
    .venv/bin/python bench/experts_invariance.py --experts 64 --hidden 256 --inter 64 --k 4
"""

from __future__ import annotations

import argparse
import json
from types import MethodType
from typing import Any

import torch
from torch import nn

from hebrus_flywheel.replay.experts import tiled_mm_experts_forward
from hebrus_flywheel.replay.teacher import DTYPES


class Experts(nn.Module):
    """The attributes transformers' ``use_experts_implementation`` gives an experts module
    (gate and up fused, not transposed, no bias: the Qwen3-Next layout)."""

    def __init__(self, experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 device: str) -> None:
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(0)
        scale = hidden ** -0.5
        self.gate_up_proj = nn.Parameter(torch.randn(
            (experts, 2 * inter, hidden), generator=gen, device=device).mul_(scale).to(dtype))
        self.down_proj = nn.Parameter(torch.randn(
            (experts, hidden, inter), generator=gen, device=device).mul_(inter ** -0.5).to(dtype))
        self.num_experts, self.has_gate, self.has_bias, self.is_transposed = \
            experts, True, False, False
        self.act_fn = nn.functional.silu

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def routes(tokens: int, experts: int, hidden: int, k: int, dtype: torch.dtype,
           device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(1)
    x_TH = torch.randn((tokens, hidden), generator=gen, device=device).to(dtype)
    scores_TE = torch.randn((tokens, experts), generator=gen, device=device)
    weights_TK, ids_TK = torch.topk(torch.softmax(scores_TE, -1), k)
    return x_TH, ids_TK, (weights_TK / weights_TK.sum(-1, keepdim=True)).to(dtype)


def measure(args: argparse.Namespace, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    experts = Experts(args.experts, args.hidden, args.inter, dtype, args.device)
    forward: Any = MethodType(tiled_mm_experts_forward, experts)
    x_TH, ids_TK, weights_TK = routes(args.tokens, args.experts, args.hidden, args.k, dtype,
                                      args.device)
    samples = torch.linspace(0, args.tokens - 1, args.samples).long().tolist()
    with torch.inference_mode():
        alone = torch.cat([forward(x_TH[t:t + 1], ids_TK[t:t + 1], weights_TK[t:t + 1])
                           for t in samples])
        for batch in sorted({b for b in (16, 128, args.tokens) if b <= args.tokens}):
            rows = []
            for t in samples:  # the token first in a batch of `batch` tokens
                stop = min(args.tokens, t + batch)
                start = stop - batch
                rows.append(forward(x_TH[start:stop], ids_TK[start:stop],
                                    weights_TK[start:stop])[t - start])
            batched = torch.stack(rows)
            same = (batched == alone).all(-1).float().mean().item()
            diff = (batched.float() - alone.float()).abs().max().item()
            name = f"{args.device}/{dtype_name}/batch={batch}"
            common = {"samples": len(samples), "experts": args.experts, "hidden": args.hidden,
                      "inter": args.inter, "top_k": args.k}
            print(json.dumps({"figure": f"tiled_mm_batch_invariant/{name}", "value": same,
                              **common}), flush=True)
            print(json.dumps({"figure": f"tiled_mm_max_abs_diff/{name}", "value": diff,
                              **common}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=sorted(DTYPES))
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    for dtype_name in args.dtypes:
        measure(args, dtype_name)


if __name__ == "__main__":
    main()
