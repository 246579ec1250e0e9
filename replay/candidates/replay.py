"""Candidate-path replay: label every candidate position of every drafted path.

For each anchor of a window, :class:`CandidateReplayer`:

1. builds the committed context (the window's tokens up to and including the anchor,
   at thread ordinals ``first_token_ordinal + index``) and asks the drafter for up to W
   paths of depth at most B;
2. prefills the context ONCE with a KV cache, expands the cache across the W paths and
   runs all paths as one ``[W, B]`` cached forward (:mod:`.kv`). Shorter paths are
   right-padded; a pad sits causally after every real candidate token, so it cannot
   reach a label, and its rows are dropped;
3. captures, from that forward, at every real candidate position and every routed layer:
   the native top-k ids in rank order and their weights (the ids and float32 weights the
   gates EXECUTED under the declared tie-break, as in :mod:`replay.prefill`) and the
   sidecar feature (the pre-attention residual reduced by the same seeded projection as
   clean rows);
4. verifies each path against the teacher's next-token logits under the recorded
   sampling configuration (:mod:`.verify`) for its accepted prefix length and digest.

Rejected suffixes keep their rows (``accepted`` False); nothing here feeds clean-path
state. Anchors whose drafter proposes no path are counted in ``anchors_without_paths``.

Tensor legend: W paths, B candidate positions, R rows (real positions), L routed layers,
K top-k, V vocabulary, H hidden, D feature width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.candidates.drafters import (
    DraftConfig,
    Drafter,
    Proposal,
    check_proposal,
)
from hebrus_flywheel.replay.candidates.kv import expanded, forward_block, prefill_prefix
from hebrus_flywheel.replay.candidates.self_draft import TeacherSelfDrafter
from hebrus_flywheel.replay.candidates.verify import accepted_digest, accepted_length, proposal_id
from hebrus_flywheel.replay.decode import SamplingConfig
from hebrus_flywheel.replay.exceptions import ReplayNumericsError
from hebrus_flywheel.replay.features import FEATURE_DTYPES, FeatureProjection, capture_anchor_rows
from hebrus_flywheel.replay.prefill import PrefillReplayer, ReplayConfig
from hebrus_flywheel.replay.routing import TIE_BREAK_RULE
from hebrus_flywheel.replay.teacher import Teacher


@dataclass(frozen=True, kw_only=True)
class CandidateConfig:
    """What candidate replay proposes, records and verifies with.

    Fields:
        draft: width W and depth B of the drafter's proposals.
        sampling: the recorded sampling configuration verification runs under (greedy
            when ``temperature == 0``; see :mod:`.verify`).
        feature_dim: width D of the sidecar feature (same projection as clean rows).
        projection_seed: seed of that projection.
        feature_dtype: ``float16`` or ``float32``.
        dtype: compute dtype the teacher must have been loaded with.
    """

    draft: DraftConfig = field(default_factory=DraftConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    feature_dim: int = 64
    projection_seed: int = 0
    feature_dtype: str = "float16"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.draft, DraftConfig):
            raise ConfigError(f"draft must be a DraftConfig, got {self.draft!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ConfigError(f"sampling must be a SamplingConfig, got {self.sampling!r}")
        ReplayConfig(feature_dim=self.feature_dim, projection_seed=self.projection_seed,
                     feature_dtype=self.feature_dtype, dtype=self.dtype)  # same field checks


@dataclass(frozen=True, eq=False)
class AnchorCandidates:
    """The labelled paths of one anchor; one row per (path, real candidate position).

    Row arrays (R rows, ordered by path then position): ``path_id_R``, ``position_R``
    (1..B), ``token_id_R``, ``logprob_R``, ``expert_ids_RLK`` (uint16, rank 0 first),
    ``weights_RLK`` (float32), ``features_RLD``. Per path (W): ``accepted_W`` and
    ``digests`` (hex, of the accepted token ids).
    """

    window_id: str
    split: str
    owner: str
    thread: str
    generation: int
    identity_id: str
    domain_tags: tuple[str, ...]
    proposal_id: str
    anchor_ordinal: int
    drafter_id: str
    path_id_R: np.ndarray
    position_R: np.ndarray
    token_id_R: np.ndarray
    logprob_R: np.ndarray
    expert_ids_RLK: np.ndarray
    weights_RLK: np.ndarray
    features_RLD: np.ndarray
    accepted_W: np.ndarray
    digests: tuple[str, ...]

    @property
    def accepted_R(self) -> np.ndarray:
        """Per row: the candidate position lies inside its path's accepted prefix."""
        return self.position_R <= self.accepted_W[self.path_id_R]

    @property
    def label_count(self) -> int:
        return int(self.expert_ids_RLK.shape[0] * self.expert_ids_RLK.shape[1])


