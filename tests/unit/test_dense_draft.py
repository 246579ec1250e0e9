"""The dense draft model: learns a token stream, drafts W x B paths, deterministic."""

from __future__ import annotations

import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.candidates.dense_draft import DenseDraftConfig, train_dense_drafter
from hebrus_flywheel.replay.candidates.drafters import DraftConfig, check_proposal
from hebrus_flywheel.replay.exceptions import CandidateError

PATTERN = list(range(1, 10))
CONFIG = DenseDraftConfig(vocab_size=40, embed_dim=16, hidden_dim=32, context=12, steps=150,
                          batch=8, lr=1e-2)


def streams() -> list[list[int]]:
    return [PATTERN * 6, [30, 31, 32, 33] * 5]


def test_it_learns_the_streams_and_drafts_ranked_distinct_paths() -> None:
    drafter = train_dense_drafter(streams(), CONFIG)
    proposal = drafter.propose([5, 6, 7, 8, 9, 1, 2, 3], DraftConfig(width=3, depth=4))
    check_proposal(proposal, DraftConfig(width=3, depth=4), CONFIG.vocab_size)
    assert proposal.paths[0].token_ids == (4, 5, 6, 7)  # the stream's continuation first
    assert len({p.token_ids[0] for p in proposal.paths}) == 3
    assert all(lp <= 0 for p in proposal.paths for lp in p.logprobs)
    assert proposal.paths[0].logprobs[0] > proposal.paths[1].logprobs[0]
    assert drafter.drafter_id.startswith("dense_gru/h32/")


def test_same_streams_and_config_give_the_same_weights_and_id() -> None:
    first, again = train_dense_drafter(streams(), CONFIG), train_dense_drafter(streams(), CONFIG)
    assert first.drafter_id == again.drafter_id
    for (name, a), (_, b) in zip(first.model.state_dict().items(),
                                 again.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    other = train_dense_drafter([PATTERN * 6], CONFIG)
    assert other.drafter_id != first.drafter_id  # the training data is part of the id


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(CandidateError, match="at least one stream"):
        train_dense_drafter([[1]], CONFIG)
    with pytest.raises(CandidateError, match=r"\[0, 40\)"):
        train_dense_drafter([[1, 2, 99]], CONFIG)
    drafter = train_dense_drafter(streams(), CONFIG)
    with pytest.raises(CandidateError, match="non-empty"):
        drafter.propose([], DraftConfig())
    with pytest.raises(ConfigError, match="hidden_dim"):
        DenseDraftConfig(vocab_size=4, hidden_dim=0)
