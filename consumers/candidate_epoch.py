"""``flywheel replay candidates``: the candidate-path product of a sealed clean epoch.

The candidate epoch covers exactly the windows of the clean one: the window topics are
read from offset 0 to the clean manifest's recorded end offsets with the replay worker's
own intake (classification, duplicate rule, consent, content policy; see
:func:`consumers.rebuild.epoch_blocks`), cut into the same blocks, and each block's
candidate rows become one shard named like the clean shard of that block, under
``out/epoch=N/split=S/``. Per window, an evenly spaced subset of its anchors
(``anchors_per_window``) is drafted by every drafter (W paths of depth B) and replayed
by :class:`replay.candidates.replay.CandidateReplayer` on the snapshot's own teacher,
dtype, feature projection and thread count.

Before sealing, candidate parity (Gate 1) replays a sample of windows again and compares
every candidate row with step-by-step cached decode over the same prefix and paths
(:func:`replay.candidates.parity.run_candidate_parity`); the result is the manifest's
``parity``. The manifest names the product (``candidate_path``), so clean-path readers
refuse it.

A rerun after a crash keeps the shards already written (each is written atomically and
its bytes depend only on the windows and this configuration) and replays the rest; an
epoch that is already sealed is refused. The report gives the rows, accepted tokens and
candidate replay seconds per accepted token (falsifier 6's cost, measured on the blocks
replayed by this run).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hebrus_flywheel.consumers.candidates import (
    CandidateBlock,
    candidate_layout,
    seal_candidate_epoch,
    write_candidate_shard,
)
from hebrus_flywheel.consumers.dataset import config_digest, writer_versions
from hebrus_flywheel.consumers.epochs import Block
from hebrus_flywheel.consumers.exceptions import RebuildError
from hebrus_flywheel.consumers.intake import Accepted
from hebrus_flywheel.consumers.labels import SourceRef
from hebrus_flywheel.consumers.rebuild import (
    check_retained,
    epoch_blocks,
    load_for_snapshot,
    manifest_boundary,
)
from hebrus_flywheel.consumers.shards import ShardConfig, ShardName, epoch_dir, shard_relpath
from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.snapshot import PRODUCT_CLEAN, load_manifest

log = logging.getLogger(__name__)

DRAFTERS = ("prompt_lookup", "dense", "teacher_self")
"""Drafter names ``--drafter`` accepts: n-gram lookup (no model), the dense draft model
trained on the snapshot's train split, teacher self-drafting (the upper bound)."""


@dataclass(frozen=True, kw_only=True)
class CandidateEpochConfig:
    """One candidate-path epoch.

    Fields:
        snapshot: the sealed clean epoch directory (or its manifest.json).
        out: the candidate dataset root (never the clean one); ``out/epoch=N`` must not
            be sealed yet.
        teacher: teacher checkpoint directory; its identity must be the snapshot's.
        bootstrap: Kafka bootstrap servers holding the snapshot's window topics.
        drafters: drafter names, from :data:`DRAFTERS`.
        width: candidate paths per anchor (W).
        depth: candidate positions per path (B).
        anchors_per_window: anchors drafted per window, evenly spaced over its anchors.
        parity_windows: windows replayed again against step-by-step decode (Gate 1).
        timeout_s: give up when no window record arrives for this long.
    """

    snapshot: Path
    out: Path
    teacher: Path
    bootstrap: str
    drafters: tuple[str, ...] = DRAFTERS
    width: int = 4
    depth: int = 4
    anchors_per_window: int = 4
    parity_windows: int = 4
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        unknown = [d for d in self.drafters if d not in DRAFTERS]
        if not self.drafters or unknown:
            raise ConfigError(f"CandidateEpochConfig.drafters must name some of {DRAFTERS}, "
                              f"got {list(self.drafters)}")
        for name in ("width", "depth", "anchors_per_window", "parity_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"CandidateEpochConfig.{name} must be a positive integer, "
                                  f"got {value!r}")
        if self.timeout_s <= 0:
            raise ConfigError("CandidateEpochConfig.timeout_s must be > 0")

    def determinism(self) -> dict[str, Any]:
        """What, besides the windows and the teacher, decides the candidate rows."""
        return {"drafters": list(self.drafters), "width": self.width, "depth": self.depth,
                "anchors_per_window": self.anchors_per_window}


