"""core.files.fill_dir_once: a cache directory filled once, whoever fetches at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from hebrus_flywheel.core.files import fill_dir_once


def test_fill_dir_once_fills_a_private_directory_then_renames_it(tmp_path: Path) -> None:
    calls: list[Path] = []

    def fill(partial: Path) -> None:
        calls.append(partial)
        assert partial.parent == tmp_path / "cache" and partial.name.startswith(".")
        (partial / "MANIFEST").write_text("m")

    target = fill_dir_once(tmp_path / "cache" / "abc", fill, complete="MANIFEST")
    assert target == tmp_path / "cache" / "abc" and (target / "MANIFEST").read_text() == "m"
    assert fill_dir_once(target, fill, complete="MANIFEST") == target and len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["abc"]  # no partial left


def test_fill_dir_once_loses_a_race_gracefully_and_a_failed_fill_leaves_nothing(
        tmp_path: Path) -> None:
    target = tmp_path / "abc"

    def racing(partial: Path) -> None:  # another reader completes the target meanwhile
        (partial / "MANIFEST").write_text("mine")
        target.mkdir()
        (target / "MANIFEST").write_text("theirs")
        (target / "other").write_text("x")

    assert fill_dir_once(target, racing, complete="MANIFEST") == target
    assert (target / "MANIFEST").read_text() == "theirs"

    def failing(partial: Path) -> None:
        (partial / "half").write_text("x")
        raise OSError("download broke")

    with pytest.raises(OSError, match="download broke"):
        fill_dir_once(tmp_path / "def", failing, complete="MANIFEST")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc"]
