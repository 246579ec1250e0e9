"""Falsifier verdicts on crafted inputs: each one can be falsified, not falsified, or not
measurable, with the reason and figures used."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.train.qualify import (
    FALSIFIED,
    NOT_FALSIFIED,
    NOT_MEASURABLE,
    STATEMENTS,
    FalsifierConfig,
    QualificationConfig,
    QualificationInputs,
    evaluate_falsifiers,
    inputs_from_mapping,
)
from hebrus_flywheel.train.qualify.falsifiers_io import cold_roofline, reference_rows

FIXTURE = Path(__file__).resolve().parents[1] / "assets" / "qualify_inputs.json"


@cache
def _text() -> str:
    return FIXTURE.read_text(encoding="utf-8")


def _raw() -> dict[str, Any]:
    return json.loads(_text())


def _verdicts(data: dict[str, Any] | None = None,
              config: QualificationConfig | None = None) -> dict[int, Any]:
    inputs: QualificationInputs = inputs_from_mapping(_raw() if data is None else data)
    return {f.number: f for f in evaluate_falsifiers(inputs, config)}


def test_ten_falsifiers_in_order_with_the_note_wording() -> None:
    verdicts = _verdicts()
    assert list(verdicts) == list(range(1, 11))
    assert verdicts[2].statement == STATEMENTS[2]
    assert "previous-token or adjacent-layer" in verdicts[2].statement
    statuses = {n: v.status for n, v in verdicts.items()}
    assert statuses == {1: NOT_FALSIFIED, 2: NOT_FALSIFIED, 3: NOT_MEASURABLE,
                        4: NOT_FALSIFIED, 5: NOT_FALSIFIED, 6: NOT_MEASURABLE,
                        7: NOT_FALSIFIED, 8: NOT_FALSIFIED, 9: NOT_FALSIFIED,
                        10: NOT_FALSIFIED}
    assert all(v.reason for v in verdicts.values())


def test_not_measurable_reasons_are_precise() -> None:
    verdicts = _verdicts()
    assert "DFlash candidate-position feature" in verdicts[3].reason
    assert "deployment token volume" in verdicts[6].reason
    # privacy is measured even on synthetic data, and the reason says what it is not
    assert "not production transcripts" in verdicts[8].reason
    assert "does not establish legal approval" in verdicts[8].reason


def test_1_parity() -> None:
    data = _raw()
    data["parity"]["mismatches"] = 2
    assert _verdicts(data)[1].status == FALSIFIED
    data["parity"].update(mismatches=0, authoritative=False)
    assert _verdicts(data)[1].status == NOT_MEASURABLE
    data["parity"] = None
    assert _verdicts(data)[1].status == NOT_MEASURABLE


def _set_recall(data: dict[str, Any], method: str, split: str, budget: int,
                value: float) -> None:
    result = next(r for r in data["offline"]["results"] if r["method"] == method)
    result["splits"][split]["overall"]["recall"][str(budget)] = value


def test_2_heuristic_matching_the_learned_predictor_falsifies() -> None:
    data = _raw()
    _set_recall(data, "adjacent_layer", "validation", 4, 0.85)
    verdict = _verdicts(data)[2]
    assert verdict.status == FALSIFIED and "adjacent_layer" in verdict.reason
    assert verdict.figures["byte_budget"] == 4 * 12288
    data["offline"]["results"] = [r for r in data["offline"]["results"]
                                  if r["method"] not in ("adjacent_layer", "previous_token")]
    assert _verdicts(data)[2].status == NOT_MEASURABLE


def test_2_ignores_frequency_and_lru() -> None:
    data = _raw()
    _set_recall(data, "lru", "validation", 4, 0.99)
    assert _verdicts(data)[2].status == NOT_FALSIFIED


def test_3_dflash_feature_predictors() -> None:
    data = _raw()
    data["offline"]["features"] = {"sidecar": "dflash_candidate"}
    assert _verdicts(data)[3].status == NOT_FALSIFIED
    _set_recall(data, "sidecar", "validation", 4, 0.6)
    assert _verdicts(data)[3].status == FALSIFIED


def test_4_byte_amplification_rising_with_useful_recall() -> None:
    strict = QualificationConfig(falsifiers=FalsifierConfig(max_byte_amplification_ratio=1.2))
    verdict = _verdicts(config=strict)[4]
    assert verdict.status == FALSIFIED and "(4 candidates)" in verdict.reason
    unreachable = QualificationConfig(falsifiers=FalsifierConfig(useful_timely_recall=0.99))
    assert _verdicts(config=unreachable)[4].status == NOT_MEASURABLE
    data = _raw()
    data["shadow_io"]["sweep"] = []
    assert _verdicts(data)[4].status == NOT_MEASURABLE


def test_4_uses_the_declared_bandwidth() -> None:
    inputs = inputs_from_mapping(_raw())
    assert inputs.shadow_io is not None
    bandwidth, rows = reference_rows(inputs.shadow_io)
    assert bandwidth == 1.5e8
    assert [r["candidate_budget"] for r in rows] == [4, 8, 12, 16]  # the fixture's k..4k


def test_5_late_predictions() -> None:
    data = _raw()
    data["shadow_io"]["metrics"]["exposed_wait_reduction"] = 0.02
    verdict = _verdicts(data)[5]
    assert verdict.status == FALSIFIED and "2.0%" in verdict.reason
    assert verdict.figures["timely_recall"] is not None
    data["shadow_io"]["metrics"]["exposed_wait_reduction"] = None
    assert _verdicts(data)[5].status == NOT_MEASURABLE


def test_6_economics() -> None:
    data = _raw()
    data["economics"] = {"candidate_replay_cost_s": 10.0, "deployment_tokens": 1e6}
    verdict = _verdicts(data)[6]
    assert verdict.status == NOT_FALSIFIED and "shadow simulation" in verdict.reason
    data["economics"] = {"candidate_replay_cost_s": 1e9, "deployment_tokens": 10.0,
                         "saving_s_per_token": 1e-3}
    assert _verdicts(data)[6].status == FALSIFIED


def test_7_drift_on_the_temporal_holdout() -> None:
    data = _raw()
    _set_recall(data, "sidecar", "temporal_holdout", 4, 0.5)
    verdict = _verdicts(data)[7]
    assert verdict.status == FALSIFIED and "one temporal step" in verdict.reason
    for result in data["offline"]["results"]:
        result["splits"].pop("temporal_holdout")
    assert _verdicts(data)[7].status == NOT_MEASURABLE


def test_8_privacy() -> None:
    data = _raw()
    data["integrity"]["authorization"].update(production_transcripts=True, approved=True)
    data["integrity"]["consent"]["rows_granted"] -= 1  # measured: one row without a grant
    assert _verdicts(data)[8].status == FALSIFIED  # whatever the declaration says
    data["integrity"]["consent"]["rows_granted"] += 1
    assert _verdicts(data)[8].status == NOT_FALSIFIED
    data["integrity"]["authorization"]["deletion_supported"] = None  # no erasure drill
    assert _verdicts(data)[8].status == FALSIFIED  # production data fail closed
    data["integrity"]["authorization"]["production_transcripts"] = False
    assert _verdicts(data)[8].status == NOT_MEASURABLE
    data["integrity"]["authorization"].update(production_transcripts=True,
                                              deletion_supported=True)
    data["integrity"]["consent"] = None  # authorization not measured
    assert _verdicts(data)[8].status == FALSIFIED
    data["integrity"]["authorization"] = None
    assert _verdicts(data)[8].status == NOT_MEASURABLE


def test_9_cold_byte_roofline() -> None:
    data = _raw()
    verdict = _verdicts(data)[9]
    assert verdict.figures["roofline"]["max_hideable_fraction"] == 1.0
    data["shadow_io"]["oracle"]["hidden_fraction"] = 0.2
    assert _verdicts(data)[9].status == FALSIFIED
    data["shadow_io"]["oracle"] = None
    assert _verdicts(data)[9].status == NOT_MEASURABLE


def test_cold_roofline_arithmetic() -> None:
    data = _raw()
    data["shadow_io"]["sim_config"]["ssd_bandwidth_bytes_per_s"] = 4 * 4 * 12288 / 0.01
    roofline = cold_roofline(inputs_from_mapping(data))
    assert roofline is not None
    # 4 layers x 4 experts x 12288 B in 10 ms; compute 4 x 400 us + 1 ms = 2.6 ms
    assert abs(roofline["cold_io_s_per_token"] - 0.01) < 1e-12
    assert abs(roofline["compute_s_per_token"] - 0.0026) < 1e-12
    assert abs(roofline["max_hideable_fraction"] - 0.26) < 1e-9


def test_10_loader_versus_trainer() -> None:
    data = _raw()
    data["throughput"] = {"loader_examples_per_s": 1000.0, "trainer_examples_per_s": 3000.0}
    verdict = _verdicts(data)[10]
    assert verdict.status == FALSIFIED
    assert verdict.figures["estimated_wait_per_compute"] == pytest.approx(2.0)
    data["throughput"] = {"data_wait_s": 1.0, "compute_s": 9.0, "device": "rtx3090x2"}
    verdict = _verdicts(data)[10]
    assert verdict.status == NOT_FALSIFIED and "rtx3090x2" in verdict.reason
    data["throughput"] = {"loader_examples_per_s": 1000.0}
    assert _verdicts(data)[10].status == NOT_MEASURABLE
    data["throughput"] = None
    assert _verdicts(data)[10].status == NOT_MEASURABLE


def test_everything_missing_is_not_measurable() -> None:
    data = {k: v for k, v in _raw().items()
            if k in ("snapshot_id", "checkpoint_lineage", "identity", "geometry",
                     "expert_bytes")}
    assert {v.status for v in _verdicts(data).values()} == {NOT_MEASURABLE}
