"""Threshold configs validate their fields and name them in ConfigError."""

from __future__ import annotations

from typing import Any

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.qualify import (
    DecodeGateConfig,
    FalsifierConfig,
    IntegrityGateConfig,
    OfflineGateConfig,
    QualificationConfig,
    ReplayGateConfig,
    ServiceObjective,
    ShadowGateConfig,
)


@pytest.mark.parametrize(("factory", "kwargs", "field"), [
    (ReplayGateConfig, {"require_rebuild": 1}, "ReplayGateConfig.require_rebuild"),
    (ReplayGateConfig, {"max_quarantine_fraction": 2.0},
     "ReplayGateConfig.max_quarantine_fraction"),
    (IntegrityGateConfig, {"coverage_dimensions": ["domain"]},
     "IntegrityGateConfig.coverage_dimensions"),
    (OfflineGateConfig, {"budget": 0}, "OfflineGateConfig.budget"),
    (OfflineGateConfig, {"margin": -0.1}, "OfflineGateConfig.margin"),
    (OfflineGateConfig, {"decision_splits": ("train",)}, "OfflineGateConfig.decision_splits"),
    (OfflineGateConfig, {"required_controls": ("sidecar",)},
     "OfflineGateConfig.required_controls"),
    (DecodeGateConfig, {"min_timely_recall": float("nan")}, "DecodeGateConfig.min_timely"),
    (ShadowGateConfig, {"max_byte_amplification_ratio": 0.5},
     "ShadowGateConfig.max_byte_amplification_ratio"),
    (FalsifierConfig, {"match_tolerance": True}, "FalsifierConfig.match_tolerance"),
    (QualificationConfig, {"offline": DecodeGateConfig()}, "QualificationConfig.offline"),
    (ServiceObjective, {"name": "", "min_throughput_gain": 0.1}, "ServiceObjective.name"),
    (ServiceObjective, {"name": "x", "min_exposed_wait_reduction": 1.5},
     "ServiceObjective.min_exposed_wait_reduction"),
    (ServiceObjective, {"name": "x", "min_throughput_gain": 0.1, "max_p95_regression": -1},
     "ServiceObjective.max_p95_regression"),
])
def test_invalid_fields_are_named(factory: Any, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        factory(**kwargs)


def test_configs_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        OfflineGateConfig(4)  # type: ignore[call-arg]
    config = QualificationConfig()
    with pytest.raises(AttributeError):
        config.offline = OfflineGateConfig()  # type: ignore[misc]


def test_objective_statement_says_what_was_declared() -> None:
    objective = ServiceObjective(name="tail-safe", min_exposed_wait_reduction=0.25,
                                 max_p95_regression=0.05, max_p99_regression=0.1)
    text = objective.statement()
    assert text.startswith("tail-safe: exposed I/O wait reduced by >= 25.0%")
    assert "p95 per-step wait regression <= 5.0%" in text and "evidence: simulator" in text
