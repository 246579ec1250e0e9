"""The candidate epoch's pure parts: its configuration and anchor thinning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.consumers.candidate_epoch import (
    CandidateEpochConfig,
    thin_anchors,
)
from hebrus_flywheel.core.errors import ConfigError


def _config(**overrides: Any) -> CandidateEpochConfig:
    base: dict[str, Any] = {"snapshot": Path("s"), "out": Path("o"), "teacher": Path("t"),
                            "bootstrap": "localhost:9092"}
    return CandidateEpochConfig(**{**base, **overrides})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("drafters", ("gpt",), "drafters"),
    ("drafters", (), "drafters"),
    ("width", 0, "width"),
    ("depth", True, "depth"),
    ("anchors_per_window", -1, "anchors_per_window"),
    ("timeout_s", 0.0, "timeout_s"),
])
def test_config_names_the_bad_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**{field: value})


def test_thinning_keeps_first_and_last_evenly_spaced_anchors() -> None:
    window = {"window_id": "w", "anchor_positions": list(range(10, 30))}
    thinned = thin_anchors(window, 4)
    assert thinned["anchor_positions"] == [10, 16, 23, 29]
    assert window["anchor_positions"] == list(range(10, 30))  # the input is not changed
    assert thin_anchors(window, 50)["anchor_positions"] == list(range(10, 30))
    assert thin_anchors({"anchor_positions": [5, 9]}, 1)["anchor_positions"] == [5]
