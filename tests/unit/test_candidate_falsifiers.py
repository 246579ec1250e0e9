"""Falsifiers #3 and #6 on candidate-path evidence, wired into the qualification."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hebrus_flywheel.train.candidates.train import CandidateTrainConfig
from hebrus_flywheel.train.qualify import (
    FALSIFIED,
    NOT_FALSIFIED,
    NOT_MEASURABLE,
    evaluate_falsifiers,
    inputs_from_mapping,
)
from hebrus_flywheel.train.qualify.candidate_evidence import candidate_evidence
from hebrus_flywheel.train.qualify.falsifiers_candidates import (
    falsifier3_verdict,
    falsifier6_verdict,
)
from hebrus_flywheel.train.qualify.parse import inputs_to_mapping
from hebrus_flywheel.train.qualify.plots import render_plots
from tests.support.candidates import candidate_table

FIXTURE = Path(__file__).resolve().parents[1] / "assets" / "qualify_inputs.json"
TRAIN = CandidateTrainConfig(width=16, steps=60, batch_size=128, eval_every=20, lr=1e-2)


def _evidence(**table):
    kwargs = {"proposals": 60, "experts": 16, "top_k": 2, **table}
    evidence, _ = candidate_evidence(candidate_table(**kwargs), expert_count=16,
                                     expert_bytes=100, train_config=TRAIN,
                                     replay_cost_s_per_accepted_token=0.01, source="fixture")
    return evidence


@pytest.fixture(scope="module")
def learnable():
    return _evidence()


def test_without_a_candidate_snapshot_3_is_not_measurable():
    result = falsifier3_verdict(None)
    assert result["verdict"] == NOT_MEASURABLE and "candidate-path snapshot" in result["reason"]


def test_routes_learned_from_candidate_features_do_not_falsify_3(learnable):
    result = falsifier3_verdict(learnable)
    assert result["verdict"] == NOT_FALSIFIED, result["reason"]
    f = result["figures"]
    assert f["token_accuracy"] == learnable.token_accuracy > 0.8
    assert f["route_recall"] > f["control_recall"] + 0.02
    assert f["control"] != "previous_position"  # optimistic controls are not the bar


def test_tokens_without_routes_falsify_3():
    evidence = _evidence(feature_signal=0.0)
    result = falsifier3_verdict(evidence)
    assert result["verdict"] == FALSIFIED, result["reason"]
    assert "do not predict target routes" in result["reason"]
    weak_drafter = dataclasses.replace(evidence, acceptance={"1": 0.1, "2": 0.01})
    assert falsifier3_verdict(weak_drafter)["verdict"] == NOT_MEASURABLE


@pytest.mark.parametrize(("saving", "tokens", "expected"), [
    (1e-3, 1e6, NOT_FALSIFIED), (1e-3, 10.0, FALSIFIED), (0.0, 1e6, FALSIFIED),
    (1e-3, None, NOT_MEASURABLE), (None, 1e6, NOT_MEASURABLE)])
def test_6_weighs_measured_replay_cost_against_savings(saving, tokens, expected):
    result = falsifier6_verdict(replay_cost_s_per_accepted_token=0.02, accepted_tokens=500,
                                saving_s_per_token=saving, deployment_tokens=tokens)
    assert result["verdict"] == expected, result["reason"]
    assert result["figures"]["candidate_replay_cost_s"] == pytest.approx(10.0)
    if saving:
        assert result["figures"]["break_even_deployment_tokens"] == pytest.approx(1e4)
    none = falsifier6_verdict(replay_cost_s_per_accepted_token=None, accepted_tokens=500,
                              saving_s_per_token=saving, deployment_tokens=tokens)
    assert none["verdict"] == NOT_MEASURABLE


def test_qualification_reads_candidate_evidence(learnable, tmp_path):
    raw = json.loads(FIXTURE.read_text(encoding="utf-8"))
    before = {f.number: f for f in evaluate_falsifiers(inputs_from_mapping(raw))}
    raw["candidates"] = inputs_to_mapping(
        dataclasses.replace(inputs_from_mapping(raw), candidates=learnable))["candidates"]
    raw["economics"] = {"candidate_replay_cost_s": 1.0, "deployment_tokens": 1e9}
    inputs = inputs_from_mapping(json.loads(json.dumps(raw)))
    assert inputs.candidates == learnable
    after = {f.number: f for f in evaluate_falsifiers(inputs)}
    assert before[3].status == NOT_MEASURABLE and after[3].status == NOT_FALSIFIED
    assert after[6].figures["replay_cost_s_per_accepted_token"] == 0.01
    assert after[6].figures["accepted_tokens"] == learnable.accepted_tokens
    assert after[6].status in (FALSIFIED, NOT_FALSIFIED)
    assert "governor" in render_plots(inputs) and "governor" not in render_plots(
        inputs_from_mapping(json.loads(FIXTURE.read_text(encoding="utf-8"))))


def test_governor_uses_model_b_predicted_union(learnable):
    table = learnable.governor["tables"]["validation"]
    assert all(row["predicted_union"] is not None for row in table)
    breaks_even = any(row["break_even"] for row in table)
    assert (learnable.governor["recommended_block"] is not None) == breaks_even
    assert learnable.governor["admission"]["validation"]["paths"] > 0


def test_gates_read_candidate_parity_model_b_and_its_p2_hints():
    from hebrus_flywheel.core.geometry import RouteGeometry
    from hebrus_flywheel.train.qualify import (
        FAIL,
        PASS,
        QualificationConfig,
        gate1_replay,
        gate3_offline,
        gate5_shadow,
    )
    from hebrus_flywheel.train.sim import SimConfig

    shape = RouteGeometry(family="t", routed_layers=(0, 1), layer_count=2, expert_count=16,
                          top_k=2, hidden_size=10, routed_intermediate_size=10)
    sim = SimConfig(geometry=shape, dtype_bytes=1.0, attention_time_s=1e-3, moe_time_s=1e-3,
                    step_overhead_s=0.0, ssd_bandwidth_bytes_per_s=3e5, ssd_latency_s=0.0,
                    ssd_queue_depth=4, cache_capacity_experts=64)
    parity = {"authoritative": True, "pairs": 40, "paths": 8, "candidate_ids_exact": 1.0,
              "candidate_rank_exact": 1.0, "accepted_prefix_digest_parity": 1.0}
    evidence, _ = candidate_evidence(
        candidate_table(proposals=60, experts=16, top_k=2), expert_count=16, expert_bytes=100,
        train_config=TRAIN, source="fixture", parity=parity, sim_config=sim)
    assert evidence.p2_shadow is not None
    assert "exposed_wait_reduction" in evidence.p2_shadow["metrics"]
    raw = json.loads(FIXTURE.read_text(encoding="utf-8"))
    plain = inputs_from_mapping(raw)
    raw["candidates"] = inputs_to_mapping(
        dataclasses.replace(plain, candidates=evidence))["candidates"]
    inputs = inputs_from_mapping(json.loads(json.dumps(raw)))  # survives the JSON round trip
    assert inputs.candidates == evidence
    config = QualificationConfig()

    def check(verdict, name):
        return next(c for c in verdict.checks if c.name == name)

    assert check(gate1_replay(inputs, config.replay), "candidate_parity").status == PASS
    wrong = dataclasses.replace(inputs, candidates=dataclasses.replace(
        evidence, parity={**parity, "candidate_rank_exact": 0.99}))
    assert check(gate1_replay(wrong, config.replay), "candidate_parity").status == FAIL
    absent = check(gate1_replay(plain, config.replay), "candidate_parity")
    assert absent.status == NOT_MEASURABLE and not absent.required
    model_b = check(gate3_offline(inputs, config.offline), "candidate_sidecar_validation")
    assert model_b.status in (PASS, FAIL) and "accepted candidate rows" in model_b.measured
    assert not check(gate3_offline(plain, config.offline), "candidate_sidecar").required
    shadow = gate5_shadow(inputs, config.shadow)
    assert shadow.figures["candidate_p2"]["split"] == evidence.p2_shadow["split"]
    hints = check(shadow, "candidate_p2_hints")
    assert not hints.required and "advisory" in hints.threshold
    p2 = evidence.p2_shadow
    wasteful = dataclasses.replace(inputs, candidates=dataclasses.replace(evidence, p2_shadow={
        **p2, "metrics": {**p2["metrics"], "useful_prefetch_ratio": 0.2}}))
    assert hints.status == PASS
    assert check(gate5_shadow(wasteful, config.shadow), "candidate_p2_hints").status == FAIL
    loose = dataclasses.replace(config.shadow, min_useful_prefetch_ratio=0.1)
    assert check(gate5_shadow(wasteful, loose), "candidate_p2_hints").status == PASS


def test_the_native_gate_on_candidate_features_is_a_control_model_b_must_beat():
    import numpy as np

    from hebrus_flywheel.train.predictor_data import GateWeights

    rng = np.random.default_rng(3)
    gate = GateWeights(router_LEH=rng.normal(size=(2, 16, 8)), norm_gain_LH=None, lift_DH=None)
    _, report = candidate_evidence(candidate_table(proposals=60, experts=16, top_k=2),
                                   expert_count=16, expert_bytes=100, train_config=TRAIN,
                                   gate=gate)
    assert any(line.get("model") == "native_gate" for line in report["lines"])
    _, without = candidate_evidence(candidate_table(proposals=60, experts=16, top_k=2),
                                    expert_count=16, expert_bytes=100, train_config=TRAIN)
    assert not any(line.get("model") == "native_gate" for line in without["lines"])
