"""Every gate check and falsifier names the measured figure, the threshold it was
compared against and why it passed, failed or was not measured; report.json carries
those fields and report.html shows them as columns."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from hebrus_flywheel.train.qualify import (
    FAIL,
    NOT_MEASURABLE,
    DecodeGateConfig,
    QualificationConfig,
    ShadowGateConfig,
    evaluate_falsifiers,
    evaluate_gates,
    gate2_integrity,
    gate3_offline,
    gate4_decode,
    gate5_shadow,
    inputs_from_mapping,
    load_inputs,
)
from hebrus_flywheel.train.qualify.config import OfflineGateConfig
from hebrus_flywheel.train.qualify.report_html import _check_row, _falsifiers
from hebrus_flywheel.train.qualify.verdict import NOT_MEASURED, Check

FIXTURE = Path(__file__).resolve().parents[1] / "assets" / "qualify_inputs.json"
CFG = QualificationConfig()


def _raw() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def _edit(section: str, **fields: Any) -> Any:
    data = _raw()
    data[section].update(fields)
    return inputs_from_mapping(data)


def _failed(checks: list[Check], name: str) -> Check:
    check = next(c for c in checks if c.name == name)
    assert check.status == FAIL, check
    return check


def test_every_check_and_falsifier_of_the_fixture_has_structured_fields() -> None:
    inputs = load_inputs(FIXTURE)
    for verdict in evaluate_gates(inputs):
        for check in verdict.checks:
            assert check.measured and check.threshold and check.reason, (verdict.gate, check)
            row = check.to_dict()
            assert list(row)[:5] == ["name", "status", "measured", "threshold", "reason"]
    for f in evaluate_falsifiers(inputs):
        assert f.measured and f.threshold, f
        assert {"measured", "threshold"} <= set(f.to_dict())


def test_a_failing_gate3_row_names_the_recall_and_the_margin() -> None:
    verdict = gate3_offline(load_inputs(FIXTURE), OfflineGateConfig(margin=0.9))
    check = _failed(verdict.checks, "beats_controls_validation")
    assert "recall@" in check.measured and "vs strongest control" in check.measured
    assert "+ 0.900" in check.threshold and "OfflineGateConfig.margin" in check.threshold
    assert "less than the margin 0.900" in check.reason
    html = _check_row(check.to_dict())
    assert check.measured in html and "OfflineGateConfig.margin" in html and "fail" in html


def test_a_failing_gate4_row_names_the_timely_recall_and_its_bound() -> None:
    verdict = gate4_decode(_edit("decode", timely_recall=0.3), DecodeGateConfig())
    check = _failed(verdict.checks, "timely_recall")
    assert check.measured == "real-decode timely recall 0.300"
    assert check.threshold == ">= 0.500 (DecodeGateConfig.min_timely_recall)"
    assert "(threshold: >= 0.500" in check.detail and "— failed" in check.detail


def test_a_failing_gate5_row_names_the_amplification_and_its_bound() -> None:
    verdict = gate5_shadow(load_inputs(FIXTURE),
                           ShadowGateConfig(max_byte_amplification_ratio=1.0))
    check = next(c for c in verdict.checks if c.name == "byte_amplification")
    if check.status != FAIL:  # the fixture reads no extra bytes: bound the useful ratio
        verdict = gate5_shadow(load_inputs(FIXTURE),
                               ShadowGateConfig(min_useful_prefetch_ratio=1.0))
        check = _failed(verdict.checks, "useful_prefetch_ratio")
        assert check.threshold.startswith(">= 1.000")
    assert "ShadowGateConfig." in check.threshold and check.measured


def test_a_failing_gate2_row_names_the_shared_threads() -> None:
    data = _raw()
    data["integrity"]["splits"]["validation"]["thread_ids"].append("train-t3")
    check = _failed(gate2_integrity(inputs_from_mapping(data), CFG.integrity).checks,
                    "thread_disjoint")
    assert check.measured.startswith("1 thread(s) shared") and "train-t3" in check.measured
    assert check.threshold == "0 threads shared between any two splits"


def test_an_unmeasured_row_says_what_is_missing_and_its_threshold() -> None:
    inputs = replace(load_inputs(FIXTURE), decode=None)
    check = gate4_decode(inputs, CFG.decode).checks[0]
    assert check.status == NOT_MEASURABLE and check.measured == NOT_MEASURED
    assert "runtime_holdout" in check.reason and "timely recall >= 0.500" in check.threshold


def test_falsifier_table_has_measured_and_threshold_columns() -> None:
    report = {"falsifiers": [f.to_dict() for f in evaluate_falsifiers(load_inputs(FIXTURE))]}
    html = _falsifiers(report)
    assert "<th>measured</th><th>threshold</th>" in html
    assert "FalsifierConfig.meaningful_wait_reduction" in html
