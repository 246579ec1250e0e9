"""``flywheel replay candidates``: the candidate-path product of a sealed clean epoch.

The candidate epoch covers exactly the windows of the clean one: the window topics are
read from offset 0 to the clean manifest's recorded end offsets with the replay worker's
own intake (classification, duplicate rule, consent, content policy; see
:func:`consumers.rebuild.epoch_blocks`) and cut into the same blocks. Each block becomes
one work item on the candidate product's own topic (:mod:`consumers.candidate_jobs`:
offsets and window ids, no tokens), and the plan goes to the candidate control topic.
Candidate workers (:mod:`consumers.candidate_worker`: this process, unless
``external_workers``, plus any ``flywheel replay candidate-worker``) replay the blocks
and report each shard, named like the clean shard of its block, under
``out/epoch=N/split=S/``.

Once every planned block is reported and its shard is on disk, candidate parity
(Gate 1) replays a sample of windows again and compares every candidate row with
step-by-step cached decode over the same prefix and paths
(:func:`replay.candidates.parity.run_candidate_parity`); the result is the manifest's
``parity``. The manifest names the product (``candidate_path``), so clean-path readers
refuse it, and a ``candidate_sealed`` record closes the job.

A rerun of the same job (same snapshot, root and settings) publishes nothing new when
its plan is on the control topic and keeps every shard already written; a reported shard
that has gone from disk is planned again. An epoch that is already sealed is refused.
The report gives the rows, accepted tokens and candidate replay seconds per accepted
token (falsifier 6's cost, measured by the workers on the blocks they replayed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers.candidate_drafters import DRAFTERS
from hebrus_flywheel.consumers.candidate_jobs import (
    CandidateJob,
    CandidateState,
    WorkItem,
    control_channel,
    publish_items,
)
from hebrus_flywheel.consumers.candidate_worker import (
    CandidateWorker,
    CandidateWorkerConfig,
    JobCache,
    JobRuntime,
    job_determinism,
    thin_anchors,
)
from hebrus_flywheel.consumers.candidates import seal_candidate_epoch
from hebrus_flywheel.consumers.control import LogChannel
from hebrus_flywheel.consumers.dataset import writer_versions
from hebrus_flywheel.consumers.exceptions import RebuildError
from hebrus_flywheel.consumers.rebuild import check_retained, epoch_blocks, manifest_boundary
from hebrus_flywheel.consumers.shards import epoch_dir
from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka.security import acting_as
from hebrus_flywheel.core.snapshot import PRODUCT_CLEAN, load_manifest

log = logging.getLogger(__name__)

__all__ = ["DRAFTERS", "CandidateEpochConfig", "build_candidate_epoch", "thin_anchors"]


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
        external_workers: replay nothing here; wait for ``flywheel replay
            candidate-worker`` processes to report every block.
        wait_s: how long to wait for the workers to report every block.
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
    external_workers: bool = False
    wait_s: float = 3600.0

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
        for name in ("timeout_s", "wait_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"CandidateEpochConfig.{name} must be > 0")

    def job(self, manifest: Mapping[str, Any]) -> CandidateJob:
        return CandidateJob(clean_snapshot_id=manifest["snapshot_id"],
                            snapshot=str(Path(self.snapshot).resolve()),
                            out=str(Path(self.out).resolve()), epoch=int(manifest["epoch"]),
                            drafters=tuple(self.drafters), width=self.width, depth=self.depth,
                            anchors_per_window=self.anchors_per_window)


def _plan(config: CandidateEpochConfig, job: CandidateJob, runtime: JobRuntime,
          stats: Counters) -> tuple[list[WorkItem], list[dict[str, Any]]]:
    """The job's work items (blocks with accepted windows) and the parity sample."""
    items: list[WorkItem] = []
    sample: list[dict[str, Any]] = []
    for block, split, accepted in epoch_blocks(config.bootstrap, runtime.manifest,
                                               runtime.bundle, stats,
                                               timeout_s=config.timeout_s):
        if not accepted:
            continue
        items.append(WorkItem.of(job, block, split, accepted))
        if len(sample) < config.parity_windows:
            sample += [thin_anchors(a.window, config.anchors_per_window)
                       for a in accepted[: config.parity_windows - len(sample)]]
    return items, sample


def _publish_plan(config: CandidateEpochConfig, prefix: str, channel: LogChannel[CandidateState],
                  items: Sequence[WorkItem]) -> int:
    """Publish the job's items and plan unless its plan is on the topic already; items
    of reported shards that are gone from disk go out again. The items published."""
    job = items[0].job if items else None
    if job is None:
        return 0
    state = channel.sync()
    if job.job_id in state.plans:
        done = state.shards.get(job.job_id, {})
        lost = [i for i in items if i.key in done and not _on_disk(job, done[i.key])]
        if lost:
            log.warning("%d reported candidate shards are gone from %s; planned again",
                        len(lost), job.out)
            state.shards[job.job_id] = {k: v for k, v in done.items()
                                        if k not in {i.key for i in lost}}
        return publish_items(config.bootstrap, prefix, lost)
    count = publish_items(config.bootstrap, prefix, items)
    channel.publish({"kind": "candidate_plan", "epoch": job.epoch, "job": job.to_dict(),
                     "job_id": job.job_id, "blocks": [i.key for i in items]})
    return count


def _on_disk(job: CandidateJob, report: Mapping[str, Any]) -> bool:
    return report.get("relpath") is None or (Path(job.out) / str(report["relpath"])).is_file()


