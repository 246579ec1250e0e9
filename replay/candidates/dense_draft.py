"""A small dense draft model, trained by the project on a clean snapshot's token streams.

:class:`DenseDraftModel` is a next-token language model: token embedding, a GRU, a
linear head over the teacher's vocabulary. :func:`train_dense_drafter` fits it on the
*train* split's committed token streams only (consecutive labelled tokens of each thread
generation, from the sealed clean snapshot's ``token_ordinal``/``token_id`` columns),
with a fixed seed and step budget, so the same snapshot and configuration give the same
weights. :class:`DenseDrafter` proposes like the teacher self-drafter: the model's top-W
first tokens, greedy below them, each token with the model's log-probability.

Its ``drafter_id`` names the architecture and a digest of the configuration and the
training streams, so candidate rows say which drafter (and which training data) made
them.

Tensor legend: N sequences, T positions, V vocabulary, H hidden width, W paths.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.candidates.drafters import DraftConfig, Proposal, paths_from_rows
from hebrus_flywheel.replay.exceptions import CandidateError


@dataclass(frozen=True, kw_only=True)
class DenseDraftConfig:
    """The draft model and its training budget.

    Fields:
        vocab_size: the teacher's vocabulary (token ids must lie below it).
        embed_dim: token embedding width.
        hidden_dim: GRU hidden width H.
        context: tokens of context the model reads before the anchor (and trains on).
        steps: optimizer steps (Adam) of training.
        batch: sequences per step.
        lr: Adam learning rate.
        seed: seed of the initialisation and of the batch order.
    """

    vocab_size: int
    embed_dim: int = 32
    hidden_dim: int = 64
    context: int = 32
    steps: int = 200
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "hidden_dim", "context", "steps", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"DenseDraftConfig.{name} must be a positive integer, "
                                  f"got {value!r}")
        if not self.lr > 0:
            raise ConfigError(f"DenseDraftConfig.lr must be > 0, got {self.lr!r}")


class DenseDraftModel(nn.Module):
    """Embedding -> GRU -> vocabulary logits."""

    def __init__(self, config: DenseDraftConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        self.rnn = nn.GRU(config.embed_dim, config.hidden_dim, batch_first=True)
        self.head = nn.Linear(config.hidden_dim, config.vocab_size)

    def forward(self, ids_NT: torch.Tensor,
                state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out_NTH, state = self.rnn(self.embed(ids_NT), state)
        return self.head(out_NTH), state  # (N, T, V), (1, N, H)


def _chunks(streams: Iterable[Sequence[int]], length: int) -> list[list[int]]:
    """Training sequences of ``length + 1`` tokens (shorter tails kept when >= 2)."""
    out = []
    for stream in streams:
        tokens = [int(t) for t in stream]
        for start in range(0, max(len(tokens) - 1, 0), length):
            piece = tokens[start:start + length + 1]
            if len(piece) >= 2:
                out.append(piece)
    return out


def streams_digest(streams: Sequence[Sequence[int]], config: DenseDraftConfig) -> str:
    """SHA-256 of the configuration and the training streams (the drafter's lineage)."""
    h = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode())
    for stream in streams:
        h.update(np.asarray(stream, dtype="<i4").tobytes())
        h.update(b"|")
    return h.hexdigest()


def train_dense_drafter(streams: Sequence[Sequence[int]],
                        config: DenseDraftConfig) -> DenseDrafter:
    """Fit the draft model on ``streams`` (next-token cross-entropy); deterministic."""
    pieces = _chunks(streams, config.context)
    if not pieces:
        raise CandidateError("the dense drafter needs at least one stream of >= 2 tokens")
    if max(max(p) for p in pieces) >= config.vocab_size or min(min(p) for p in pieces) < 0:
        raise CandidateError(f"training token ids must lie in [0, {config.vocab_size})")
    generator = torch.Generator().manual_seed(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = DenseDraftModel(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    width = config.context + 1
    padded_NT = torch.full((len(pieces), width), -1, dtype=torch.long)
    for i, piece in enumerate(pieces):
        padded_NT[i, : len(piece)] = torch.tensor(piece)
    model.train()
    for _ in range(config.steps):
        rows = torch.randint(len(pieces), (min(config.batch, len(pieces)),), generator=generator)
        batch_NT = padded_NT[rows]
        inputs_NT, targets_NT = batch_NT[:, :-1].clamp(min=0), batch_NT[:, 1:]
        logits_NTV, _ = model(inputs_NT)
        loss = F.cross_entropy(logits_NTV.reshape(-1, config.vocab_size),
                               targets_NT.reshape(-1), ignore_index=-1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return DenseDrafter(model, digest=streams_digest(streams, config))


class DenseDrafter:
    """Drafts with a trained :class:`DenseDraftModel` (see the module doc)."""

    def __init__(self, model: DenseDraftModel, *, digest: str) -> None:
        self.model, self.digest = model, digest

    @property
    def drafter_id(self) -> str:
        c = self.model.config
        return f"dense_gru/h{c.hidden_dim}/{self.digest[:12]}"

    def propose(self, context: Sequence[int], config: DraftConfig) -> Proposal:
        ids = [int(t) for t in context][-self.model.config.context:]
        if not ids:
            raise CandidateError("the dense drafter needs a non-empty context")
        vocab = self.model.config.vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            raise CandidateError(f"context token ids must lie in [0, {vocab})")
        with torch.inference_mode():
            logits_1TV, state = self.model(torch.tensor([ids]))
            logp_V = torch.log_softmax(logits_1TV[0, -1], dim=-1)
            width = min(config.width, vocab)
            first_W = torch.sort(logp_V, descending=True, stable=True).indices[:width]
            tokens, logps = [first_W], [logp_V[first_W]]
            state = state.expand(-1, width, -1).contiguous()
            for _ in range(1, config.depth):
                logits_W1V, state = self.model(tokens[-1].unsqueeze(1), state)
                logp_WV = torch.log_softmax(logits_W1V[:, -1], dim=-1)
                chosen_W = torch.argmax(logp_WV, dim=-1)
                tokens.append(chosen_W)
                logps.append(logp_WV.gather(1, chosen_W.unsqueeze(1)).squeeze(1))
        ids_WB = torch.stack(tokens, dim=1).tolist()
        logp_WB = torch.stack(logps, dim=1).clamp(max=0.0).tolist()
        # distinct first tokens make distinct paths
        return Proposal(self.drafter_id, paths_from_rows(ids_WB, logp_WB))
