"""Drafters behind one interface: W candidate paths of depth at most B at an anchor.

A :class:`Drafter` sees the committed token ids of a thread up to and including the
anchor and proposes up to ``width`` distinct candidate paths, each of 1..``depth``
tokens, every token with the drafter's natural-log probability of it given the context
and the path's earlier tokens. Paths come ranked best first; ``path_id`` is the rank.

- :class:`PromptLookupDrafter` (``prompt_lookup/n<N>``, no model): finds the earlier
  occurrences of the context's last ``n`` tokens (backing off to shorter suffixes when
  none occur) and proposes their continuations. Distinct continuations are ranked by how
  many occurrences share them (then by the most recent occurrence, then by token ids);
  a token's log-probability is the n-gram estimate: the share of the occurrences that
  agree with the path so far which also continue with that token.
- :class:`replay.candidates.self_draft.TeacherSelfDrafter` (``teacher_self``): the
  teacher's own top-W first tokens, greedy below them; the acceptance upper bound.

Pure Python here; the teacher drafter (torch) lives in its own module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.exceptions import CandidateError


def _positive_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """How many candidate paths a drafter proposes and how deep.

    Fields:
        width: W, the most candidate paths per anchor (distinct, ranked best first).
        depth: B, the most tokens per path (the speculative block size).
    """

    width: int = 4
    depth: int = 4

    def __post_init__(self) -> None:
        _positive_int("DraftConfig", "width", self.width)
        _positive_int("DraftConfig", "depth", self.depth)


@dataclass(frozen=True)
class CandidatePath:
    """One candidate path: its tokens (1..B) and the drafter's log-probability of each."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.token_ids or len(self.token_ids) != len(self.logprobs):
            raise CandidateError(
                f"a candidate path needs >= 1 token and one logprob per token, got "
                f"{len(self.token_ids)} tokens and {len(self.logprobs)} logprobs")
        if any(not math.isfinite(p) or p > 0.0 for p in self.logprobs):
            raise CandidateError(f"drafter logprobs must be finite and <= 0, got {self.logprobs}")


@dataclass(frozen=True)
class Proposal:
    """A drafter's paths at one anchor, ranked best first (``path_id`` = index)."""

    drafter_id: str
    paths: tuple[CandidatePath, ...]

    @property
    def depth(self) -> int:
        """The longest path's length (0 when there is no path)."""
        return max((len(p.token_ids) for p in self.paths), default=0)


def paths_from_rows(ids_WB: Sequence[Sequence[int]],
                    logp_WB: Sequence[Sequence[float]]) -> tuple[CandidatePath, ...]:
    """Candidate paths from per-path token ids and log-probabilities, in row order."""
    return tuple(CandidatePath(tuple(int(t) for t in row), tuple(float(p) for p in lp))
                 for row, lp in zip(ids_WB, logp_WB, strict=True))


@runtime_checkable
class Drafter(Protocol):
    """Proposes candidate paths given the committed tokens up to the anchor."""

    @property
    def drafter_id(self) -> str: ...

    def propose(self, context: Sequence[int], config: DraftConfig) -> Proposal: ...


def check_proposal(proposal: Proposal, config: DraftConfig, vocab_size: int) -> None:
    """CandidateError unless ``proposal`` fits ``config`` and the vocabulary."""
    if len(proposal.paths) > config.width:
        raise CandidateError(f"drafter {proposal.drafter_id} proposed {len(proposal.paths)} paths, "
                             f"more than width {config.width}")
    seen = set()
    for path in proposal.paths:
        if len(path.token_ids) > config.depth:
            raise CandidateError(f"drafter {proposal.drafter_id} proposed a path of "
                                 f"{len(path.token_ids)} tokens, deeper than {config.depth}")
        if any(not 0 <= t < vocab_size for t in path.token_ids):
            raise CandidateError(f"drafter {proposal.drafter_id} proposed token ids outside "
                                 f"[0, {vocab_size})")
        if path.token_ids in seen:
            raise CandidateError(f"drafter {proposal.drafter_id} proposed a path twice")
        seen.add(path.token_ids)


class PromptLookupDrafter:
    """Prompt-lookup / n-gram drafter (see the module doc); ``ngram`` is the longest
    suffix looked up, ``min_ngram`` the shortest it backs off to."""

    def __init__(self, *, ngram: int = 3, min_ngram: int = 1) -> None:
        _positive_int("PromptLookupDrafter", "ngram", ngram)
        _positive_int("PromptLookupDrafter", "min_ngram", min_ngram)
        if min_ngram > ngram:
            raise ConfigError(f"PromptLookupDrafter.min_ngram ({min_ngram}) must be <= ngram "
                              f"({ngram})")
        self.ngram, self.min_ngram = ngram, min_ngram

    @property
    def drafter_id(self) -> str:
        return f"prompt_lookup/n{self.ngram}"

    def continuations(self, context: Sequence[int], depth: int) -> list[tuple[int, ...]]:
        """Continuations (most recent first) of the earlier occurrences of the longest
        suffix of ``context`` (``ngram`` down to ``min_ngram`` tokens) that occurs."""
        tokens = [int(t) for t in context]
        for n in range(min(self.ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            found = [tuple(tokens[i + n:i + n + depth])
                     for i in range(len(tokens) - n - 1, -1, -1) if tokens[i:i + n] == suffix]
            if found:
                return found
        return []

    def propose(self, context: Sequence[int], config: DraftConfig) -> Proposal:
        found = self.continuations(context, config.depth)
        counts: dict[tuple[int, ...], int] = {}
        recency: dict[tuple[int, ...], int] = {}
        for rank, continuation in enumerate(found):
            counts[continuation] = counts.get(continuation, 0) + 1
            recency.setdefault(continuation, rank)
        ranked = sorted(counts, key=lambda c: (-counts[c], recency[c], c))[: config.width]
        paths = tuple(CandidatePath(c, _ngram_logprobs(c, found)) for c in ranked)
        return Proposal(self.drafter_id, paths)


def _ngram_logprobs(path: tuple[int, ...], found: Sequence[tuple[int, ...]]) -> tuple[float, ...]:
    """log P(path[j] | context, path[:j]) as the share of occurrences agreeing so far."""
    out = []
    for j in range(len(path)):
        before = [c for c in found if len(c) > j and c[:j] == path[:j]]
        agree = sum(1 for c in before if c[j] == path[j])
        out.append(math.log(agree / len(before)))
    return tuple(out)
