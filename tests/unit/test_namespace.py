"""Per-teacher namespaces: derived from the teacher directory, overridable."""

from __future__ import annotations

from pathlib import Path

import pytest

from hebrus_flywheel.core.namespace import NAMESPACE_ENV, resolve_prefix, teacher_namespace
from hebrus_flywheel.streams.topics import catalogue


def test_each_teacher_directory_has_its_own_legal_namespace(tmp_path: Path) -> None:
    a, b = tmp_path / "Tiny DeepSeek_V3", tmp_path / "other" / "Tiny DeepSeek_V3"
    ns_a, ns_b = teacher_namespace(a), teacher_namespace(b)
    assert ns_a.startswith("tiny-deepseek-v3-") and ns_a.endswith(".")
    assert ns_a != ns_b and teacher_namespace(a) == ns_a
    assert teacher_namespace(tmp_path / "x" / ".." / "Tiny DeepSeek_V3") == ns_a
    assert all(spec.name.startswith(ns_a) for spec in catalogue(ns_a))  # Kafka-legal


def test_override_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAMESPACE_ENV, raising=False)
    teacher = tmp_path / "t"
    assert resolve_prefix(None, teacher=teacher) == teacher_namespace(teacher)
    assert resolve_prefix(None, teacher=None) == ""
    assert resolve_prefix("", teacher=teacher) == ""
    assert resolve_prefix("mine.", teacher=teacher) == "mine."
    monkeypatch.setenv(NAMESPACE_ENV, "env.")
    assert resolve_prefix(None, teacher=teacher) == "env."
    assert resolve_prefix("mine.", teacher=teacher) == "mine."
