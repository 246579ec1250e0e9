"""The benchmarks' worker-log reader (tests/support/streams_harness.last_logged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import streams_harness
from tests.support.streams_harness import last_logged


def _log(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_the_last_marked_line_wins(tmp_path: Path) -> None:
    log = _log(tmp_path / "w.log", [
        "INFO start",
        'INFO streams counters {"a": 1}',
        'INFO streams memory {"rss": 5}',
        'INFO streams counters {"a": 2}',
        "INFO idle",
    ])
    assert last_logged(log, "streams counters ") == {"a": 2}
    assert last_logged(log, "streams memory ") == {"rss": 5}
    assert last_logged(log, "streams other ") == {}


def test_a_marker_only_before_the_tail_is_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams_harness, "LOG_TAIL_BYTES", 64)
    filler = ["INFO " + "x" * 40] * 20
    log = _log(tmp_path / "w.log", ['INFO streams memory {"rss": 7}', *filler])
    assert last_logged(log, "streams memory ") == {"rss": 7}


def test_a_line_cut_by_the_tail_is_not_parsed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counters = {"k": list(range(30))}
    line = f"INFO streams counters {json.dumps(counters)}"
    monkeypatch.setattr(streams_harness, "LOG_TAIL_BYTES", len(line) - 5)
    log = _log(tmp_path / "w.log", ['INFO streams counters {"k": 0}', line])
    # the tail starts inside the last line: it is skipped there, and read whole from the start
    assert last_logged(log, "streams counters ") == counters


def test_a_line_still_being_written_is_not_parsed(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text('INFO streams counters {"a": 1}\nINFO streams counters {"a": 2, "b"')
    assert last_logged(log, "streams counters ") == {"a": 1}
