"""Drafters and verification of candidate paths (pure, no model)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.candidates.drafters import (
    CandidatePath,
    DraftConfig,
    Drafter,
    PromptLookupDrafter,
    Proposal,
    check_proposal,
)
from hebrus_flywheel.replay.candidates.verify import (
    accepted_digest,
    accepted_length,
    proposal_id,
)
from hebrus_flywheel.replay.decode import SamplingConfig
from hebrus_flywheel.replay.exceptions import CandidateError


def test_prompt_lookup_ranks_distinct_continuations_by_count() -> None:
    # "1 2 3" occurs three times before the end: twice followed by 7 8, once by 9 9.
    context = [1, 2, 3, 7, 8, 5, 1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    proposal = PromptLookupDrafter(ngram=3).propose(context, DraftConfig(width=4, depth=2))
    assert proposal.drafter_id == "prompt_lookup/n3"
    assert [p.token_ids for p in proposal.paths] == [(7, 8), (9, 9)]
    first, second = proposal.paths
    assert first.logprobs == pytest.approx((math.log(2 / 3), 0.0))
    assert second.logprobs == pytest.approx((math.log(1 / 3), 0.0))
    assert isinstance(PromptLookupDrafter(), Drafter)


def test_prompt_lookup_respects_width_depth_and_backs_off() -> None:
    context = [4, 1, 5, 4, 2, 6, 4, 3, 7, 9, 4]
    # no earlier "7 9 4" or "9 4": backs off to "4", whose continuations all differ.
    proposal = PromptLookupDrafter(ngram=3).propose(context, DraftConfig(width=2, depth=3))
    assert [p.token_ids for p in proposal.paths] == [(3, 7, 9), (2, 6, 4)]  # ties: most recent
    assert all(len(p.token_ids) <= 3 for p in proposal.paths)
    assert PromptLookupDrafter(ngram=2, min_ngram=2).propose(
        context, DraftConfig()).paths == ()
    assert PromptLookupDrafter().propose([5], DraftConfig()).paths == ()


def test_prompt_lookup_continuation_may_be_cut_by_the_anchor() -> None:
    context = [1, 2, 1, 2]  # the occurrence at 0 continues "1 2" (depth 3 would pass the end)
    proposal = PromptLookupDrafter(ngram=2).propose(context, DraftConfig(width=2, depth=3))
    assert [p.token_ids for p in proposal.paths] == [(1, 2)]


def test_configs_and_paths_are_validated() -> None:
    with pytest.raises(ConfigError, match="width"):
        DraftConfig(width=0)
    with pytest.raises(ConfigError, match="min_ngram"):
        PromptLookupDrafter(ngram=1, min_ngram=2)
    with pytest.raises(CandidateError):
        CandidatePath((1, 2), (0.0,))
    with pytest.raises(CandidateError):
        CandidatePath((1,), (0.5,))
    path = CandidatePath((1, 2, 3), (0.0, 0.0, 0.0))
    with pytest.raises(CandidateError, match="deeper"):
        check_proposal(Proposal("d", (path,)), DraftConfig(depth=2), 10)
    with pytest.raises(CandidateError, match="outside"):
        check_proposal(Proposal("d", (path,)), DraftConfig(), 3)
    with pytest.raises(CandidateError, match="twice"):
        check_proposal(Proposal("d", (path, path)), DraftConfig(), 10)
    with pytest.raises(CandidateError, match="width"):
        check_proposal(Proposal("d", (path, CandidatePath((4,), (0.0,)))),
                       DraftConfig(width=1), 10)


def _logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    return logits


def test_greedy_acceptance_is_the_longest_prefix_equal_to_the_argmax() -> None:
    greedy = SamplingConfig()
    logits = _logits([3, 4, 5])
    zero = (0.0, 0.0, 0.0)
    assert accepted_length(logits, (3, 4, 5), zero, greedy, proposal="p", path_id=0) == 3
    assert accepted_length(logits, (3, 4, 6), zero, greedy, proposal="p", path_id=0) == 2
    assert accepted_length(logits, (2, 4, 5), zero, greedy, proposal="p", path_id=0) == 0


def test_sampled_acceptance_is_deterministic_per_proposal_and_path() -> None:
    sampling = SamplingConfig(temperature=1.0)
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    tokens, logps = (1, 2, 3, 4, 5, 6), (-2.0,) * 6
    runs = {accepted_length(logits, tokens, logps, sampling, proposal=f"p{i}", path_id=0)
            for i in range(40)}
    assert len(runs) > 1  # the seed matters ...
    again = [accepted_length(logits, tokens, logps, sampling, proposal="p7", path_id=0)
             for _ in range(3)]
    assert len(set(again)) == 1  # ... and fixes the answer
    # a token the filters remove has p = 0 and is always rejected
    top1 = SamplingConfig(temperature=1.0, top_k=1)
    best = int(torch.argmax(logits[0]))
    other = (best + 1) % 16
    assert accepted_length(logits, (other,), (0.0,), top1, proposal="p", path_id=0) == 0
    assert accepted_length(logits, (best,), (0.0,), top1, proposal="p", path_id=0) == 1


def test_ids_and_digests() -> None:
    assert proposal_id("w", 7, "teacher_self") == hashlib.sha256(b"w|7|teacher_self").hexdigest()
    assert accepted_digest([]) == hashlib.sha256(b"").hexdigest()
    assert accepted_digest([1, 258]) == hashlib.sha256(
        np.asarray([1, 258], "<i4").tobytes()).hexdigest()
