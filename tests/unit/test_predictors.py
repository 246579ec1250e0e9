"""Learned predictors: shapes, the gate prior starts at the control, Platt calibration is
fitted on the rows it is given and keeps the ranking, a tiny ablation learns, and the goal
summary picks the best learned model on validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.predictor_bench import BenchConfig, goal_summary, train_one
from hebrus_flywheel.train.predictor_data import GateWeights, Rows
from hebrus_flywheel.train.predictors import (
    GateArrays,
    PerLayerMLP,
    PlattCalibration,
    Predictor,
    PredictorSpec,
    calibration_candidates,
    candidate_pairs,
    fit_platt,
    gate_logits,
    pair_ece,
)

D, L, E, K = 8, 2, 16, 2


def _rows(split: str, tokens: int, seed: int, router: np.ndarray) -> Rows:
    rng = np.random.default_rng(seed)
    feature = rng.normal(size=(tokens * L, D)).astype(np.float32)
    layer = np.tile(np.arange(L), tokens)
    logits = gate_logits(feature, layer, router_LEH=router, lift_DH=None, norm_gain_LH=None)
    target = np.argsort(-logits, axis=1, kind="stable")[:, :K]
    nxt = np.roll(target, -1, axis=0)
    return Rows(split=split, feature_ND=feature, layer_N=layer,
                ordinal_N=np.repeat(np.arange(tokens), L), target_NK=target, next_NK=nxt,
                next_valid_N=layer < L - 1, domain_N=np.array(["x"] * len(layer), dtype=object),
                thread_N=np.array([f"t{i // 8}" for i in range(len(layer))], dtype=object))


def test_spec_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="architecture"):
        PredictorSpec(architecture="transformer")
    with pytest.raises(ConfigError, match="target_offset"):
        PredictorSpec(architecture="per_layer_mlp", target_offset=2)
    spec = PredictorSpec(architecture="shared_lowrank", gate_prior=True, target_offset=1, width=8)
    assert spec.name == "p1_shared_lowrank+gate_prior@8"


def test_per_layer_mlp_uses_each_layers_weights() -> None:
    torch.manual_seed(0)
    net = PerLayerMLP(feature_dim=D, width=4, layer_count=L, expert_count=E)
    x = torch.randn(3, D)
    both = net(torch.cat([x, x]), torch.tensor([0, 0, 0, 1, 1, 1]))
    assert both.shape == (6, E)
    assert not torch.allclose(both[:3], both[3:])
    assert torch.allclose(both[:3], net(x, torch.zeros(3, dtype=torch.long)))


def test_gate_prior_model_starts_at_the_control_ranking() -> None:
    torch.manual_seed(0)
    spec = PredictorSpec(architecture="per_layer_mlp", gate_prior=True, width=4)
    model = Predictor(spec, feature_dim=D, layer_count=L, expert_count=E)
    prior = torch.randn(5, E) * 5
    scores = model(torch.randn(5, D), torch.zeros(5, dtype=torch.long), prior)
    assert torch.equal(scores.topk(K).indices.sort().values, prior.topk(K).indices.sort().values)
    with pytest.raises(ConfigError, match="gate prior"):
        model(torch.randn(5, D), torch.zeros(5, dtype=torch.long))


def test_platt_keeps_ranking_and_calibrates_the_ece_candidates() -> None:
    torch.manual_seed(0)
    targets = torch.stack([torch.randperm(E)[:K] for _ in range(400)])
    scores = torch.randn(400, E)
    scores.scatter_(1, targets, 1.5 + torch.randn(400, K))
    scores = scores * 10  # overconfident
    width = calibration_candidates(K, E)
    assert width == min(2 * K, E)
    pairs, member = candidate_pairs(scores, targets, width)
    assert pairs.shape == member.shape == (400, width)
    assert torch.equal(pairs, scores.double().sort(dim=1, descending=True).values[:, :width])
    platt = fit_platt(pairs, member)
    probs = platt.probabilities(scores)
    assert 0 < platt.scale < 1
    assert torch.equal(probs.argsort(dim=1, stable=True), scores.double().argsort(dim=1,
                                                                              stable=True))
    # calibrated where the ECE looks: mean probability of the candidates = their hit rate
    assert abs(float(platt.probabilities(pairs).mean()) - float(member.mean())) < 0.01
    raw = float(torch.sigmoid(pairs).mean())
    assert abs(raw - float(member.mean())) > 0.05  # the raw scores were not


def test_tiny_ablation_learns_and_goal_summary_chooses_on_validation() -> None:
    router = np.random.default_rng(1).normal(size=(L, E, D))
    train, validation = _rows("train", 300, 2, router), _rows("validation", 60, 3, router)
    gate = GateWeights(router_LEH=router, norm_gain_LH=None, lift_DH=None)
    config = BenchConfig(steps=150, batch_size=128, specs=(
        PredictorSpec(architecture="per_layer_mlp", width=16),))
    item = train_one(config.specs[0], train, validation, gate, config, layer_count=L,
                     expert_count=E)
    with torch.no_grad():
        scores = item.model(torch.from_numpy(validation.feature_ND),
                            torch.from_numpy(validation.layer_N))
    picked = scores.topk(K).indices.numpy()
    hits = (picked[:, :, None] == validation.target_NK[:, None, :]).any(-1).mean()
    assert hits > 2 * K / E  # well above a random guess (K / E)

    def result(recall: float, exact: float, ece: float | None) -> dict:
        node = {"recall": {str(K): recall}, "exact_match": exact,
                "calibration": None if ece is None else {"ece": ece}}
        return {"splits": {"validation": {"overall": node},
                           "runtime_holdout": {"overall": node}}}

    results = {"gate": result(0.90, 0.50, None), "a": result(0.95, 0.60, 0.01),
               "b": result(0.80, 0.70, 0.01)}
    kinds = {"gate": ("control", "same_layer", ""), "a": ("learned", "same_layer", ""),
             "b": ("learned", "same_layer", "")}
    summary = goal_summary(results, kinds, K, "same_layer")
    assert summary["best_learned"] == "a" and summary["goal_met"]
    assert summary["splits"]["validation"]["delta_recall"] == pytest.approx(0.05)


def test_gate_adapter_starts_at_the_native_gate() -> None:
    rng = np.random.default_rng(0)
    router = rng.normal(size=(L, E, D))
    gain = rng.uniform(0.5, 1.5, size=(L, D))
    feature = rng.normal(size=(6, D)).astype(np.float32)
    layer = np.array([0, 0, 0, 1, 1, 0])
    spec = PredictorSpec(architecture="gate_adapter", width=4)
    model = Predictor(spec, feature_dim=D, layer_count=L, expert_count=E,
                      gate=GateArrays(router, None, gain))
    with torch.no_grad():
        scores = model(torch.from_numpy(feature), torch.from_numpy(layer)).numpy()
    expected = gate_logits(feature, layer, router_LEH=router, lift_DH=None,
                           norm_gain_LH=gain)
    assert np.allclose(scores, expected, atol=1e-3)
    with pytest.raises(ConfigError, match="routers"):
        Predictor(spec, feature_dim=D, layer_count=L, expert_count=E)


def test_boundary_calibration_wins_when_rows_differ_in_score_offset() -> None:
    """Rows whose scores carry their own offset (as rows and layers do): one sigmoid of
    the raw score cannot fit them; of the distance from the row's top-k edge it can. The
    form is chosen on the (validation) pairs' BCE; the ranking is unchanged; the ECE
    is the metrics module's."""
    from hebrus_flywheel.train.metrics import reliability_counts

    torch.manual_seed(1)
    targets = torch.stack([torch.randperm(E)[:K] for _ in range(2000)])
    scores = torch.randn(2000, E)
    scores.scatter_(1, targets, 1.2 + torch.randn(2000, K))
    scores = scores * 3 + torch.randn(2000, 1) * 6  # each row its own offset
    width = calibration_candidates(K, E)
    pairs, member = candidate_pairs(scores, targets, width)
    raw, chosen = fit_platt(pairs, member), fit_platt(pairs, member, top_k=K)
    assert raw.boundary == 0 and chosen.boundary == K
    assert torch.equal(chosen.probabilities(scores).argsort(dim=1, stable=True),
                       scores.double().argsort(dim=1, stable=True))

    def ece(platt: PlattCalibration) -> float:
        order = scores.double().argsort(dim=1, descending=True, stable=True)[:, :width]
        counts = reliability_counts(platt.probabilities(scores).numpy(), targets.numpy(),
                                    10, order.numpy()).sum(axis=0)
        assert abs(pair_ece(platt.probabilities(scores).gather(1, order), member)
                   - float(np.abs(counts[2] - counts[1]).sum() / counts[0].sum())) < 1e-9
        return float(np.abs(counts[2] - counts[1]).sum() / counts[0].sum())

    assert ece(chosen) < 0.05

    def bce(platt: PlattCalibration) -> float:
        probs = platt.probabilities(pairs if not platt.boundary else scores.double().sort(
            dim=1, descending=True).values)[:, :width].clamp(1e-9, 1 - 1e-9)
        return float(-(member * probs.log() + (1 - member) * (1 - probs).log()).mean())

    assert bce(chosen) < bce(raw) - 0.02  # sharper: it tells members from misses


