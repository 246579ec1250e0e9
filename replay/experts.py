"""``tiled_mm``: a batch-invariant routed-experts forward that gathers weights per tile.

transformers ships two experts kernels, and neither fits teacher replay on a CPU:

- ``batched_mm`` computes every (token, expert) pair alone (a matrix-vector product),
  so a token's result never depends on its batch-mates, but it first COPIES the two
  weight matrices of every pair: ``T * K`` copies per layer, which dominates prefill
  time (``bench/replay.py``);
- ``grouped_mm`` runs one matrix product per expert over all its tokens: fast, but the
  BLAS picks its kernel by the row count, so a token's result depends on how many other
  tokens chose the same expert, i.e. on the batch (measured: three distinct results for
  one row as the row count runs over 1..300).

``tiled_mm`` sorts the pairs by expert and packs each expert's pairs into tiles of
exactly :data:`TILE_ROWS` rows (zero rows fill the last tile), then runs ONE batched
product of identical ``[TILE_ROWS, in] x [in, out]`` tiles per projection, with the
weights gathered once per tile. Every pair is therefore computed by the same kernel at
the same shape whatever its tile-mates, tile position and tile count — checked on this
machine's BLAS, and asserted by ``tests/unit/test_experts.py`` — and a decode step (one
token, ``K`` tiles of one real row) computes the same numbers as a prefill of a
thousand tokens. The gate activation and the routing-weight product run on whole tile
buffers (a multiple of ``TILE_ROWS x width`` elements), so no vectorised kernel ever
finishes a ragged tail. Pairs are summed per token in rank order, like ``batched_mm``.

Results are NOT bitwise those of ``batched_mm`` (a tile product and a matrix-vector
product round differently), so the implementation is part of the replay contract and
the parity gate compares decode and replay made with the same one.

Tensor legend: T tokens, K top-k, S = T*K pairs, E experts, N tiles, R tile rows,
H hidden, I intermediate width, O a projection's output width.
"""

from __future__ import annotations

from typing import Any

import torch

TILE_ROWS = 16
NAME = "tiled_mm"


def _tile_linear(
    x_NRI: torch.Tensor, weight_E: torch.Tensor, experts_N: torch.Tensor,
    bias_E: torch.Tensor | None, transposed: bool,
) -> torch.Tensor:
    """``x @ W[e].T (+ b[e])`` for each tile's expert ``e``: ``[N, R, O]``."""
    weight_N = weight_E[experts_N]  # (N, O, I), or (N, I, O) when transposed
    out_NRO = torch.bmm(x_NRI, weight_N if transposed else weight_N.transpose(1, 2))
    if bias_E is not None:
        out_NRO = out_NRO + bias_E[experts_N].unsqueeze(1)
    return out_NRO


def _pack(expert_ids_S: torch.Tensor, expert_count: int,
          one_token: bool) -> tuple[torch.Tensor, ...]:
    """Where each pair sits: ``(order_S, tile_S, row_S, experts_N)``, pairs sorted by
    expert (stable: token order, then rank, within an expert).

    One token (a decode step) takes a shortcut: each pair gets a tile of its own, in rank
    order. That gives the same bits, since a pair's result depends neither on its row
    nor on its tile-mates nor on its tile's place among the tiles."""
    if one_token:
        pairs_S = torch.arange(expert_ids_S.numel(), device=expert_ids_S.device)
        return pairs_S, pairs_S, torch.zeros_like(pairs_S), expert_ids_S
    order_S = torch.argsort(expert_ids_S, stable=True)
    sorted_S = expert_ids_S[order_S]
    counts_E = torch.bincount(sorted_S, minlength=expert_count)
    tiles_E = (counts_E + TILE_ROWS - 1) // TILE_ROWS
    first_pair_E = torch.cumsum(counts_E, 0) - counts_E
    first_tile_E = torch.cumsum(tiles_E, 0) - tiles_E
    rank_S = torch.arange(sorted_S.numel(), device=sorted_S.device) - first_pair_E[sorted_S]
    tile_S = first_tile_E[sorted_S] + rank_S // TILE_ROWS
    experts_N = torch.repeat_interleave(
        torch.arange(expert_count, device=sorted_S.device), tiles_E)
    return order_S, tile_S, rank_S % TILE_ROWS, experts_N


def tiled_mm_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts' output ``[T, H]`` for routed ``top_k_index``/``top_k_weights`` ``[T, K]``."""
    tokens, top_k = top_k_index.shape
    hidden = hidden_states.size(-1)
    expert_ids_S = top_k_index.reshape(-1).clamp(0, self.num_experts - 1)
    order_S, tile_S, row_S, experts_N = _pack(expert_ids_S, self.num_experts, tokens == 1)
    tiles = experts_N.numel()
    x_NRH = hidden_states.new_zeros((tiles, TILE_ROWS, hidden))
    x_NRH[tile_S, row_S] = hidden_states[order_S // top_k]
    weights_NR = top_k_weights.new_zeros((tiles, TILE_ROWS))
    weights_NR[tile_S, row_S] = top_k_weights.reshape(-1)[order_S]
    if self.has_gate:
        bias = self.gate_up_proj_bias if self.has_bias else None
        up_NRO = _tile_linear(x_NRH, self.gate_up_proj, experts_N, bias, self.is_transposed)
        act_NRI = self._apply_gate(up_NRO)
    else:
        bias = self.up_proj_bias if self.has_bias else None
        act_NRI = self.act_fn(_tile_linear(x_NRH, self.up_proj, experts_N, bias,
                                           self.is_transposed))
    bias = self.down_proj_bias if self.has_bias else None
    out_NRH = _tile_linear(act_NRI, self.down_proj, experts_N, bias, self.is_transposed)
    weighted_NRH = out_NRH * weights_NR.to(out_NRH.dtype).unsqueeze(-1)
    pairs_SH = torch.empty((tokens * top_k, hidden), dtype=out_NRH.dtype,
                           device=out_NRH.device)
    pairs_SH[order_S] = weighted_NRH[tile_S, row_S]
    return pairs_SH.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def register() -> None:
    """Make ``experts_implementation="tiled_mm"`` known to transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, tiled_mm_experts_forward)
