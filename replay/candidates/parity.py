"""Candidate-path parity (Gate 1): block replay versus step-by-step decode with a KV cache.

For every anchor the candidate replayer labelled, the reference runs the SAME committed
prefix and the SAME candidate paths through the real decode runtime
(:class:`replay.decode.DecodeRuntime`, teacher-forced: one prefill, then one cached
single-token forward per candidate token) and compares, per (candidate row, routed
layer), the top-k expert SET (``candidate_ids_exact``) and the ids in rank order
(``candidate_rank_exact``); weights within ``weight_atol``. A second step-by-step cached
decode keeps the teacher's next-token logits at each candidate position and verifies
each path with the same rule (:mod:`.verify`); ``accepted_prefix_digest_parity`` is the
share of paths whose accepted-prefix digests agree.

The result is a plain dict shaped like :class:`replay.parity.ParityResult`'s ``to_dict``
(identity, dtype, rules, counts, ``authoritative``) so Gate 1 reads it the same way;
``authoritative`` needs all three rates at exactly 1.0 over a non-empty sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hebrus_flywheel.replay.candidates.kv import forward_block, prefill_prefix
from hebrus_flywheel.replay.candidates.replay import AnchorCandidates, CandidateReplayer
from hebrus_flywheel.replay.candidates.verify import accepted_digest, accepted_length
from hebrus_flywheel.replay.decode import DecodeRuntime
from hebrus_flywheel.replay.routing import TIE_BREAK_RULE


@dataclass
class _Tally:
    anchors: int = 0
    paths: int = 0
    rows: int = 0
    pairs: int = 0
    set_mismatches: int = 0
    rank_mismatches: int = 0
    digest_matches: int = 0
    weight_violations: int = 0
    max_weight_diff: float = 0.0
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: _Tally) -> None:
        for name in ("anchors", "paths", "rows", "pairs", "set_mismatches",
                     "rank_mismatches", "digest_matches", "weight_violations"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_weight_diff = max(self.max_weight_diff, other.max_weight_diff)
        self.examples += other.examples[: max(0, 20 - len(self.examples))]


def step_logits(replayer: CandidateReplayer, prefix: list[int], first_ordinal: int,
                tokens: Sequence[int]) -> torch.Tensor:
    """Next-token logits ``[len(tokens), V]`` by step-by-step cached decode: row 0 after
    the prefix, row j after feeding ``tokens[:j]`` one token per forward."""
    teacher = replayer.teacher
    with torch.inference_mode():
        cache, last_V = prefill_prefix(teacher, prefix, first_ordinal)
        rows = [last_V]
        for j, token in enumerate(tokens[:-1]):
            ids = torch.tensor([[int(token)]], dtype=torch.long)
            rows.append(forward_block(teacher, cache, ids, first_ordinal + len(prefix) + j)[0, -1])
    return torch.stack(rows)


def _compare_anchor(replayer: CandidateReplayer, runtime: DecodeRuntime, context: list[int],
                    first_ordinal: int, anchor: AnchorCandidates, tally: _Tally,
                    weight_atol: float) -> None:
    tally.anchors += 1
    for w in range(len(anchor.digests)):
        rows = np.flatnonzero(anchor.path_id_R == w)
        tokens = anchor.token_id_R[rows].astype(int).tolist()
        turn = runtime.decode_turn(context, forced_ids=tokens)
        ref_ids = turn.expert_ids_TLK.astype(np.int64)
        got_ids = anchor.expert_ids_RLK[rows].astype(np.int64)
        rank_bad = (ref_ids != got_ids).any(-1)
        set_bad = ~(np.sort(ref_ids, -1) == np.sort(got_ids, -1)).all(-1)
        diff = np.abs(turn.weights_TLK - anchor.weights_RLK[rows]).max(-1)[~rank_bad]
        tally.paths += 1
        tally.rows += len(rows)
        tally.pairs += rank_bad.size
        tally.rank_mismatches += int(rank_bad.sum())
        tally.set_mismatches += int(set_bad.sum())
        if diff.size:
            tally.weight_violations += int((diff > weight_atol).sum())
            tally.max_weight_diff = max(tally.max_weight_diff, float(diff.max()))
        logits_BV = step_logits(replayer, context, first_ordinal, tokens)
        logprobs = anchor.logprob_R[rows].astype(float).tolist()
        n = accepted_length(logits_BV, tokens, logprobs, replayer.config.sampling,
                            proposal=anchor.proposal_id, path_id=w)
        same = accepted_digest(tokens[:n]) == anchor.digests[w] and n == anchor.accepted_W[w]
        tally.digest_matches += int(same)
        if (rank_bad.any() or not same) and len(tally.examples) < 20:
            tally.examples.append({
                "proposal_id": anchor.proposal_id, "path_id": w,
                "rank_mismatch_rows": np.flatnonzero(rank_bad.any(-1)).tolist(),
                "replay_accepted": int(anchor.accepted_W[w]), "decode_accepted": n})


def run_candidate_parity(replayers: CandidateReplayer | Sequence[CandidateReplayer],
                         windows: Sequence[Mapping[str, Any]], *, weight_atol: float = 1e-4,
                         min_sample: int = 1) -> dict[str, Any]:
    """Replay ``windows``' candidates with every replayer (one per drafter) and compare
    them with step-by-step decode: one result over all of them, authoritative only when
    each drafter's own is, with ``per_drafter`` rates."""
    group = [replayers] if isinstance(replayers, CandidateReplayer) else list(replayers)
    if not group:
        raise ValueError("run_candidate_parity needs at least one replayer")
    runtime = DecodeRuntime(group[0].teacher)
    total, per_drafter = _Tally(), {}
    for replayer in group:
        tally = _Tally()
        for window, anchors in zip(windows, replayer.replay(windows), strict=True):
            tokens = [int(t) for t in window["token_ids"]]
            first = int(window["first_token_ordinal"])
            for anchor in anchors:
                context = tokens[: anchor.anchor_ordinal - first + 1]
                _compare_anchor(replayer, runtime, context, first, anchor, tally, weight_atol)
        own = _result(replayer, tally, weight_atol, min_sample)
        per_drafter[own["drafter_id"]] = {k: own[k] for k in _PER_DRAFTER}
        total.add(tally)
    result = _result(group[0], total, weight_atol, min_sample)
    result["authoritative"] = all(r["authoritative"] for r in per_drafter.values())
    result["drafter_id"] = ",".join(per_drafter)
    result["per_drafter"] = per_drafter
    return result


