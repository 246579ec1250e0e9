"""Record accounting, pure: each consumed capture record lands in exactly one class."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

from hebrus_flywheel.streams.processors.accounting import (
    CLASSES,
    Outputs,
    apply_changelog,
    classify,
    tally,
)
from hebrus_flywheel.streams.processors.common import SEP, header_key, instance_id
from hebrus_flywheel.streams.processors.state_codec import dumps

OBS = "flywheel.capture.observations.v1"
TURNS = "flywheel.capture.transcripts.v1"


def outputs() -> Outputs:
    out = Outputs()
    out.add_quarantine({"source_topic": OBS, "source_partition": 1, "source_offset": 7,
                        "owner": None, "thread": None, "generation": None,
                        "reason": "counter_regression"})
    out.add_quarantine({"source_topic": TURNS, "source_partition": 0, "source_offset": 99,
                        "owner": "o", "thread": "gone", "generation": 0,
                        "stage": "assemble", "value_size": 0})
    # one refused record of a thread does not account for the rest of it
    out.add_quarantine({"source_topic": TURNS, "source_partition": 0, "source_offset": 98,
                        "owner": "o", "thread": "lost", "generation": 0,
                        "stage": "validate", "value_size": 100})
    out.add_window({"owner": "o", "thread": "t", "generation": 0, "first_token_ordinal": 10,
                    "anchor_positions": [0, 2], "turns": [{"turn_index": 1}]})
    out.add_decision({"owner": "o", "thread": "dup", "generation": 0, "keep": False,
                      "reason": "exact_duplicate"})
    out.add_decision({"owner": "o", "thread": "short", "generation": 0, "keep": True,
                      "reason": "unique"})
    out.in_state.add(("o", "open", 0))
    return out


def obs(thread: str, ordinal: int) -> dict[str, object]:
    return {"owner": "o", "thread": thread, "generation": 0, "token_ordinal": ordinal}


def test_each_class() -> None:
    out = outputs()
    assert classify("observations", (OBS, 1, 7), None, out) == "quarantined"
    assert classify("observations", (OBS, 1, 8), None, out) == "unaccounted"
    assert classify("observations", (OBS, 0, 1), obs("t", 12), out) == "windowed"
    assert classify("observations", (OBS, 0, 2), obs("t", 11), out) == "in_windowed_generation"
    assert classify("transcripts", (TURNS, 0, 1),
                    {"owner": "o", "thread": "t", "generation": 0, "turn_index": 1},
                    out) == "windowed"
    assert classify("transcripts", (TURNS, 0, 2),
                    {"owner": "o", "thread": "t", "generation": 0, "turn_index": 2},
                    out) == "in_windowed_generation"
    assert classify("observations", (OBS, 0, 3), obs("gone", 1), out) == "generation_quarantined"
    assert classify("observations", (OBS, 0, 4), obs("dup", 1), out) == "duplicate"
    assert classify("observations", (OBS, 0, 6), obs("short", 1), out) == "kept_without_window"
    assert classify("observations", (OBS, 0, 5), obs("open", 1), out) == "pending"
    assert classify("observations", (OBS, 0, 6), obs("lost", 1), out) == "unaccounted"
    assert classify("observations", (OBS, 0, 6), {"owner": "o"}, out) == "unaccounted"
    assert classify("identities", ("ids", 0, 0), {"identity_id": "x"}, out) == "identity"


def test_tally_counts_every_record_once_and_names_the_unaccounted() -> None:
    out = outputs()
    records = [(7, None), (8, None), (9, obs("t", 12)), (10, obs("lost", 0)), (11, obs("open", 3))]
    row = tally("observations", OBS, 1, 12, records, out)
    assert row["records"] == 5 == sum(row[c] for c in CLASSES)
    assert (row["quarantined"], row["windowed"], row["pending"]) == (1, 1, 1)
    assert row["unaccounted"] == 2 and row["unaccounted_offsets"] == [8, 10]
    assert row["committed"] == 12 and row["partition"] == 1


def test_quarantines_and_duplicates_are_counted_by_reason() -> None:
    out = outputs()
    records = [(7, None), (9, obs("dup", 1)), (10, obs("dup", 2)), (11, obs("gone", 0))]
    row = tally("observations", OBS, 1, 12, records, out)
    assert row["by_reason"] == {"quarantined": {"counter_regression": 1},
                                "duplicate": {"exact_duplicate": 2},
                                "generation_quarantined": {"unknown": 1}}
    kept = outputs()
    kept.add_decision({"owner": "o", "thread": "dup", "generation": 0, "keep": True,
                       "reason": "unique"})  # another teacher kept the same generation
    assert classify("observations", (OBS, 0, 4), obs("dup", 1), kept) == "kept_without_window"


def test_changelog_keeps_only_the_latest_open_header() -> None:
    state: dict[str, tuple[str, str, int] | None] = {}
    iid = instance_id("o", "t", 0)
    key = json.dumps(header_key(iid)).encode()
    header = {"owner": "o", "thread": "t", "generation": 0, "status": "open"}
    apply_changelog(state, key, dumps(header))
    apply_changelog(state, f"t{SEP}{iid}{SEP}0".encode(), dumps({"tokens": []}))
    assert state == {iid: ("o", "t", 0)}
    apply_changelog(state, key, dumps({**header, "status": "emitted"}))
    assert state == {}
    apply_changelog(state, header_key(iid).encode(), dumps({**header, "status": "ready"}))
    assert state == {iid: ("o", "t", 0)}
    assert apply_changelog(state, key, None)
    assert state == {}


def test_a_pickled_header_is_refused_unread(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Marker:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.mkdir, (str(marker),))

    state: dict[str, tuple[str, str, int] | None] = {}
    iid = instance_id("o", "t", 0)
    key = json.dumps(header_key(iid)).encode()
    assert apply_changelog(state, key, dumps({"owner": "o", "thread": "t", "generation": 0,
                                              "status": "open"}))
    assert not apply_changelog(state, key, pickle.dumps(Marker()))
    assert state == {} and not marker.exists()
    assert not apply_changelog(state, key, b"not a state record")