@dataclass
class CandidateStats:
    """Counts of one replay call (for benches and the worker's log)."""

    anchors: int = 0
    anchors_without_paths: int = 0
    paths: int = 0
    rows: int = 0
    accepted_tokens: int = 0
    forwards: int = 0


class CandidateReplayer:
    """Candidate-path replay of windows with one drafter (see the module doc)."""

    def __init__(self, teacher: Teacher, drafter: Drafter, config: CandidateConfig | None = None,
                 *, identity: Mapping[str, Any] | None = None) -> None:
        config = config or CandidateConfig()
        clean = PrefillReplayer(teacher, ReplayConfig(
            feature_dim=config.feature_dim, projection_seed=config.projection_seed,
            feature_dtype=config.feature_dtype, dtype=config.dtype), identity=identity)
        self.teacher, self.drafter, self.config = teacher, drafter, config
        self.identity_id = clean.identity_id
        self.identity = clean.identity
        self._clean = clean
        self.projection: FeatureProjection = clean.projection
        self._projection_HD = torch.from_numpy(np.array(self.projection.matrix_HD))
        self._pad_id = clean._pad_id
        self.stats = CandidateStats()

    def candidate_contract(self) -> dict[str, Any]:
        """JSON-ready record of what decides the candidate rows' bytes."""
        return {**self._clean.replay_contract(), "product": "candidate_path",
                "drafter_id": self.drafter.drafter_id, "draft": asdict(self.config.draft),
                "sampling": asdict(self.config.sampling), "tie_break_rule": TIE_BREAK_RULE,
                "verification": "greedy argmax" if self.config.sampling.temperature == 0
                else "rejection sampling seeded by sha256(proposal_id|path_id)"}

    def replay(self, windows: Sequence[Mapping[str, Any]]) -> list[list[AnchorCandidates]]:
        """Per window (input order), its anchors' candidates; windows are checked first."""
        prepared = [self._clean._prepare(i, w) for i, w in enumerate(windows)]
        out = []
        for item in prepared:
            w, anchors = item.window, []
            for position in item.anchors_A.tolist():
                context = item.token_ids[: position + 1].tolist()
                got = self.replay_anchor(w, context, item.first_ordinal)
                if got is not None:
                    anchors.append(got)
            out.append(anchors)
        return out

    def propose(self, context: list[int], first_ordinal: int) -> Proposal:
        if isinstance(self.drafter, TeacherSelfDrafter):
            proposal = self.drafter.propose_at(context, self.config.draft,
                                               first_ordinal=first_ordinal)
        else:
            proposal = self.drafter.propose(context, self.config.draft)
        check_proposal(proposal, self.config.draft, self.teacher.vocab_size)
        return proposal

    def replay_anchor(self, window: Mapping[str, Any], context: list[int],
                      first_ordinal: int) -> AnchorCandidates | None:
        """Label the drafter's paths after ``context``; None when it proposes none."""
        self.stats.anchors += 1
        proposal = self.propose(context, first_ordinal)
        if not proposal.paths:
            self.stats.anchors_without_paths += 1
            return None
        anchor_ordinal = first_ordinal + len(context) - 1
        pid = proposal_id(str(window["window_id"]), anchor_ordinal, proposal.drafter_id)
        ids_WB, rows_R = self._block(proposal)
        with torch.inference_mode():
            cache, last_V = prefill_prefix(self.teacher, context, first_ordinal)
            cache = expanded(cache, len(proposal.paths))
            with capture_anchor_rows(self.teacher, rows_R) as capture:
                logits_WBV = forward_block(self.teacher, cache, ids_WB, anchor_ordinal + 1)
                ids_RLK, weights_RLK, hidden_RLH = self._routes(capture)
            features = (hidden_RLH.to(torch.float32) @ self._projection_HD).numpy()
        self.stats.forwards += 2
        accepted, digests = self._verify(proposal, last_V, logits_WBV, pid)
        return self._anchor(window, proposal, pid, anchor_ordinal, ids_RLK, weights_RLK,
                            features, accepted, digests)

    def _block(self, proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids_WB right-padded, rows_R)``: flat ``w * B + j`` rows of real tokens."""
        width, depth = len(proposal.paths), proposal.depth
        ids_WB = torch.full((width, depth), self._pad_id, dtype=torch.long)
        rows = []
        for w, path in enumerate(proposal.paths):
            ids_WB[w, : len(path.token_ids)] = torch.tensor(path.token_ids, dtype=torch.long)
            rows += [w * depth + j for j in range(len(path.token_ids))]
        return ids_WB, torch.tensor(rows, dtype=torch.long, device=self.teacher.model.device)

    def _routes(self, capture: Any) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        layers = self.teacher.geometry.routed_layer_count
        logits_RLE, hidden_RLH = (t.cpu() for t in capture.stacked(layers))
        executed = capture.executed(layers) if self.teacher.exact_tie_break else None
        if executed is None:
            ids_RLK, weights_RLK = self.teacher.route(logits_RLE)
        else:
            ids_RLK, weights_RLK = executed[0].cpu(), executed[1].cpu()
            if weights_RLK.dtype != torch.float32:
                weights_RLK = self.teacher.weights_of(logits_RLE, ids_RLK)
        ids = ids_RLK.numpy()
        if ids.size and int(ids.max()) > np.iinfo(np.uint16).max:
            raise ReplayNumericsError("expert ids exceed uint16")
        return ids.astype(np.uint16), weights_RLK.numpy().astype(np.float32), hidden_RLH

    def _verify(self, proposal: Proposal, last_V: torch.Tensor, logits_WBV: torch.Tensor,
                pid: str) -> tuple[np.ndarray, tuple[str, ...]]:
        accepted, digests = [], []
        for w, path in enumerate(proposal.paths):
            depth = len(path.token_ids)
            logits_BV = torch.cat([last_V.unsqueeze(0), logits_WBV[w, : depth - 1]])
            n = accepted_length(logits_BV, path.token_ids, path.logprobs, self.config.sampling,
                                proposal=pid, path_id=w)
            accepted.append(n)
            digests.append(accepted_digest(path.token_ids[:n]))
        return np.asarray(accepted, dtype=np.int32), tuple(digests)

    def _anchor(self, window: Mapping[str, Any], proposal: Proposal, pid: str,
                anchor_ordinal: int, ids_RLK: np.ndarray, weights_RLK: np.ndarray,
                features_RLD: np.ndarray, accepted_W: np.ndarray,
                digests: tuple[str, ...]) -> AnchorCandidates:
        features = features_RLD.astype(FEATURE_DTYPES[self.config.feature_dtype])
        if not np.isfinite(features).all():
            raise ReplayNumericsError(
                f"candidate features of window {window['window_id']} are not finite in "
                f"{self.config.feature_dtype}; use feature_dtype='float32'")
        paths = proposal.paths
        path_R = np.concatenate([np.full(len(p.token_ids), w, np.int32)
                                 for w, p in enumerate(paths)])
        self.stats.paths += len(paths)
        self.stats.rows += len(path_R)
        self.stats.accepted_tokens += int(accepted_W.sum())
        return AnchorCandidates(
            window_id=str(window["window_id"]), split=str(window["split"]),
            owner=str(window["owner"]), thread=str(window["thread"]),
            generation=int(window["generation"]), identity_id=self.identity_id,
            domain_tags=tuple(str(t) for t in window["domain_tags"]), proposal_id=pid,
            anchor_ordinal=anchor_ordinal, drafter_id=proposal.drafter_id, path_id_R=path_R,
            position_R=np.concatenate([np.arange(1, len(p.token_ids) + 1, dtype=np.int32)
                                       for p in paths]),
            token_id_R=np.concatenate([np.asarray(p.token_ids, np.int32) for p in paths]),
            logprob_R=np.concatenate([np.asarray(p.logprobs, np.float32) for p in paths]),
            expert_ids_RLK=ids_RLK, weights_RLK=weights_RLK, features_RLD=features,
            accepted_W=accepted_W, digests=digests,
        )