_PER_DRAFTER = ("authoritative", "anchors", "paths", "pairs", "candidate_ids_exact",
                "candidate_rank_exact", "accepted_prefix_digest_parity")


def _rate(good: int, total: int) -> float:
    return good / total if total else 0.0


def _result(replayer: CandidateReplayer, t: _Tally, weight_atol: float,
            min_sample: int) -> dict[str, Any]:
    ids_exact = _rate(t.pairs - t.set_mismatches, t.pairs)
    rank_exact = _rate(t.pairs - t.rank_mismatches, t.pairs)
    digest = _rate(t.digest_matches, t.paths)
    teacher = replayer.teacher
    authoritative = (t.anchors >= min_sample and t.pairs > 0 and ids_exact == 1.0
                     and rank_exact == 1.0 and digest == 1.0 and t.weight_violations == 0)
    return {
        "authoritative": authoritative, "product": "candidate_path",
        "identity_id": replayer.identity_id, "teacher_dtype": teacher.dtype,
        "tie_break_rule": TIE_BREAK_RULE, "weight_rule": teacher.geometry.weight_rule,
        "kernel_path": str(getattr(teacher, "kernel_path", "")),
        "drafter_id": replayer.drafter.drafter_id, "min_sample": min_sample,
        "weight_atol": weight_atol, "anchors": t.anchors, "paths": t.paths, "rows": t.rows,
        "pairs": t.pairs, "set_mismatches": t.set_mismatches,
        "rank_mismatches": t.rank_mismatches, "weight_violations": t.weight_violations,
        "max_weight_abs_diff": t.max_weight_diff if t.pairs else None,
        "candidate_ids_exact": ids_exact, "candidate_rank_exact": rank_exact,
        "accepted_prefix_digest_parity": digest, "digest_matches": t.digest_matches,
        "examples": t.examples,
    }
