"""Attention kernels per family: ``auto`` (the default) takes sdpa where the family's
transformers model supports it and eager where it does not (GPT-OSS's attention sinks);
an explicit sdpa on such a family is refused with the fix named."""

from __future__ import annotations

from pathlib import Path

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.execution import Execution
from hebrus_flywheel.replay.exceptions import TeacherError
from hebrus_flywheel.replay.families import FAMILIES
from hebrus_flywheel.replay.teacher import init_teacher, load_teacher, resolve_attention


def test_sdpa_on_a_family_without_it_names_eager(tmp_path: Path) -> None:
    target = tmp_path / "gpt_oss"
    init_teacher(target, family="gpt_oss", seed=0)
    with pytest.raises(TeacherError, match="run with --attention eager"):
        load_teacher(target, attention="sdpa")
    assert load_teacher(target, attention="eager").geometry.family == "gpt_oss"


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_auto_takes_what_the_family_supports(tmp_path: Path, family: str) -> None:
    target = tmp_path / family
    init_teacher(target, family=family, seed=0)
    want = FAMILIES[family].attention
    assert resolve_attention(target, "auto") == want
    assert resolve_attention(target, "eager") == "eager"  # an explicit choice stands
    teacher = load_teacher(target)  # auto by default
    assert teacher.attention == want and f"attention={want};" in teacher.kernel_path


def test_an_unresolved_attention_is_never_recorded() -> None:
    with pytest.raises(ConfigError, match="must be resolved"):
        Execution().kernel_path("tiled_mm")
    assert "attention=eager;" in Execution().with_attention("eager").kernel_path("tiled_mm")