def test_the_gate_carries_the_routers_logit_bias_and_older_states_load_without_it() -> None:
    """GPT-OSS's routers add a bias inside their linear: the gate adapter and the gate
    prior of a RoutePredictor add it too (both equal gate_logits with the bias), and a
    state saved before the gate carried a bias (trained with none) loads with zeros."""
    from hebrus_flywheel.train.predictor_model import PredictorConfig, RoutePredictor

    rng = np.random.default_rng(3)
    router, bias = rng.normal(size=(L, E, D)), rng.normal(size=(L, E)) * 3.0
    feature = rng.normal(size=(6, D)).astype(np.float32)
    layer = np.array([0, 1, 1, 0, 1, 0])
    plain = gate_logits(feature, layer, router_LEH=router, lift_DH=None, norm_gain_LH=None)
    biased = gate_logits(feature, layer, router_LEH=router, lift_DH=None, norm_gain_LH=None,
                         bias_LE=bias)
    np.testing.assert_allclose(biased, plain + bias[layer], rtol=1e-5)
    arrays = GateArrays(router.astype(np.float32), None, None, bias.astype(np.float32))
    adapter = Predictor(PredictorSpec(architecture="gate_adapter", width=4), feature_dim=D,
                        layer_count=L, expert_count=E, gate=arrays)
    config = PredictorConfig(architecture="per_layer_mlp", gate_prior=True, width=8,
                             feature_dim=D, layer_count=L, expert_count=E, hidden_dim=D)
    prior = RoutePredictor(config, arrays).gate
    assert prior is not None
    with torch.no_grad():
        x, layer_B = torch.from_numpy(feature), torch.from_numpy(layer)
        np.testing.assert_allclose(adapter(x, layer_B).numpy(), biased, atol=1e-3)
        np.testing.assert_allclose(prior(x, layer_B).numpy(), biased, atol=1e-3)
    for module in (adapter.net, prior):
        older = {k: v for k, v in module.state_dict().items() if k != "bias_LE"}
        module.load_state_dict(older)  # strict: the hook supplies the absent bias
        assert not module.bias_LE.any()
