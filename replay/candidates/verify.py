"""Verification of a candidate path under the recorded sampling configuration.

Given the teacher's next-token logits at every candidate position (row ``j`` predicts the
path's token ``j``: row 0 is the committed prefix's last logits) the accepted prefix
length is:

- greedy (``temperature == 0``): the longest prefix of the path equal to the teacher's
  argmax continuation (``torch.argmax``, the same rule as :func:`replay.decode.sample_token`);
- ``temperature > 0``: deterministic speculative rejection sampling. Token ``j`` is
  accepted when ``u_j < min(1, p_j / q_j)``, ``p_j`` the teacher's probability of it
  after the recorded temperature / top-k / top-p filters, ``q_j = exp(drafter_logprob)``,
  and ``u_j`` the ``j``-th uniform of a PCG64 stream seeded by
  ``sha256(proposal_id | path_id)``; the first rejection ends the prefix (the correction
  token a live verifier would sample there is not needed for the length). The same
  proposal therefore always gets the same accepted length, on replay and on the decode
  reference alike.

``accepted_prefix_digest`` is the SHA-256 hex of the accepted token ids as int32
little-endian (the empty prefix hashes the empty string).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from hebrus_flywheel.replay.decode import SamplingConfig, filtered_scores


def proposal_id(window_id: str, anchor_ordinal: int, drafter_id: str) -> str:
    """Hex SHA-256 of ``window_id|anchor_ordinal|drafter_id``."""
    return hashlib.sha256(f"{window_id}|{int(anchor_ordinal)}|{drafter_id}".encode()).hexdigest()


def accepted_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 hex of the accepted token ids as int32 little-endian."""
    return hashlib.sha256(np.asarray(list(token_ids), dtype="<i4").tobytes()).hexdigest()


def _uniforms(proposal: str, path_id: int, count: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{proposal}|{path_id}".encode()).digest()[:16], "big")
    return np.random.Generator(np.random.PCG64(seed)).random(count)


def target_probs(logits_BV: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The teacher's sampling distribution per row after the recorded filters (float32)."""
    return torch.stack([torch.softmax(filtered_scores(row_V, sampling), dim=-1)
                        for row_V in logits_BV])


def accepted_length(
    logits_BV: torch.Tensor, token_ids: Sequence[int], logprobs: Sequence[float],
    sampling: SamplingConfig, *, proposal: str, path_id: int,
) -> int:
    """Accepted prefix length (0..len(token_ids)) of one path; see the module doc."""
    depth = len(token_ids)
    if sampling.temperature == 0.0:
        greedy = torch.argmax(logits_BV[:depth], dim=-1).tolist()
        for j, token in enumerate(token_ids):
            if greedy[j] != int(token):
                return j
        return depth
    probs_BV = target_probs(logits_BV[:depth], sampling)
    uniforms = _uniforms(proposal, path_id, depth)
    for j, token in enumerate(token_ids):
        p = float(probs_BV[j, int(token)])
        q = float(np.exp(logprobs[j]))
        if not uniforms[j] < min(1.0, p / q):
            return j
    return depth
