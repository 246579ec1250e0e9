"""A family without sdpa attention (GPT-OSS) is refused under sdpa with the fix named."""

from __future__ import annotations

from pathlib import Path

import pytest

from hebrus_flywheel.replay.exceptions import TeacherError
from hebrus_flywheel.replay.teacher import init_teacher, load_teacher


def test_sdpa_on_a_family_without_it_names_eager(tmp_path: Path) -> None:
    target = tmp_path / "gpt_oss"
    init_teacher(target, family="gpt_oss", seed=0)
    with pytest.raises(TeacherError, match="run with --attention eager"):
        load_teacher(target, attention="sdpa")
    assert load_teacher(target, attention="eager").geometry.family == "gpt_oss"
