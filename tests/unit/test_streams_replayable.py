"""What lets the in-memory stream chain repeat a worker group: configs as JSON, runs,
reconfiguration with state kept, and decisions released in a recorded order."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.consumers.capture_check import segments
from hebrus_flywheel.consumers.exceptions import RebuildError
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.common import instance_id
from hebrus_flywheel.streams.processors.pipeline import (
    LocalPipeline,
    ProcessorConfig,
    config_from_json,
    config_id,
    config_to_json,
)
from hebrus_flywheel.streams.processors.runs import StreamsRun, StreamsRunError
from hebrus_flywheel.streams.processors.split import SplitConfig
from hebrus_flywheel.streams.processors.window import WindowConfig
from tests.support.sealing import owner_pseudonym, thread_pseudonym
from tests.support.streams_synthetic import Scenario, ThreadSpec, make_identity

RAW = {owner_pseudonym(raw): raw for raw in ("alice", "bob", "carol")}

ALL_VALIDATION = SplitConfig(validation_fraction=1.0, runtime_holdout_fraction=0.0,
                             stress_rate=0.0)


def _config(**split: Any) -> ProcessorConfig:
    return ProcessorConfig(split=dataclasses.replace(ALL_VALIDATION, **split))


def _tokens(seed: int, n: int = 300) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(10, 4000, n).tolist())


def _near_copy(base: tuple[int, ...], changes: int = 3) -> tuple[int, ...]:
    out = list(base)
    for i in range(changes):
        out[37 * (i + 1)] = 5
    return tuple(out)


def _spec(owner: str, tokens: tuple[int, ...], start_ms: int = 1_767_225_600_000) -> ThreadSpec:
    return ThreadSpec(owner=owner, thread=f"{owner}-t", turns=(("user", len(tokens)),),
                      tokens=(tokens,), start_ms=start_ms)


def _run(pipeline: LocalPipeline, *specs: ThreadSpec) -> Scenario:
    scenario = Scenario(pipeline)
    scenario.publish_identity()
    for spec in specs:
        scenario.send_thread(spec)
    return scenario


def _verdicts(pipeline: LocalPipeline) -> dict[str, tuple[bool, str]]:
    return {RAW[d["owner"]]: (d["keep"], d["reason"]) for d in pipeline.decisions}


def test_processor_config_round_trips_through_json_and_names_itself() -> None:
    config = ProcessorConfig(
        split=SplitConfig(validation_fraction=0.25, temporal_cut_ms=123, stress_tags=("code",)),
        window=WindowConfig(context_length=512),
    )
    data = json.loads(json.dumps(config_to_json(config)))
    assert config_from_json(data) == config
    assert config_id(config_from_json(data)) == config_id(config)
    assert config_id(config) != config_id(ProcessorConfig())
    data["split"]["no_such_field"] = 1
    with pytest.raises(ConfigError, match="unknown fields"):
        config_from_json(data)
    with pytest.raises(ConfigError, match="stages"):
        config_from_json({"bogus": {}})


def test_release_order_repeats_first_come_decisions_of_another_arrival_order() -> None:
    a, b = _spec("alice", _tokens(1)), _spec("bob", _near_copy(_tokens(1)))
    first = LocalPipeline(_config())
    _run(first, a, b)
    assert _verdicts(first) == {"alice": (True, "unique"), "bob": (False, "near_duplicate")}
    order = [d["iid"] for d in first.decisions]

    swapped = LocalPipeline(_config())
    _run(swapped, b, a)
    assert _verdicts(swapped) == {"bob": (True, "unique"), "alice": (False, "near_duplicate")}

    replayed = LocalPipeline(_config(), release_order=order)
    _run(replayed, b, a)
    assert [d["iid"] for d in replayed.decisions] == order
    assert _verdicts(replayed) == _verdicts(first)


def test_a_generation_missing_from_the_order_waits_for_flush_in_recorded_order() -> None:
    a, b, c = (_spec(o, _tokens(s)) for o, s in (("alice", 1), ("bob", 2), ("carol", 3)))
    order = ["never-seen", instance_id(owner_pseudonym("carol"),
                                       thread_pseudonym("carol", "carol-t"), 0,
                                       make_identity(layers=4, experts=64, top_k=4)["identity_id"])]
    pipeline = LocalPipeline(_config(), release_order=order)
    scenario = _run(pipeline, a, b)
    assert pipeline.decisions == []
    scenario.send_thread(c)
    assert pipeline.decisions == []
    pipeline.flush()
    assert RAW[pipeline.decisions[0]["owner"]] == "carol"
    assert sorted(RAW[d["owner"]] for d in pipeline.decisions) == ["alice", "bob", "carol"]


def test_reconfigure_keeps_state_and_applies_the_new_config_to_later_threads() -> None:
    pipeline = LocalPipeline(_config())
    scenario = _run(pipeline, _spec("alice", _tokens(1)))
    pipeline.reconfigure(_config(temporal_cut_ms=0))
    scenario.send_thread(_spec("bob", _tokens(2)))
    scenario.send_thread(_spec("carol", _tokens(1)))  # exact copy of alice's content
    splits = {RAW[d["owner"]]: d["split"] for d in pipeline.decisions}
    assert splits == {"alice": "validation", "bob": "temporal_holdout",
                      "carol": "temporal_holdout"}
    assert _verdicts(pipeline)["carol"] == (False, "exact_duplicate")


def _run_record(run_id: str, config: ProcessorConfig, start: dict[int, int]) -> StreamsRun:
    return StreamsRun(app_id="app", run_id=run_id, config=config_to_json(config),
                      config_id=config_id(config), capture_start={"obs": start},
                      started_at_ms=0)


def test_streams_run_records_round_trip_and_refuse_an_edited_config() -> None:
    run = _run_record("r1", _config(), {0: 3, 1: 0})
    data = json.loads(json.dumps(run.to_json()))
    assert StreamsRun.from_json(data) == run
    data["config"]["split"]["validation_fraction"] = 0.5
    with pytest.raises(StreamsRunError, match="does not hash"):
        StreamsRun.from_json(data)
    with pytest.raises(StreamsRunError, match="not a"):
        StreamsRun.from_json({"format": "other"})


def test_runs_cut_the_capture_offsets_into_one_segment_per_configuration() -> None:
    x, y = _config(), _config(temporal_cut_ms=5)
    runs = [_run_record("r1", x, {0: 0, 1: 0}), _run_record("r2", x, {0: 5, 1: 2}),
            _run_record("r3", y, {0: 8, 1: 2})]
    cuts = segments(runs, {"obs": {0: 12, 1: 4}})
    assert [c.run.run_id for c in cuts] == ["r1", "r3"]
    assert cuts[0].ranges == {("obs", 0): (0, 8), ("obs", 1): (0, 2)}
    assert cuts[1].ranges == {("obs", 0): (8, 12), ("obs", 1): (2, 4)}
    # a run that started past the recorded end (after the seal read it) gets nothing
    assert segments(runs, {"obs": {0: 6, 1: 4}})[1].ranges[("obs", 0)] == (6, 6)
    reset = [*runs[:2], _run_record("r3", y, {0: 1, 1: 2})]
    with pytest.raises(RebuildError, match="offsets were reset"):
        segments(reset, {"obs": {0: 12, 1: 4}})


def test_rebuild_from_capture_refuses_runs_that_mix_the_two_dedup_layouts() -> None:
    from hebrus_flywheel.consumers.capture_check import regenerate
    from hebrus_flywheel.streams.processors.dedup import DedupConfig

    bands = dataclasses.replace(_config(), dedup=DedupConfig(band_partitioned=True))
    capture = {"streams_runs": [_run_record("r1", _config(), {0: 0}).to_json(),
                                _run_record("r2", bands, {0: 2}).to_json()],
               "end": {"obs": {"0": 4}}}
    with pytest.raises(RebuildError, match="mix the one-partition and the band-partitioned"):
        regenerate("127.0.0.1:1", "", capture)  # refused before any broker is asked
