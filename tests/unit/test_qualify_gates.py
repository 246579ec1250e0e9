"""Gate verdicts on crafted inputs: each gate passes, fails, and is not measurable when
its evidence is missing, never passing by default."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.train.qualify import (
    FAIL,
    NOT_MEASURABLE,
    PASS,
    DecodeGateConfig,
    DeterminismEvidence,
    IntegrityGateConfig,
    OfflineGateConfig,
    QualificationConfig,
    QualificationInputs,
    ReplayGateConfig,
    RuntimeEvidence,
    ServiceObjective,
    ShadowGateConfig,
    evaluate_gates,
    gate1_replay,
    gate2_integrity,
    gate3_offline,
    gate4_decode,
    gate5_shadow,
    gate6_promotion,
    inputs_from_mapping,
)
from hebrus_flywheel.train.qualify.verdict import Check, combine

FIXTURE = Path(__file__).resolve().parents[1] / "assets" / "qualify_inputs.json"


@cache
def _text() -> str:
    return FIXTURE.read_text(encoding="utf-8")


def _raw() -> dict[str, Any]:
    return json.loads(_text())


def _inputs(**changes: Any) -> QualificationInputs:
    data = _raw()
    for key, value in changes.items():
        data[key] = value
    return inputs_from_mapping(data)


def _edit(section: str, **fields: Any) -> QualificationInputs:
    data = _raw()
    data[section].update(fields)
    return inputs_from_mapping(data)


CFG = QualificationConfig()


def test_the_fixture_passes_every_gate() -> None:
    verdicts = evaluate_gates(_inputs())
    assert [v.gate for v in verdicts] == [1, 2, 3, 4, 5, 6]
    assert [v.status for v in verdicts] == [PASS] * 6, [v.reasons for v in verdicts]


def test_combine_is_fail_closed() -> None:
    ok = Check(name="a", status=PASS, detail="")
    optional = Check(name="b", status=NOT_MEASURABLE, detail="", required=False)
    required = Check(name="c", status=NOT_MEASURABLE, detail="")
    failed = Check(name="d", status=FAIL, detail="", required=False)
    assert combine([]) == NOT_MEASURABLE
    assert combine([ok, optional]) == PASS
    assert combine([ok, required]) == NOT_MEASURABLE
    assert combine([ok, required, failed]) == FAIL


@pytest.mark.parametrize("section", ["parity", "determinism", "fail_closed", "integrity",
                                     "offline", "decode", "shadow_io", "objective"])
def test_a_missing_piece_never_passes(section: str) -> None:
    inputs = _inputs(**{section: None})
    statuses = {v.gate: v.status for v in evaluate_gates(inputs)}
    assert statuses[6] != PASS
    assert NOT_MEASURABLE in statuses.values()
    assert FAIL not in statuses.values()


def test_nothing_at_all_is_not_measurable_everywhere() -> None:
    data = {k: v for k, v in _raw().items()
            if k in ("snapshot_id", "checkpoint_lineage", "identity", "geometry",
                     "expert_bytes")}
    verdicts = evaluate_gates(inputs_from_mapping(data))
    assert {v.status for v in verdicts} == {NOT_MEASURABLE}
    assert all(v.reasons for v in verdicts)


# Gate 1 ------------------------------------------------------------------------------


def test_gate1_fails_on_any_parity_mismatch_even_with_override() -> None:
    inputs = _edit("parity", mismatches=1, override_reason="operator said so")
    verdict = gate1_replay(inputs, CFG.replay)
    assert verdict.status == FAIL
    assert "239/240" in verdict.headline and "(threshold: all)" in verdict.headline
    assert "do not train" in verdict.headline


def test_gate1_non_authoritative_needs_an_override() -> None:
    assert gate1_replay(_edit("parity", authoritative=False), CFG.replay).status == FAIL
    overridden = gate1_replay(_edit("parity", authoritative=False,
                                    override_reason="tolerance run"), CFG.replay)
    assert overridden.status == PASS
    assert any("override: tolerance run" in r for r in overridden.reasons)


def test_gate1_zero_compared_fails_closed() -> None:
    assert gate1_replay(_edit("parity", compared=0, mismatches=0), CFG.replay).status == FAIL


def test_gate1_nondeterministic_rebuild_fails() -> None:
    verdict = gate1_replay(_edit("determinism", rebuild_digest="sha256-bb22"), CFG.replay)
    assert verdict.status == FAIL and "not deterministic" in verdict.headline


def test_gate1_without_rebuild_is_not_measurable_unless_configured() -> None:
    inputs = _inputs(determinism=None)
    assert gate1_replay(inputs, CFG.replay).status == NOT_MEASURABLE
    relaxed = gate1_replay(inputs, ReplayGateConfig(require_rebuild=False))
    assert relaxed.status == PASS
    assert any("(optional, not measured) no rebuild" in r for r in relaxed.reasons)


def test_gate1_unaccounted_records_and_quarantine_bound() -> None:
    assert gate1_replay(_edit("fail_closed", records_accepted=980), CFG.replay).status == FAIL
    bounded = ReplayGateConfig(max_quarantine_fraction=0.005)
    verdict = gate1_replay(_inputs(), bounded)
    assert verdict.status == FAIL and "1.00% of records quarantined" in verdict.headline


def test_gate1_record_accounting_is_measured_by_the_streams_ledger() -> None:
    ledger = {"records": 1000, "windowed": 700, "quarantined": 10, "duplicate": 40,
              "in_windowed_generation": 250, "pending": 0, "unaccounted": 0}
    verdict = gate1_replay(_edit("fail_closed", accounting=ledger), CFG.replay)
    assert verdict.status == PASS
    [check] = [c for c in verdict.checks if c.name == "record_accounting"]
    assert check.status == PASS and "1,000 consumed capture records" in check.measured
    assert "40 duplicate" in check.measured and "0 unaccounted" in check.measured
    assert verdict.figures["fail_closed"]["accounting"] == dict(sorted(ledger.items()))
    lost = gate1_replay(_edit("fail_closed", accounting={**ledger, "unaccounted": 3}),
                        CFG.replay)
    assert lost.status == FAIL and any("3 unaccounted" in r for r in lost.reasons)


def test_gate1_figures_are_reported() -> None:
    figures = gate1_replay(_inputs(), CFG.replay).figures
    assert figures["parity"]["parity_rate"] == 1.0
    assert figures["fail_closed"]["quarantined_by_reason"] == {
        "counter_regression": 4, "identity_digest_mismatch": 6}
    assert figures["determinism"]["identical"] is True


def test_determinism_identity_property() -> None:
    same = DeterminismEvidence(snapshot_digest="a", rebuild_digest="a", shards_differing=1)
    assert not same.identical


# Gate 2 ------------------------------------------------------------------------------


def _integrity(mutate: Any) -> QualificationInputs:
    data = _raw()
    mutate(data["integrity"])
    return inputs_from_mapping(data)


def test_gate2_fails_on_thread_overlap() -> None:
    def share(i: dict[str, Any]) -> None:
        i["splits"]["validation"]["thread_ids"].append("train-t3")
    verdict = gate2_integrity(_integrity(share), CFG.integrity)
    assert verdict.status == FAIL and "train/validation: 1 (train-t3)" in verdict.headline


def test_gate2_fails_on_upstream_owner_overlap_unless_allowed() -> None:
    def share(i: dict[str, Any]) -> None:
        i["overlaps"] = [{"kind": "owner", "splits": ["train", "validation"],
                          "ids": ["o-9"], "count": 4}]
    inputs = _integrity(share)
    verdict = gate2_integrity(inputs, CFG.integrity)
    assert verdict.status == FAIL and "owners shared" in verdict.headline
    allowed = gate2_integrity(inputs, IntegrityGateConfig(allow_owner_overlap=True))
    assert allowed.status == PASS


def test_gate2_allows_owners_shared_with_a_per_thread_holdout() -> None:
    def share(i: dict[str, Any]) -> None:
        i["overlaps"] = [{"kind": "owner", "splits": ["train", "temporal_holdout"],
                          "ids": ["o-9"], "count": 4}]
    inputs = _integrity(share)
    assert gate2_integrity(inputs, CFG.integrity).status == PASS
    strict = IntegrityGateConfig(owner_disjoint_pairs=(("train", "temporal_holdout"),))
    assert gate2_integrity(inputs, strict).status == FAIL


def test_gate2_fails_on_identity_mismatch() -> None:
    def drift(i: dict[str, Any]) -> None:
        i["splits"]["validation"]["identity_digests"] = ["rt-other"]
    assert gate2_integrity(_integrity(drift), CFG.integrity).status == FAIL
    pinned = _inputs(identity={"runtime": "rt-pinned"})
    verdict = gate2_integrity(pinned, CFG.integrity)
    assert verdict.status == FAIL and "pins rt-pinned" in verdict.headline


def test_gate2_fails_on_remaining_near_duplicates() -> None:
    def keep(i: dict[str, Any]) -> None:
        i["near_duplicates"]["removed"] = 1
    verdict = gate2_integrity(_integrity(keep), CFG.integrity)
    assert verdict.status == FAIL and "2 remain" in verdict.headline


def test_gate2_missing_dedup_is_not_measurable_and_missing_coverage_optional() -> None:
    def drop(i: dict[str, Any]) -> None:
        i["near_duplicates"] = None
        i["splits"]["train"]["coverage"].pop("language")
    verdict = gate2_integrity(_integrity(drop), CFG.integrity)
    assert verdict.status == NOT_MEASURABLE
    assert any("coverage by language not reported for train" in r for r in verdict.reasons)


def test_gate2_authorization_is_measured_from_the_consent_ledger() -> None:
    verdict = gate2_integrity(_integrity(lambda i: None), CFG.integrity)
    assert verdict.status == PASS
    assert verdict.figures["consent"]["authorized_fraction"] == 1.0
    assert verdict.figures["consent"]["refused_records"] == 4

    def revoked(i: dict[str, Any]) -> None:
        i["consent"].update(rows_granted=600, owners_refused=1)
    failed = gate2_integrity(_integrity(revoked), CFG.integrity)
    assert failed.status == FAIL and any("40 rows have no live grant" in r
                                         for r in failed.reasons)

    def declared_only(i: dict[str, Any]) -> None:  # a declaration is not a measurement
        i["consent"] = None
    inputs = _integrity(declared_only)
    assert gate2_integrity(inputs, CFG.integrity).status == NOT_MEASURABLE
    lenient = IntegrityGateConfig(require_authorization=False)
    assert gate2_integrity(inputs, lenient).status == PASS

    def production(i: dict[str, Any]) -> None:
        i["authorization"].update(production_transcripts=True, deletion_supported=None)
    assert gate2_integrity(_integrity(production), CFG.integrity).status == FAIL


def test_gate2_reports_coverage() -> None:
    figures = gate2_integrity(_inputs(), CFG.integrity).figures
    assert figures["coverage"]["train"]["language"] == {"en": 5, "it": 1}
    assert figures["splits"]["validation"]["threads"] == 6


# Gate 3 ------------------------------------------------------------------------------


def _set_recall(data: dict[str, Any], method: str, split: str, budget: int,
                value: float) -> None:
    result = next(r for r in data["offline"]["results"] if r["method"] == method)
    result["splits"][split]["overall"]["recall"][str(budget)] = value


def test_gate3_passes_at_equal_budget_and_reports_bytes() -> None:
    verdict = gate3_offline(_inputs(), CFG.offline)
    assert verdict.status == PASS
    f = verdict.figures
    assert f["budget"] == 4 and f["byte_budget"] == 4 * 12288
    assert [b["bytes"] for b in f["budgets"]] == [b * 12288 for b in (4, 8, 12, 16)]
    assert f["strongest_control"]["validation"]["method"] == "lru"
    assert set(f["methods"]["validation"]) == {"random", "frequency", "lru", "previous_token",
                                              "adjacent_layer", "sidecar"}
    assert f["by_layer"]["validation"]["lost"] == 0


def test_gate3_fails_when_a_control_is_within_the_margin() -> None:
    data = _raw()
    _set_recall(data, "previous_token", "validation", 4, 0.85)
    verdict = gate3_offline(inputs_from_mapping(data), CFG.offline)
    assert verdict.status == FAIL
    assert "strongest control previous_token 0.850" in verdict.headline


def test_gate3_decides_on_every_decision_split() -> None:
    data = _raw()
    _set_recall(data, "sidecar", "temporal_holdout", 4, 0.5)
    inputs = inputs_from_mapping(data)
    assert gate3_offline(inputs, CFG.offline).status == PASS
    both = OfflineGateConfig(decision_splits=("validation", "temporal_holdout"))
    assert gate3_offline(inputs, both).status == FAIL


def test_gate3_missing_required_control_is_not_measurable() -> None:
    data = _raw()
    data["offline"]["results"] = [r for r in data["offline"]["results"]
                                  if r["method"] != "adjacent_layer"]
    verdict = gate3_offline(inputs_from_mapping(data), CFG.offline)
    assert verdict.status == NOT_MEASURABLE and "adjacent_layer" in verdict.headline


def test_gate3_unequal_rows_or_budget_is_not_measurable() -> None:
    data = _raw()
    data["offline"]["results"][0]["splits"]["validation"]["overall"]["rows"] = 1
    verdict = gate3_offline(inputs_from_mapping(data), CFG.offline)
    assert verdict.status == NOT_MEASURABLE and "different row counts" in verdict.headline
    odd = gate3_offline(_inputs(), OfflineGateConfig(budget=5))
    assert odd.status == NOT_MEASURABLE and "budget 5" in odd.headline


def test_gate3_missing_decision_split_is_not_measurable() -> None:
    config = OfflineGateConfig(decision_splits=("stress_holdout",))
    assert gate3_offline(_inputs(), config).status == NOT_MEASURABLE


def test_gate3_calibration_bound() -> None:
    assert gate3_offline(_inputs(), OfflineGateConfig(max_ece=0.5)).status == PASS
    assert gate3_offline(_inputs(), OfflineGateConfig(max_ece=0.001)).status == FAIL


# Gate 4 ------------------------------------------------------------------------------


def test_gate4_fails_on_a_large_replay_to_decode_gap() -> None:
    verdict = gate4_decode(_edit("decode", real_decode_recall=0.7), CFG.decode)
    assert verdict.status == FAIL and "gap +0.156" in verdict.headline


def test_gate4_fails_on_low_timely_recall() -> None:
    verdict = gate4_decode(_edit("decode", timely_recall=0.3), CFG.decode)
    assert verdict.status == FAIL and "timely recall 0.300" in verdict.headline


def test_gate4_regenerated_captures_fail_and_missing_figures_are_not_measurable() -> None:
    assert gate4_decode(_edit("decode", captures_regenerated=True), CFG.decode).status == FAIL
    missing = gate4_decode(_edit("decode", timely_recall=None), CFG.decode)
    assert missing.status == NOT_MEASURABLE


def test_gate4_optional_timely_gap_bound() -> None:
    inputs = _edit("decode", timely_recall=0.7)
    assert gate4_decode(inputs, CFG.decode).status == PASS
    assert gate4_decode(inputs, DecodeGateConfig(max_timely_gap=0.05)).status == FAIL


# Gate 5 ------------------------------------------------------------------------------


def _shadow(**metrics: Any) -> QualificationInputs:
    data = _raw()
    data["shadow_io"]["metrics"].update(metrics)
    return inputs_from_mapping(data)


def test_gate5_reports_the_shadow_figures() -> None:
    verdict = gate5_shadow(_inputs(), CFG.shadow)
    assert verdict.status == PASS
    for key in ("predicted_bytes_read", "useful_bytes", "rejected_suffix_bytes",
                "exact_misses_avoided", "evictions_by_prefetch", "p0_starvation_attempts",
                "p1_starvation_attempts", "slack_p05_s", "exposed_wait_s", "break_even"):
        assert key in verdict.figures


def test_gate5_fails_when_byte_amplification_rises_too_far() -> None:
    data = _raw()
    m = data["shadow_io"]["metrics"]
    m["physical_bytes_read"] = 2 * m["baseline_physical_bytes_read"]
    verdict = gate5_shadow(inputs_from_mapping(data), CFG.shadow)
    assert verdict.status == FAIL and "x2.000" in verdict.headline


def test_gate5_fails_on_low_useful_ratio_and_no_misses_avoided() -> None:
    assert gate5_shadow(_shadow(useful_prefetch_ratio=0.1), CFG.shadow).status == FAIL
    assert gate5_shadow(_shadow(exact_misses_avoided=0), CFG.shadow).status == FAIL
    relaxed = ShadowGateConfig(require_misses_avoided=False)
    assert gate5_shadow(_shadow(exact_misses_avoided=0), relaxed).status == PASS


def test_gate5_pollution_and_starvation_bounds() -> None:
    caused = gate5_shadow(_shadow(pollution_misses_vs_baseline=10**6), CFG.shadow)
    assert caused.status == FAIL and "no-prediction cache still held" in caused.headline
    # Misses the no-prediction cache would have taken too are not pollution ...
    assert gate5_shadow(_shadow(pollution_misses=10**6, pollution_misses_vs_baseline=0),
                        CFG.shadow).status == PASS
    # ... but without the counterfactual count the gross one is the bound.
    data = _raw()
    del data["shadow_io"]["metrics"]["pollution_misses_vs_baseline"]
    data["shadow_io"]["metrics"]["pollution_misses"] = 10**6
    gross = gate5_shadow(inputs_from_mapping(data), CFG.shadow)
    assert gross.status == FAIL and "upper bound" in gross.headline
    strict = ShadowGateConfig(max_p0_starvation_per_token=0.0)
    starved = gate5_shadow(_shadow(p0_starvation_attempts=5), strict)
    assert starved.status == FAIL and "P0 starvation" in starved.headline


def test_gate5_without_baseline_is_not_measurable() -> None:
    data = _raw()
    for key in [k for k in data["shadow_io"]["metrics"] if k.startswith("baseline_")]:
        del data["shadow_io"]["metrics"][key]
    del data["shadow_io"]["metrics"]["exact_misses_avoided"]
    verdict = gate5_shadow(inputs_from_mapping(data), CFG.shadow)
    assert verdict.status == NOT_MEASURABLE
    assert _shadow(useful_prefetch_ratio=None).shadow_io is not None
    assert gate5_shadow(_shadow(useful_prefetch_ratio=None), CFG.shadow).status \
        == NOT_MEASURABLE


# Gate 6 ------------------------------------------------------------------------------


def _prior(inputs: QualificationInputs) -> list[Any]:
    return evaluate_gates(inputs)[:5]


def test_gate6_needs_a_declared_objective() -> None:
    inputs = _inputs(objective=None)
    verdict = gate6_promotion(inputs, _prior(inputs))
    assert verdict.status == NOT_MEASURABLE and "never assumed" in verdict.headline


def test_gate6_fails_when_the_objective_is_missed() -> None:
    inputs = _inputs()
    strict = replace(inputs, objective=ServiceObjective(name="x", min_exposed_wait_reduction=0.95))
    verdict = gate6_promotion(strict, _prior(strict))
    assert verdict.status == FAIL and "threshold: >= 95.0%" in verdict.headline
    assert verdict.figures["objective_met"] is False
    # the simulator's controls, same trace and budget, are reported beside the candidate
    assert strict.shadow_io is not None
    gate = {**strict.shadow_io.metrics, "exposed_wait_reduction": 0.125}
    with_control = replace(strict, shadow_io=replace(strict.shadow_io,
                                                     controls={"native_gate": gate}))
    verdict = gate6_promotion(with_control, _prior(with_control))
    assert verdict.figures["controls"]["native_gate"]["exposed_wait_reduction"] == 0.125


def test_gate6_bounds_tail_regression() -> None:
    data = _raw()
    m = data["shadow_io"]["metrics"]
    m["exposed_wait_step_p99_s"] = 2 * m["baseline_exposed_wait_step_p99_s"]
    inputs = inputs_from_mapping(data)
    verdict = gate6_promotion(inputs, _prior(inputs))
    assert verdict.status == FAIL and "p99" in verdict.headline
    loose = replace(inputs, objective=ServiceObjective(
        name="x", min_exposed_wait_reduction=0.2, max_p99_regression=1.5))
    assert gate6_promotion(loose, _prior(loose)).status == PASS


def test_gate6_throughput_objective() -> None:
    inputs = _inputs()
    tps = replace(inputs, objective=ServiceObjective(name="t", min_throughput_gain=0.01))
    verdict = gate6_promotion(tps, _prior(tps))
    assert verdict.status == PASS and "tokens/s" in verdict.headline


def test_gate6_needs_gates_1_to_5() -> None:
    inputs = _edit("parity", mismatches=3)
    verdict = gate6_promotion(inputs, _prior(inputs))
    assert verdict.status == FAIL and "gate(s) 1 failed" in verdict.headline
    unknown = _inputs(determinism=None)
    assert gate6_promotion(unknown, _prior(unknown)).status == NOT_MEASURABLE


def test_gate6_runtime_evidence_is_required_when_declared() -> None:
    inputs = _inputs()
    runtime_objective = ServiceObjective(name="canary", min_exposed_wait_reduction=0.2,
                                         evidence="runtime")
    needs = replace(inputs, objective=runtime_objective)
    assert gate6_promotion(needs, _prior(needs)).status == NOT_MEASURABLE
    metrics = copy.deepcopy(inputs.shadow_io.metrics)  # type: ignore[union-attr]
    changed = replace(needs, runtime=RuntimeEvidence(metrics=metrics, output_preserved=False))
    verdict = gate6_promotion(changed, _prior(changed))
    assert verdict.status == FAIL and "CHANGED" in verdict.headline
    kept = replace(needs, runtime=RuntimeEvidence(metrics=metrics, output_preserved=True))
    assert gate6_promotion(kept, _prior(kept)).status == PASS


def _check(verdict: Any, name: str) -> Any:
    return next(c for c in verdict.checks if c.name == name)


def test_gate1_token_parity_is_a_measured_figure() -> None:
    check = _check(gate1_replay(_inputs(), CFG.replay), "token_parity")
    assert check.status == PASS
    assert check.detail == ("token ids equal at 60/60 anchors and positions at 60/60 "
                            "(threshold: all) — passed")


@pytest.mark.parametrize("bad", [{"token_mismatches": 1}, {"position_mismatches": 2},
                                 {"tokens_compared": 0, "token_mismatches": 0,
                                  "position_mismatches": 0}])
def test_gate1_fails_on_planted_token_or_position_mismatches(bad: dict[str, int]) -> None:
    verdict = gate1_replay(_edit("parity", **bad), CFG.replay)
    assert verdict.status == FAIL
    assert _check(verdict, "token_parity").status == FAIL


def test_gate1_token_parity_unreported_is_not_a_pass() -> None:
    verdict = gate1_replay(_edit("parity", tokens_compared=None), CFG.replay)
    assert verdict.status == NOT_MEASURABLE
    assert _check(verdict, "token_parity").status == NOT_MEASURABLE


def test_gate1_opaque_id_reuse_is_measured_and_fails_on_reuse() -> None:
    good = _check(gate1_replay(_inputs(), CFG.replay), "opaque_id_reuse")
    assert good.status == PASS
    assert "0 of 48 window_ids; 0 of 18 sequence_ids (threshold: 0) — passed" in good.detail
    data = _raw()
    data["opaque_ids"][1].update(reused=1, examples=["seq-7: o1 g0, o2 g0"])
    verdict = gate1_replay(inputs_from_mapping(data), CFG.replay)
    assert verdict.status == FAIL
    assert "seq-7: o1 g0, o2 g0" in _check(verdict, "opaque_id_reuse").detail
    data["opaque_ids"] = None
    missing = gate1_replay(inputs_from_mapping(data), CFG.replay)
    assert missing.status == NOT_MEASURABLE