def _pending(state: CandidateState, job: CandidateJob) -> list[str]:
    done = state.shards.get(job.job_id, {})
    return [k for k in state.missing(job.job_id)] + [
        k for k, r in done.items() if not _on_disk(job, r)]


def _wait(config: CandidateEpochConfig, channel: LogChannel[CandidateState],
          job: CandidateJob) -> CandidateState:
    """The control state once every planned block is reported and on disk."""
    deadline = time.monotonic() + config.wait_s
    while True:
        state = channel.sync()
        refused = state.refused.get(job.job_id)
        if refused:
            raise RebuildError(f"a candidate worker refused job {job.job_id}: {refused['reason']}")
        pending = _pending(state, job)
        if not pending:
            return state
        if time.monotonic() > deadline:
            raise RebuildError(
                f"{len(pending)} planned candidate blocks (e.g. {pending[:2]}) were not "
                f"reported within {config.wait_s:.0f} s; start `flywheel replay "
                "candidate-worker --teacher DIR` (or drop --external-workers) and re-run "
                "the same command: written shards are kept")
        time.sleep(1.0)


def _work_here(config: CandidateEpochConfig, jobs: JobCache, prefix: str,
               channel: LogChannel[CandidateState], job: CandidateJob) -> None:
    """Serve the blocks topic in this process (as the replay role) until the job is done."""
    with acting_as("replay"):
        worker = CandidateWorker(CandidateWorkerConfig(
            teacher=config.teacher, bootstrap=config.bootstrap, prefix=prefix,
            timeout_s=config.timeout_s), jobs=jobs)
        deadline = time.monotonic() + config.wait_s
        worker.run(until=lambda: not _pending(channel.sync(), job)
                   or time.monotonic() > deadline)


def _costs(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    replayed = [r for r in reports if r.get("replayed")]
    seconds = sum(float(r["seconds"]) for r in replayed)
    accepted = sum(int(r["accepted_tokens"]) for r in replayed)
    return {"shards_written": sum(1 for r in replayed if r.get("relpath")),
            "shards_kept": sum(1 for r in reports if not r.get("replayed")),
            "accepted_tokens": accepted, "replay_seconds": round(seconds, 3),
            "replay_cost_s_per_accepted_token": seconds / accepted if accepted else None,
            "workers": sorted({str(r.get("worker")) for r in replayed})}


def build_candidate_epoch(config: CandidateEpochConfig, *, teacher: Any = None) -> dict[str, Any]:
    """Plan, replay (here and/or in candidate workers), check and seal the candidate-path
    epoch of ``config.snapshot``; a report."""
    from hebrus_flywheel.replay.candidates.parity import run_candidate_parity

    manifest = load_manifest(Path(config.snapshot)).to_dict()
    if (manifest.get("product") or PRODUCT_CLEAN) != PRODUCT_CLEAN:
        raise ConfigError(f"{config.snapshot} is a {manifest['product']} snapshot; candidate "
                          "replay starts from a sealed clean_path epoch")
    job = config.job(manifest)
    target = epoch_dir(Path(job.out), job.epoch)
    if (target / "manifest.json").exists():
        raise RebuildError(f"{target} is already sealed; choose another --out")
    boundary, splits = manifest_boundary(manifest)
    check_retained(config.bootstrap, {(t, int(p)): 0 for t, parts in boundary.end.items()
                                      for p in parts}, what="the window records",
                   timeout_s=config.timeout_s)
    prefix = str(manifest["source"].get("prefix") or "")
    jobs = JobCache(teacher_dir=config.teacher, bootstrap=config.bootstrap, prefix=prefix,
                    teacher=teacher)
    runtime, stats = jobs.get(job), Counters()
    items, sample = _plan(config, job, runtime, stats)
    channel = control_channel(config.bootstrap, prefix, timeout_s=config.timeout_s)
    try:
        published = _publish_plan(config, prefix, channel, items)
        if items and not config.external_workers:
            _work_here(config, jobs, prefix, channel, job)
        state = _wait(config, channel, job) if items else CandidateState()
        parity = run_candidate_parity(runtime.replayers, sample)
        determinism = {**manifest["determinism"], "candidates": job_determinism(job),
                       "candidate_contracts": [r.candidate_contract()
                                               for r in runtime.replayers]}
        dataset = {"identity": manifest["identity"], "determinism": determinism,
                   "writer": writer_versions(),
                   "source": {**{k: v for k, v in manifest["source"].items() if k != "topics"},
                              "clean_snapshot": manifest["snapshot_id"]}}
        sealed = seal_candidate_epoch(Path(job.out), epoch=job.epoch, dataset=dataset,
                                      boundary=boundary, splits_by_topic=splits, parity=parity)
        channel.publish({"kind": "candidate_sealed", "epoch": job.epoch, "job_id": job.job_id,
                         "snapshot_id": sealed["snapshot_id"]})
    finally:
        channel.close()
    return {"snapshot_id": sealed["snapshot_id"], "out": str(target), "job_id": job.job_id,
            "clean_snapshot": manifest["snapshot_id"], "rows": sealed["totals"]["rows"],
            "shards": len(sealed["shards"]), "planned_blocks": len(items),
            "items_published": published, **_costs(state.reports(job.job_id)),
            "parity": {k: parity[k] for k in (
                "authoritative", "anchors", "paths", "pairs", "candidate_ids_exact",
                "candidate_rank_exact", "accepted_prefix_digest_parity")},
            "drafters": list(config.drafters), "stats": stats.report()}