def thin_anchors(window: Mapping[str, Any], keep: int) -> dict[str, Any]:
    """``window`` with at most ``keep`` of its anchors, evenly spaced, first and last kept."""
    anchors = [int(a) for a in window["anchor_positions"]]
    if len(anchors) > keep:
        picks = np.unique(np.linspace(0, len(anchors) - 1, keep).round().astype(int))
        anchors = [anchors[i] for i in picks.tolist()]
    return {**window, "anchor_positions": anchors}


def _replayers(config: CandidateEpochConfig, manifest: Mapping[str, Any], bundle: Any) -> list[Any]:
    from hebrus_flywheel.replay.candidates.drafters import (
        DraftConfig,
        Drafter,
        PromptLookupDrafter,
    )
    from hebrus_flywheel.replay.candidates.replay import CandidateConfig, CandidateReplayer
    from hebrus_flywheel.replay.candidates.self_draft import TeacherSelfDrafter

    rc = manifest["determinism"]["replay_config"]["replay_config"]
    candidate = CandidateConfig(
        draft=DraftConfig(width=config.width, depth=config.depth),
        feature_dim=int(rc["feature_dim"]), projection_seed=int(rc["projection_seed"]),
        feature_dtype=str(rc["feature_dtype"]), dtype=str(manifest["determinism"]["dtype"]))
    teacher = bundle.teacher

    def drafter(name: str) -> Drafter:
        if name == "teacher_self":
            return TeacherSelfDrafter(teacher)
        if name == "dense":
            return _dense_drafter(config.snapshot, teacher.vocab_size)
        return PromptLookupDrafter(ngram=3)

    return [CandidateReplayer(teacher, drafter(name), candidate, identity=bundle.identity)
            for name in config.drafters]


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


@dataclass
class _Tally:
    seconds: float = 0.0
    accepted_tokens: int = 0
    rows: int = 0
    shards: int = 0
    skipped_shards: int = 0


def _shard_path(out: Path, block: Block, split: str) -> Path:
    name = ShardName(topic=block.topic, partition=block.partition, first_offset=block.first,
                     last_offset=block.last)
    return out / shard_relpath(block.epoch, split, name)


def _candidate_block(replayers: Sequence[Any], block: Block, split: str,
                     items: Sequence[Accepted], config: CandidateEpochConfig,
                     tally: _Tally) -> list[tuple[Any, SourceRef]]:
    windows = [thin_anchors(a.window, config.anchors_per_window) for a in items]
    labelled: list[tuple[Any, SourceRef]] = []
    for replayer in replayers:
        before = replayer.stats.accepted_tokens
        started = time.perf_counter()
        per_window = replayer.replay(windows)
        tally.seconds += time.perf_counter() - started
        tally.accepted_tokens += replayer.stats.accepted_tokens - before
        for item, anchors in zip(items, per_window, strict=True):
            labelled += [(anchor, item.source) for anchor in anchors]
    return labelled


def _write_blocks(config: CandidateEpochConfig, manifest: Mapping[str, Any], bundle: Any,
                  replayers: Sequence[Any], layout: Any,
                  stats: Counters) -> tuple[_Tally, list[dict[str, Any]]]:
    tally: _Tally = _Tally()
    sample: list[dict[str, Any]] = []
    digest = config_digest({**manifest["determinism"], "candidates": config.determinism()})
    shard = ShardConfig(**manifest["determinism"]["shard"])
    for block, split, items in epoch_blocks(config.bootstrap, manifest, bundle, stats,
                                            timeout_s=config.timeout_s):
        if len(sample) < config.parity_windows:
            sample += [thin_anchors(a.window, config.anchors_per_window)
                       for a in items[: config.parity_windows - len(sample)]]
        if not items or _shard_path(config.out, block, split).is_file():
            tally.skipped_shards += bool(items)
            continue
        labelled = _candidate_block(replayers, block, split, items, config, tally)
        if not labelled:
            continue
        info = write_candidate_shard(
            config.out, CandidateBlock(epoch=block.epoch, split=split, topic=block.topic,
                                       partition=block.partition, first_offset=block.first,
                                       last_offset=block.last, windows=len(items)),
            labelled, layout, identity_id=bundle.identity["identity_id"],
            config_digest=digest, shard=shard)
        tally.rows += info.rows
        tally.shards += 1
        log.info("candidate shard %s: %d windows, %d rows", info.relpath, len(items), info.rows)
    return tally, sample


_SUMMED = ("anchors", "paths", "rows", "pairs", "set_mismatches", "rank_mismatches",
           "weight_violations", "digest_matches")


