"""Candidate-path replay on the tiny fp32 teacher: labels, verification, and Gate 1 parity
against step-by-step KV-cache decode of the same prefix and candidates."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.candidates.drafters import (
    CandidatePath,
    DraftConfig,
    PromptLookupDrafter,
    Proposal,
)
from hebrus_flywheel.replay.candidates.parity import run_candidate_parity
from hebrus_flywheel.replay.candidates.replay import (
    AnchorCandidates,
    CandidateConfig,
    CandidateReplayer,
)
from hebrus_flywheel.replay.candidates.self_draft import TeacherSelfDrafter
from hebrus_flywheel.replay.decode import SamplingConfig
from hebrus_flywheel.replay.prefill import PrefillReplayer
from hebrus_flywheel.replay.teacher import Teacher, load_teacher
from tests.unit.test_prefill import make_window

CONFIG = CandidateConfig(draft=DraftConfig(width=3, depth=4))


@pytest.fixture(scope="module")
def teacher(teacher_dir: Path) -> Teacher:
    return load_teacher(teacher_dir)


def looping_tokens(length: int) -> list[int]:
    """A thread that repeats itself, so prompt lookup finds continuations."""
    base = np.random.default_rng(3).integers(5, 4000, 23).tolist()
    tokens = (base * (length // len(base) + 1))[:length]
    tokens[40] = 17  # one earlier occurrence continues differently
    return tokens


def window(identity_id: str, anchors: Sequence[int] = (50, 70), first: int = 0) -> dict[str, Any]:
    return make_window(identity_id, looping_tokens(80), anchors, first=first)


class FixedDrafter:
    """Proposes the given paths whatever the context (uneven depths on purpose)."""

    drafter_id = "fixed"

    def __init__(self, paths: Sequence[Sequence[int]]) -> None:
        self.paths = tuple(CandidatePath(tuple(p), (-1.0,) * len(p)) for p in paths)

    def propose(self, context: Sequence[int], config: DraftConfig) -> Proposal:
        return Proposal(self.drafter_id, self.paths)


def test_rows_lineage_and_shapes(teacher: Teacher) -> None:
    replayer = CandidateReplayer(teacher, PromptLookupDrafter(ngram=3), CONFIG)
    w = window(replayer.identity_id, first=100)
    [anchors] = replayer.replay([w])
    assert [a.anchor_ordinal for a in anchors] == [150, 170]
    g = teacher.geometry
    for a in anchors:
        rows = len(a.path_id_R)
        assert a.expert_ids_RLK.shape == (rows, g.routed_layer_count, g.top_k)
        assert a.expert_ids_RLK.dtype == np.uint16 and a.weights_RLK.dtype == np.float32
        assert a.features_RLD.shape == (rows, g.routed_layer_count, 64)
        assert (a.window_id, a.owner, a.split) == (w["window_id"], "owner-a", "train")
        assert a.drafter_id == "prompt_lookup/n3" and len(a.proposal_id) == 64
        for path in range(len(a.digests)):
            positions = a.position_R[a.path_id_R == path]
            assert positions.tolist() == list(range(1, len(positions) + 1))
        np.testing.assert_array_equal(a.accepted_R,
                                      a.position_R <= a.accepted_W[a.path_id_R])
    # the looping thread's true continuation is the top path at the second anchor
    tokens = w["token_ids"]
    top = anchors[1].token_id_R[anchors[1].path_id_R == 0].tolist()
    assert top == tokens[71:75]
    assert replayer.stats.anchors == 2 and replayer.stats.rows == sum(
        len(a.path_id_R) for a in anchors)


def test_teacher_self_drafting_is_the_greedy_upper_bound(teacher: Teacher) -> None:
    replayer = CandidateReplayer(teacher, TeacherSelfDrafter(teacher), CONFIG)
    [anchors] = replayer.replay([window(replayer.identity_id)])
    for a in anchors:
        assert a.accepted_W.tolist() == [4, 0, 0]
        assert a.accepted_R.sum() == 4 and (~a.accepted_R).sum() == 8  # rejected rows kept
        assert (a.logprob_R <= 0).all()
        firsts = a.token_id_R[a.position_R == 1]
        assert len(set(firsts.tolist())) == 3


def test_path_routes_equal_clean_replay_when_the_path_is_the_committed_continuation(
        teacher: Teacher) -> None:
    tokens = looping_tokens(80)
    oracle = FixedDrafter([tokens[51:55]])
    replayer = CandidateReplayer(teacher, oracle, CONFIG)
    w = make_window(replayer.identity_id, tokens, [50])
    [[anchor]] = replayer.replay([w])
    clean = PrefillReplayer(teacher).replay(
        [make_window(replayer.identity_id, tokens, [51, 52, 53, 54])])[0]
    np.testing.assert_array_equal(anchor.expert_ids_RLK, clean.expert_ids_ALK)
    np.testing.assert_allclose(anchor.weights_RLK, clean.weights_ALK, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("which", ["prompt_lookup", "teacher_self", "uneven"])
def test_parity_with_step_by_step_decode_is_exact(teacher: Teacher, which: str,
                                                 temperature: float) -> None:
    drafter: Any = {"prompt_lookup": PromptLookupDrafter(ngram=3),
                    "teacher_self": TeacherSelfDrafter(teacher),
                    "uneven": FixedDrafter([[9, 10, 11, 12], [13], [14, 15]])}[which]
    config = CandidateConfig(draft=DraftConfig(width=3, depth=4),
                             sampling=SamplingConfig(temperature=temperature))
    replayer = CandidateReplayer(teacher, drafter, config)
    result = run_candidate_parity(replayer, [window(replayer.identity_id)])
    assert result["pairs"] > 0, result
    assert result["candidate_ids_exact"] == 1.0, result["examples"]
    assert result["candidate_rank_exact"] == 1.0, result["examples"]
    assert result["accepted_prefix_digest_parity"] == 1.0, result["examples"]
    assert result["authoritative"] is True
    assert result["product"] == "candidate_path"


def test_parity_over_several_drafters_sums_them_and_needs_each_exact(
        teacher: Teacher, monkeypatch: pytest.MonkeyPatch) -> None:
    lookup = CandidateReplayer(teacher, PromptLookupDrafter(ngram=3), CONFIG)
    self_draft = CandidateReplayer(teacher, TeacherSelfDrafter(teacher), CONFIG)
    alone = [run_candidate_parity(r, [window(r.identity_id)]) for r in (lookup, self_draft)]
    both = run_candidate_parity([lookup, self_draft], [window(lookup.identity_id)])
    assert both["pairs"] == sum(r["pairs"] for r in alone) > 0
    assert both["paths"] == sum(r["paths"] for r in alone)
    assert both["authoritative"] and both["drafter_id"] == "prompt_lookup/n3,teacher_self"
    assert set(both["per_drafter"]) == {"prompt_lookup/n3", "teacher_self"}
    honest = self_draft.replay

    def tampered(windows: Sequence[dict[str, Any]]) -> list[list[AnchorCandidates]]:
        out = honest(windows)
        out[0][0].accepted_W[0] = 0
        return out

    monkeypatch.setattr(self_draft, "replay", tampered)
    bad = run_candidate_parity([lookup, self_draft], [window(lookup.identity_id)])
    assert not bad["authoritative"] and bad["per_drafter"]["prompt_lookup/n3"]["authoritative"]
    assert bad["accepted_prefix_digest_parity"] < 1.0


def test_parity_notices_a_wrong_rank_and_a_wrong_accepted_length(
        teacher: Teacher, monkeypatch: pytest.MonkeyPatch) -> None:
    replayer = CandidateReplayer(teacher, TeacherSelfDrafter(teacher), CONFIG)
    honest = replayer.replay

    def tampered(windows: Sequence[dict[str, Any]]) -> list[list[AnchorCandidates]]:
        out = honest(windows)
        first = out[0][0]
        first.expert_ids_RLK[0, 0, [0, 1]] = first.expert_ids_RLK[0, 0, [1, 0]]
        first.accepted_W[1] = 1
        return out

    monkeypatch.setattr(replayer, "replay", tampered)
    result = run_candidate_parity(replayer, [window(replayer.identity_id)])
    assert result["candidate_ids_exact"] == 1.0  # same set, other order
    assert result["candidate_rank_exact"] < 1.0
    assert result["accepted_prefix_digest_parity"] < 1.0
    assert result["authoritative"] is False and result["examples"]


def test_config_is_validated(teacher: Teacher) -> None:
    with pytest.raises(ConfigError, match="feature_dtype"):
        CandidateConfig(feature_dtype="int8")
    with pytest.raises(ConfigError, match="dtype"):
        CandidateReplayer(teacher, PromptLookupDrafter(), CandidateConfig(dtype="bfloat16"))
    contract = CandidateReplayer(teacher, PromptLookupDrafter(), CONFIG).candidate_contract()
    assert contract["product"] == "candidate_path"
    assert contract["drafter_id"] == "prompt_lookup/n3"
    assert contract["draft"] == {"width": 3, "depth": 4}
