"""The drafters of a candidate job, built on the job's sealed clean epoch and teacher."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers.candidate_jobs import CandidateJob

log = logging.getLogger(__name__)

DRAFTERS = ("prompt_lookup", "dense", "teacher_self")
"""Drafter names a job may use: n-gram lookup (no model), the dense draft model trained
on the snapshot's train split, teacher self-drafting (the upper bound)."""


def build_replayers(job: CandidateJob, manifest: Mapping[str, Any], bundle: Any) -> list[Any]:
    """One :class:`CandidateReplayer` per drafter of ``job``, with the snapshot's feature
    projection and dtype."""
    from hebrus_flywheel.replay.candidates.drafters import (
        DraftConfig,
        Drafter,
        PromptLookupDrafter,
    )
    from hebrus_flywheel.replay.candidates.replay import CandidateConfig, CandidateReplayer
    from hebrus_flywheel.replay.candidates.self_draft import TeacherSelfDrafter

    rc = manifest["determinism"]["replay_config"]["replay_config"]
    candidate = CandidateConfig(
        draft=DraftConfig(width=job.width, depth=job.depth),
        feature_dim=int(rc["feature_dim"]), projection_seed=int(rc["projection_seed"]),
        feature_dtype=str(rc["feature_dtype"]), dtype=str(manifest["determinism"]["dtype"]))
    teacher = bundle.teacher

    def drafter(name: str) -> Drafter:
        if name == "teacher_self":
            return TeacherSelfDrafter(teacher)
        if name == "dense":
            return _dense_drafter(Path(job.snapshot), teacher.vocab_size)
        return PromptLookupDrafter(ngram=3)

    return [CandidateReplayer(teacher, drafter(name), candidate, identity=bundle.identity)
            for name in job.drafters]


def train_streams(snapshot: Path) -> list[list[int]]:
    """The train split's committed token streams in a sealed clean snapshot: per thread
    generation, its labelled tokens in ordinal order, cut where ordinals skip (a user or
    tool turn the rows do not hold)."""
    from hebrus_flywheel.core.snapshot import open_snapshot

    opened = open_snapshot(Path(snapshot))
    tokens: dict[tuple[str, str, int], dict[int, int]] = {}
    columns = ["split", "owner", "thread", "generation", "token_ordinal", "token_id"]
    for index in range(len(opened.manifest.shards)):
        table = opened.read_shard(index, columns).to_pydict()
        for split, owner, thread, gen, ordinal, token in zip(*(table[c] for c in columns),
                                                              strict=True):
            if split == "train":
                tokens.setdefault((owner, thread, int(gen)), {})[int(ordinal)] = int(token)
    streams: list[list[int]] = []
    for key in sorted(tokens):
        run: list[int] = []
        last = None
        for ordinal, token in sorted(tokens[key].items()):
            if last is not None and ordinal != last + 1:
                streams.append(run)
                run = []
            run.append(token)
            last = ordinal
        streams.append(run)
    return [s for s in streams if len(s) >= 2]


def _dense_drafter(snapshot: Path, vocab_size: int) -> Any:
    from hebrus_flywheel.replay.candidates.dense_draft import (
        DenseDraftConfig,
        train_dense_drafter,
    )

    drafter = train_dense_drafter(train_streams(snapshot), DenseDraftConfig(vocab_size=vocab_size))
    log.info("dense drafter %s trained on the train split of %s", drafter.drafter_id, snapshot)
    return drafter
