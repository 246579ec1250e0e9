"""The candidate product's topic records: jobs, work items and the folded control log."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hebrus_flywheel.consumers.candidate_jobs import (
    CandidateJob,
    CandidateState,
    WorkItem,
    decode_item,
    encode,
)
from hebrus_flywheel.consumers.epochs import Block
from hebrus_flywheel.consumers.exceptions import ControlError
from hebrus_flywheel.consumers.intake import Accepted
from hebrus_flywheel.consumers.labels import SourceRef


def _job(**overrides: Any) -> CandidateJob:
    base: dict[str, Any] = {"clean_snapshot_id": "snap", "snapshot": "/d/clean/epoch=0",
                            "out": "/d/cand", "epoch": 0, "drafters": ("prompt_lookup",),
                            "width": 2, "depth": 3, "anchors_per_window": 2}
    return CandidateJob(**{**base, **overrides})


def _item(job: CandidateJob) -> WorkItem:
    block = Block(topic="flywheel.windows.train.v1", partition=3, epoch=0, first=64, end=128,
                  final=True)
    accepted = [Accepted(source=SourceRef(topic=block.topic, partition=3, offset=o),
                         window={"window_id": f"w{o}", "token_ids": [1, 2, 3]})
                for o in (64, 70)]
    return WorkItem.of(job, block, "train", accepted)


def test_job_id_is_a_digest_of_everything_that_decides_the_rows() -> None:
    job = _job()
    assert len(job.job_id) == 16 and _job().job_id == job.job_id
    assert _job(width=3).job_id != job.job_id and _job(out="/elsewhere").job_id != job.job_id
    assert CandidateJob.from_dict(job.to_dict()) == job
    with pytest.raises(ControlError, match="altered"):
        CandidateJob.from_dict({**job.to_dict(), "depth": 9})


def test_work_item_round_trips_and_holds_no_tokens() -> None:
    item = _item(_job())
    value = encode(item.to_record())
    assert decode_item(value, "t[0]@0") == item
    assert item.key == "flywheel.windows.train.v1/3/64" and item.block.last == 127
    assert item.offsets == (64, 70) and item.window_ids == ("w64", "w70")
    assert "token_ids" not in json.loads(value)


@pytest.mark.parametrize("value", [b"", b"not json", b"[]", encode({"kind": "candidate_plan"}),
                                   json.dumps({"kind": "candidate_block"}).encode()])
def test_a_record_that_is_not_a_work_item_is_refused_by_name(value: bytes) -> None:
    with pytest.raises(ControlError, match="t\\[1\\]@5 is not a candidate work item"):
        decode_item(value, "t[1]@5")


def _shard(block: str, *, replayed: bool, seconds: float = 0.0) -> bytes:
    return encode({"kind": "candidate_shard", "epoch": 0, "job_id": "j", "block": block,
                   "relpath": f"epoch=0/{block}.parquet", "replayed": replayed,
                   "seconds": seconds, "accepted_tokens": 1})


def test_state_folds_plans_shards_and_refusals() -> None:
    state = CandidateState()
    assert state.missing("j") == ["<plan>"]
    state.apply(0, encode({"kind": "candidate_plan", "epoch": 0, "job_id": "j",
                           "blocks": ["a", "b", "c"]}))
    state.apply(1, _shard("a", replayed=False))
    state.apply(2, _shard("a", replayed=True, seconds=2.0))  # the measured one is kept
    state.apply(3, _shard("a", replayed=True, seconds=9.0))  # a redelivery: first stands
    state.apply(4, _shard("b", replayed=True, seconds=1.0))
    state.apply(5, b"garbage")
    state.apply(6, json.dumps({"format": "other", "kind": "candidate_plan"}).encode())
    assert state.missing("j") == ["c"]
    assert sorted(r["seconds"] for r in state.reports("j")) == [1.0, 2.0]
    assert len(state.ignored) == 2
    state.apply(7, encode({"kind": "candidate_refused", "epoch": 0, "job_id": "j",
                           "block": "c", "reason": "teacher differs"}))
    assert state.refused["j"]["reason"] == "teacher differs"


def test_a_worker_keeps_the_recent_jobs_and_refuses_one_it_cannot_open(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from hebrus_flywheel.consumers.candidate_worker import JobCache
    from hebrus_flywheel.consumers.exceptions import JobRefused

    loads: list[str] = []

    def load(self: JobCache, job: CandidateJob) -> Any:
        loads.append(job.job_id)
        return job.job_id

    cache = JobCache(teacher_dir=tmp_path, bootstrap="x", prefix="")
    monkeypatch.setattr(JobCache, "_load", load)
    a, b, c = _job(width=1), _job(width=2), _job(width=3)
    for job in (a, b, a, c, a):
        assert cache.get(job) == job.job_id
    assert loads == [a.job_id, b.job_id, c.job_id]  # b was evicted, a stayed in use
    assert list(cache.jobs) == [c.job_id, a.job_id]
    monkeypatch.undo()
    with pytest.raises(JobRefused, match="cannot open /nowhere/epoch=0"):
        cache.get(_job(snapshot="/nowhere/epoch=0"))
