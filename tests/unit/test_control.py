"""Control-topic records: boundaries carry the capture end offsets; older ones still parse."""

from __future__ import annotations

import json

import pytest

from hebrus_flywheel.consumers.control import ControlState, _encode, boundary_record, intent_record
from hebrus_flywheel.consumers.epochs import EpochBoundary, freeze_offsets
from hebrus_flywheel.consumers.exceptions import ControlError


def _boundary(capture: dict[str, dict[int, int]]) -> EpochBoundary:
    return EpochBoundary(epoch=0, start=freeze_offsets({"w": {0: 0, 1: 0}}),
                         end=freeze_offsets({"w": {0: 7, 1: 3}}),
                         capture_end=freeze_offsets(capture))


def test_boundary_round_trips_with_capture_end_offsets() -> None:
    state = ControlState()
    state.apply(0, _encode(intent_record(0, 60)))
    state.apply(1, _encode(boundary_record(_boundary({"obs": {0: 40, 1: 12}}), "i")))
    got = state.boundaries[0]
    assert dict(got.end["w"]) == {0: 7, 1: 3}
    assert {t: dict(v) for t, v in got.capture_end.items()} == {"obs": {0: 40, 1: 12}}
    assert state.next_epoch == 1 and state.pending_intent() is None


def test_a_boundary_recorded_before_capture_offsets_existed_still_parses() -> None:
    record = boundary_record(_boundary({}), "i")
    del record["capture_end"]
    state = ControlState()
    state.apply(0, _encode(record))
    assert dict(state.boundaries[0].capture_end) == {}


def test_a_second_boundary_is_ignored_and_a_corrupt_one_refused() -> None:
    state = ControlState()
    state.apply(0, _encode(boundary_record(_boundary({"obs": {0: 1}}), "a")))
    state.apply(1, _encode(boundary_record(_boundary({"obs": {0: 9}}), "b")))
    assert dict(state.boundaries[0].capture_end["obs"]) == {0: 1}
    assert state.ignored == ["offset 1: second boundary for epoch 0 ignored"]
    bad = json.loads(_encode(boundary_record(_boundary({}), "c")))
    bad["epoch"], bad["end"] = 1, "not offsets"
    with pytest.raises(ControlError, match="malformed"):
        state.apply(2, json.dumps(bad).encode())
