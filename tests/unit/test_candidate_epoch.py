"""The candidate epoch's pure parts: its configuration, anchor thinning, merged parity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.consumers.candidate_epoch import (
    CandidateEpochConfig,
    merged_parity,
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


def _parity(drafter: str, *, pairs: int, rank_bad: int = 0, paths: int = 4,
            digests: int = 4) -> dict[str, Any]:
    return {"authoritative": rank_bad == 0 and digests == paths, "drafter_id": drafter,
            "anchors": 2, "paths": paths, "rows": pairs // 4, "pairs": pairs,
            "set_mismatches": 0, "rank_mismatches": rank_bad, "weight_violations": 0,
            "digest_matches": digests, "max_weight_abs_diff": 1e-7, "examples": [],
            "candidate_ids_exact": 1.0, "candidate_rank_exact": 1 - rank_bad / pairs,
            "accepted_prefix_digest_parity": digests / paths}


def test_merged_parity_sums_counts_and_needs_every_drafter_exact() -> None:
    good = merged_parity([_parity("a", pairs=40), _parity("b", pairs=60)])
    assert good["authoritative"] and (good["pairs"], good["paths"]) == (100, 8)
    assert good["candidate_rank_exact"] == 1.0 and good["drafter_id"] == "a,b"
    bad = merged_parity([_parity("a", pairs=40), _parity("b", pairs=60, rank_bad=3, digests=3)])
    assert not bad["authoritative"]
    assert bad["candidate_rank_exact"] == pytest.approx(0.97)
    assert bad["accepted_prefix_digest_parity"] == pytest.approx(7 / 8)
    assert not bad["per_drafter"]["b"]["authoritative"] and bad["per_drafter"]["a"]["authoritative"]
