"""Teacher self-drafting (``teacher_self``): the acceptance upper bound.

The teacher itself proposes: its top-W next tokens after the committed prefix (ranked by
logit, ties by the lower token id), each continued greedily (``argmax``) to depth B with
one batched cached step per depth. Every token carries the teacher's own float32
log-softmax probability. Under greedy verification path 0 is accepted in full and the
others are rejected at their first token, which is what an upper bound should show.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hebrus_flywheel.replay.candidates.drafters import DraftConfig, Proposal, paths_from_rows
from hebrus_flywheel.replay.candidates.kv import expanded, forward_block, prefill_prefix
from hebrus_flywheel.replay.exceptions import CandidateError
from hebrus_flywheel.replay.teacher import Teacher


class TeacherSelfDrafter:
    """Drafts with the teacher (see the module doc); ``first_ordinal`` of the context is
    0 unless :meth:`propose_at` is given one."""

    drafter_id = "teacher_self"

    def __init__(self, teacher: Teacher) -> None:
        self.teacher = teacher

    def propose(self, context: Sequence[int], config: DraftConfig) -> Proposal:
        return self.propose_at(context, config, first_ordinal=0)

    def propose_at(self, context: Sequence[int], config: DraftConfig, *,
                   first_ordinal: int) -> Proposal:
        ids = [int(t) for t in context]
        if not ids:
            raise CandidateError("teacher self-drafting needs a non-empty context")
        with torch.inference_mode():
            cache, logits_V = prefill_prefix(self.teacher, ids, first_ordinal)
            logp_V = torch.log_softmax(logits_V, dim=-1)
            order = torch.sort(logits_V, descending=True, stable=True).indices
            width = min(config.width, logits_V.numel())
            first_W = order[:width]
            tokens = [first_W]
            logps = [logp_V[first_W]]
            cache = expanded(cache, width)
            start = first_ordinal + len(ids)
            for step in range(1, config.depth):
                logits_WV = forward_block(self.teacher, cache, tokens[-1].unsqueeze(1),
                                          start + step - 1)[:, -1]
                logp_WV = torch.log_softmax(logits_WV, dim=-1)
                chosen_W = torch.argmax(logits_WV, dim=-1)
                tokens.append(chosen_W)
                logps.append(logp_WV.gather(1, chosen_W.unsqueeze(1)).squeeze(1))
        ids_WB = torch.stack(tokens, dim=1).tolist()
        logp_WB = torch.stack(logps, dim=1).clamp(max=0.0).tolist()
        # distinct first tokens make distinct paths
        return Proposal(self.drafter_id, paths_from_rows(ids_WB, logp_WB))