def merged_parity(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One parity record over every drafter's sample: counts summed, rates recomputed,
    authoritative only when every drafter's is; ``per_drafter`` keeps each result."""
    merged = dict(results[0])
    for key in _SUMMED:
        merged[key] = sum(int(r[key]) for r in results)
    pairs, paths = merged["pairs"], merged["paths"]
    merged["candidate_ids_exact"] = (pairs - merged["set_mismatches"]) / pairs if pairs else 0.0
    merged["candidate_rank_exact"] = (pairs - merged["rank_mismatches"]) / pairs if pairs else 0.0
    merged["accepted_prefix_digest_parity"] = merged["digest_matches"] / paths if paths else 0.0
    merged["authoritative"] = all(bool(r["authoritative"]) for r in results)
    diffs = [r["max_weight_abs_diff"] for r in results if r["max_weight_abs_diff"] is not None]
    merged["max_weight_abs_diff"] = max(diffs) if diffs else None
    merged["drafter_id"] = ",".join(str(r["drafter_id"]) for r in results)
    merged["examples"] = [e for r in results for e in r["examples"]][:8]
    merged["per_drafter"] = {str(r["drafter_id"]): {k: r[k] for k in (
        "authoritative", "anchors", "paths", "pairs", "candidate_ids_exact",
        "candidate_rank_exact", "accepted_prefix_digest_parity")} for r in results}
    return merged


def build_candidate_epoch(config: CandidateEpochConfig, *, teacher: Any = None) -> dict[str, Any]:
    """Replay, write and seal the candidate-path epoch of ``config.snapshot``; a report."""
    from hebrus_flywheel.replay.candidates.parity import run_candidate_parity

    manifest = load_manifest(Path(config.snapshot)).to_dict()
    if (manifest.get("product") or PRODUCT_CLEAN) != PRODUCT_CLEAN:
        raise ConfigError(f"{config.snapshot} is a {manifest['product']} snapshot; candidate "
                          "replay starts from a sealed clean_path epoch")
    out = Path(config.out).resolve()
    target = epoch_dir(out, manifest["epoch"])
    if (target / "manifest.json").exists():
        raise RebuildError(f"{target} is already sealed; choose another --out")
    boundary, splits = manifest_boundary(manifest)
    check_retained(config.bootstrap, {(t, int(p)): 0 for t, parts in boundary.end.items()
                                      for p in parts}, what="the window records",
                   timeout_s=config.timeout_s)
    bundle = load_for_snapshot(manifest, config.teacher, teacher=teacher)
    replayers = _replayers(config, manifest, bundle)
    layout = candidate_layout(bundle.teacher.geometry,
                              feature_dim=replayers[0].config.feature_dim,
                              feature_dtype=replayers[0].config.feature_dtype,
                              projection=replayers[0].projection.contract(
                                  replayers[0].config.feature_dtype))
    stats = Counters()
    tally, sample = _write_blocks(config, manifest, bundle, replayers, layout, stats)
    parity = merged_parity([run_candidate_parity(r, sample) for r in replayers])
    determinism = {**manifest["determinism"], "candidates": config.determinism(),
                   "candidate_contracts": [r.candidate_contract() for r in replayers]}
    dataset = {"identity": manifest["identity"], "determinism": determinism,
               "writer": writer_versions(),
               "source": {**{k: v for k, v in manifest["source"].items() if k != "topics"},
                          "clean_snapshot": manifest["snapshot_id"]}}
    sealed = seal_candidate_epoch(out, epoch=manifest["epoch"], dataset=dataset,
                                  boundary=boundary, splits_by_topic=splits, parity=parity)
    cost = tally.seconds / tally.accepted_tokens if tally.accepted_tokens else None
    return {"snapshot_id": sealed["snapshot_id"], "out": str(target),
            "clean_snapshot": manifest["snapshot_id"], "rows": sealed["totals"]["rows"],
            "shards": len(sealed["shards"]), "shards_written": tally.shards,
            "shards_kept": tally.skipped_shards, "accepted_tokens": tally.accepted_tokens,
            "replay_seconds": round(tally.seconds, 3),
            "replay_cost_s_per_accepted_token": cost, "parity": {
                k: parity[k] for k in ("authoritative", "anchors", "paths", "pairs",
                                       "candidate_ids_exact", "candidate_rank_exact",
                                       "accepted_prefix_digest_parity")},
            "drafters": list(config.drafters), "stats": stats.report()}
