"""The collection-time projection: the design note's table from a measured rate."""

from __future__ import annotations

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.projection import (
    NOT_MEASURED,
    ReplayThroughput,
    projection,
    projection_figures,
    projection_lines,
)

MEASURED = {"measured": "teacher prefill", "shards_measured": 3, "shards": 4, "windows": 40,
            "rows": 2_000, "tokens": 9_000, "batches": 5, "seconds": 36.0,
            "tokens_per_s": 250.0, "rows_per_s": 2_000 / 36.0, "machines": ["x86_64 (2 CPUs)"]}


def test_hours_follow_the_measured_rate() -> None:
    clean = ReplayThroughput.from_manifest({"replay_throughput": MEASURED})
    assert clean is not None and clean.shards_measured == 3
    table = projection(clean)
    rows = {r["tokens"]: r for r in table["rows"]}
    # the design note's own illustration: 250 tok/s -> 11.1 h for ten million tokens
    assert rows[10_000_000]["clean_replay_hours"] == pytest.approx(11.111, abs=1e-3)
    assert rows[100_000]["clean_replay_hours"] == round(100_000 / 250 / 3600, 3)
    assert rows[1_000_000]["clean_labelled_hours"] == round(1_000_000 * 36 / 2_000 / 3600, 3)
    assert table["clean"]["replay_tokens_per_labelled_token"] == 4.5
    assert [r["candidate_replay_hours"] for r in table["rows"]] == [None, None, None]
    lines = projection_lines(table)
    assert "250.0 replay tokens/s" in lines[0] and "3/4 shards" in lines[0]
    assert all(NOT_MEASURED in line for line in lines[3:6])
    assert lines[-1].startswith("candidate path: no candidate-path snapshot")
    figures = projection_figures(table)
    assert {"figure": "replay_tokens_per_s", "path": "clean", "value": 250.0} in figures
    hours = [f for f in figures if f["figure"] == "collection_hours"]
    assert len(hours) == 9 and all(f["value"] is None for f in hours if f["path"] == "candidate")


def test_a_candidate_measurement_fills_its_column() -> None:
    clean = ReplayThroughput.from_manifest({"replay_throughput": MEASURED})
    candidate = ReplayThroughput.from_manifest({"replay_throughput": MEASURED}, "candidate")
    table = projection(clean, candidate)
    assert table["rows"][0]["candidate_replay_hours"] == table["rows"][0]["clean_replay_hours"]
    assert table["candidate_note"] == ""


def test_without_a_measurement_every_cell_is_not_measured() -> None:
    assert ReplayThroughput.from_manifest({}) is None
    assert ReplayThroughput.from_manifest({"replay_throughput": {**MEASURED,
                                                                 "tokens_per_s": None}}) is None
    table = projection(None)
    assert table["clean"] is None
    assert all(v is None for r in table["rows"] for k, v in r.items() if k != "tokens")
    assert "not measured" in projection_lines(table)[0]
    with pytest.raises(ConfigError, match="tokens_per_s"):
        ReplayThroughput(tokens=1, rows=1, seconds=1.0, tokens_per_s=0.0, rows_per_s=1.0,
                         shards_measured=1, shards=1)
