"""Every generated MoE family as a teacher: geometry, faithful routes, decode/prefill parity.

For each family of :data:`replay.families.FAMILIES` a tiny checkpoint is generated and:

- its routed-layer map, expert count, top-k and weight rule are the family's;
- the label our rule computes from the captured logits selects exactly the experts the
  family's OWN (native ``torch.topk``) gate executed, with the same weights: the rule is
  the family's, not a softmax approximation of it;
- KV-cache decode routes equal one prefill's routes (ids and rank order exactly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.adapters import adapter_for
from hebrus_flywheel.replay.decode import DecodeRuntime, SamplingConfig
from hebrus_flywheel.replay.exceptions import RoutingError
from hebrus_flywheel.replay.families import FAMILIES, get_family
from hebrus_flywheel.replay.parity import run_parity
from hebrus_flywheel.replay.prefill import PrefillReplayer
from hebrus_flywheel.replay.routing import (
    MASKED_SCORE,
    RouterRule,
    parse_rule,
    selection_scores,
    topk_with_tie_break,
)
from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
from hebrus_flywheel.replay.teacher import Teacher, artifact_digest, init_teacher, load_teacher
from tests.unit.test_decode import assert_parity
from tests.unit.test_parity import decode_windows

EXPECTED = {  # routed layers, experts, k, weight rule
    "qwen3_moe": ((1, 2, 3), 64, 8, "softmax_topk_renormalized"),
    "qwen2_moe": ((1, 3), 32, 4, "softmax_topk"),
    "mixtral": ((0, 1, 2, 3), 8, 2, "softmax_topk_renormalized"),
    "olmoe": ((0, 1, 2, 3), 64, 8, "softmax_topk"),
    "deepseek_v3": ((1, 2, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "deepseek_v2": ((1, 2, 3), 32, 4, "softmax_group2of4_max_topk_x1.5"),
    "glm4_moe": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized"),
    "gpt_oss": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "granitemoe": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "granitemoeshared": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "minimax": ((0, 1, 2, 3), 8, 2, "softmax_topk_renormalized"),
    "phimoe": ((0, 1, 2, 3), 16, 2, "sparsemixer_eps0.01_topk"),
    "llama4_text": ((1, 3), 16, 2, "sigmoid_topk"),
    "dots1": ((1, 2, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.0"),
    "ernie4_5_moe": ((1, 2, 3), 16, 4, "softmax+bias_topk_renormalized"),
    "qwen3_5_moe_text": ((0, 1, 2, 3), 32, 4, "softmax_topk_renormalized"),
    "flex_olmo": ((0, 1, 2, 3), 16, 4, "softmax_topk"),
    "deepseek_v32": ((1, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "glm4_moe_lite": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized_x1.8"),
    "lfm2_moe": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized_eps1e-06"),
    "hy_v3": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized_x2.5"),
    "exaone_moe": ((1, 2, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "jamba": ((1, 3), 16, 2, "softmax_topk"),
    # replay.families_more
    "cohere2_moe": ((1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "afmoe": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized_x2.5"),
    "aria_text": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "minimax_m2": ((0, 1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized_eps0.0"),
    "mimo_v2_flash": ((1, 2, 3), 32, 4,
                      "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "solar_open": ((0, 1, 2, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "laguna": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized_eps0.0"),
    "mellum": ((1, 2, 3), 32, 4, "softmax_topk_renormalized"),
    "qwen4_exp_text": ((0, 1, 2, 3), 32, 4, "softmax_topk_renormalized"),
    "jetmoe": ((0, 1, 2, 3), 8, 2, "softmax_topk_renormalized"),
}
EXPECTED.update({  # replay.families_hybrid
    "granitemoe_swa": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "hy_v4": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized_x2.5"),
    "axk1": ((1, 2, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "axk2": ((1, 2, 3), 16, 4, "sigmoid+bias_group2of4_top2sum_fill0_topk_renormalized_x2.5"),
    "glm_moe_dsa": ((1, 2, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "longcat_flash": ((0, 1, 2, 3), 20, 4, "softmax+bias_topk_x2.0"),
    "kimi_linear": ((1, 2, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "granitemoehybrid": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "nemotron_h": ((1, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "minimax_m3_vl_text": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized"),
    "deepseek_v4": ((1, 2, 3), 16, 4, "sqrtsoftplus+bias_topk_renormalized_x1.5"),
})
EXPECTED.update({  # replay.families_c
    "dbrx": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "hunyuan_v1_moe": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "mistral4": ((1, 2, 3), 32, 4, "softmax_group2of4_top2sum_topk_renormalized_x1.5"),
    "zaya": ((0, 1, 2, 3), 17, 1, "softmax+bias_topk_skiplast"),  # 16 experts + skip
    "gemma4_text": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized_pes"),
    "inkling_text": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized_sink1_x2.0_pes"),
})
EXPECTED.update({  # replay.families_vl: composites, routed as their text family
    "qwen3_vl_moe": ((1, 2, 3), 32, 4, "softmax_topk_renormalized"),
    "glm4v_moe": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized"),
    "aria": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized"),
    "minimax_m3_vl": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized"),
    "glm5_next": ((1, 2, 3), 32, 4, "sigmoid+bias_group2of4_top2sum_topk_renormalized_x2.5"),
    "step3p7": ((1, 2, 3), 16, 4, "sigmoid+bias_topk_renormalized_eps0.0"),
    "ernie4_5_vl_moe": ((1, 2, 3), 16, 4, "softmax+bias_topk_renormalized"),
    "deepseek_ocr2": ((1, 2, 3), 32, 4, "softmax_group2of4_max_topk_x1.5"),
    "qwen3_omni_moe": ((1, 2, 3), 64, 8, "softmax_topk_renormalized"),
    "gemma4": ((0, 1, 2, 3), 16, 4, "softmax_topk_renormalized_pes"),
})
PREFIX = [(5 * i + 2) % 1500 + 5 for i in range(30)]
# gates whose weight arithmetic, summation order included, the rule repeats; DeepSeek-style
# gates sum their top-k in torch.topk(sorted=False) order, so they agree only to rounding
BITWISE_WEIGHTS = {"lfm2_moe", "phimoe", "ernie4_5_moe", "llama4_text", "mixtral", "minimax",
                   "qwen3_moe", "longcat_flash", "dbrx"}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("families")
    return {name: init_teacher(base / name, family=name, seed=1) for name in EXPECTED}


def _load(family: str, path: Path, **kwargs: Any) -> Teacher:
    """Load with the family's own attention kernel (GPT-OSS has no sdpa path)."""
    return load_teacher(path, attention=FAMILIES[family].attention, **kwargs)


def test_every_generator_is_tested() -> None:
    assert set(FAMILIES) == {*EXPECTED, "qwen3_next"}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_family_geometry_and_routed_layer_map(family: str, family_dirs: dict[str, Path]) -> None:
    teacher = _load(family, family_dirs[family])
    g = teacher.geometry
    assert (g.routed_layers, g.expert_count, g.top_k, g.weight_rule) == EXPECTED[family]
    identity = build_runtime_identity(teacher)
    assert identity["routed_layers"] == list(g.routed_layers)
    # a composite's routes are its text family's (replay.composites)
    assert identity["layer_count"] == 4
    assert identity["model_family"] == g.family == adapter_for(family).model_type


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_rule_selects_what_the_native_gate_executed(
    family: str, family_dirs: dict[str, Path]
) -> None:
    native = _load(family, family_dirs[family], exact_tie_break=False)
    ids_BT = torch.tensor([PREFIX * 3])
    routes = native.forward_routes(ids_BT)
    assert routes.executed_ids_BTLK is not None
    ids, _ = native.route(routes.router_logits_BTLE)
    executed = routes.executed_ids_BTLK
    assert torch.equal(ids.sort(-1).values, executed.sort(-1).values)


def _call_gate(teacher: Teacher, family: str, hidden_NH: torch.Tensor) -> tuple[Any, ...]:
    """``(logits, weights, ids)`` of the first routed layer's selection for ``hidden_NH``."""
    family = teacher.geometry.family  # a composite's gate is its text family's
    layer = teacher.adapter.decoder_layers(teacher.model)[teacher.geometry.routed_layers[0]]
    gate = teacher.adapter.router(layer)
    # LFM2-MoE's and HY-V3's blocks hand their bias to the gate as an argument
    extra = (teacher.adapter.layer_bias(layer),) if family in ("lfm2_moe", "hy_v3",
                                                                "afmoe", "minimax_m2") else ()
    with torch.no_grad():
        if family == "jamba":  # a bare Linear router; its block selects
            logits = gate(hidden_NH)
            ids, weights = layer.feed_forward.route_tokens_to_experts(hidden_NH, logits)
            return logits, weights, ids
        if family == "aria_text":  # a bare Linear router; its experts select
            logits = gate(hidden_NH)
            ids, weights = layer.mlp.experts.route_tokens_to_experts(logits)
            return logits, weights, ids
        if family == "afmoe":  # its router takes [B, T, H] only
            hidden_NH = hidden_NH[None]
        if family == "zaya":  # its gate takes the previous layer's router state too
            hidden_NH = hidden_NH[None]
        if family == "dbrx":  # the router returns logits; its block selects
            logits = gate(hidden_NH)
            weights, ids = layer.ffn.route_tokens_to_experts(logits)
            return logits, weights, ids
        output = teacher.adapter.router_call_output(gate, (hidden_NH, *extra),
                                                    gate(hidden_NH, *extra))
        return teacher.adapter.split_router_output(output, teacher.geometry.top_k)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_exact_gate_reads_and_returns_what_the_native_gate_does(
    family: str, family_dirs: dict[str, Path]
) -> None:
    """The replaced gate computes the native logits bit for bit (logit bias, float32 or
    upcast included), returns its outputs in the native order (else the MoE block would
    run other experts) and executes the rule's experts with the native weights."""
    native = _load(family, family_dirs[family], exact_tie_break=False)
    exact = _load(family, family_dirs[family])
    ids_BT = torch.tensor([PREFIX * 3])
    want, got = native.forward_routes(ids_BT), exact.forward_routes(ids_BT)
    assert torch.equal(want.router_logits_BTLE[:, :, 0], got.router_logits_BTLE[:, :, 0])
    assert got.executed_ids_BTLK is not None and want.executed_ids_BTLK is not None
    assert torch.equal(got.executed_ids_BTLK, exact.route(got.router_logits_BTLE)[0])
    assert torch.equal(got.executed_ids_BTLK.sort(-1).values,
                       want.executed_ids_BTLK.sort(-1).values)
    hidden_NH = torch.randn(5, native.geometry.hidden_size)
    native_out = _call_gate(native, family, hidden_NH)
    exact_out = _call_gate(exact, family, hidden_NH)
    assert torch.equal(native_out[0], exact_out[0])
    experts = native.geometry.expert_count
    dense_native = torch.zeros(5, experts).scatter(1, native_out[2], native_out[1].float())
    dense_exact = torch.zeros(5, experts).scatter(1, exact_out[2], exact_out[1].float())
    assert torch.equal(dense_native > 0, dense_exact > 0)
    assert torch.allclose(dense_native, dense_exact, rtol=1e-5, atol=1e-6)
    if family in BITWISE_WEIGHTS:
        assert torch.equal(dense_native, dense_exact)
    assert native_out[1].dtype == exact_out[1].dtype


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_pre_attention_state_is_the_residual_stream_entering_the_layer(
    family: str, family_dirs: dict[str, Path]
) -> None:
    """The captured feature of routed layer l is the model's own hidden_states[l] (the
    input of layer l), also for post-norm families without an input_layernorm; where the
    stream is several hyper-connection channels [B, T, C, H] (HY-V4, DeepSeek-V4), the mix
    the layer's attn_hc hands its input_layernorm."""
    teacher = _load(family, family_dirs[family])
    ids_BT = torch.tensor([PREFIX])
    routes = teacher.forward_routes(ids_BT, capture_hidden=True)
    layers = teacher.adapter.decoder_layers(teacher.model)
    with torch.inference_mode():
        states = teacher.model(input_ids=ids_BT, use_cache=False,
                               output_hidden_states=True).hidden_states
        assert routes.hidden_BTLH is not None
        for slot, index in enumerate(teacher.geometry.routed_layers):
            want = states[index]
            if want.dim() == 4:
                want = layers[index].attn_hc(want)[-1]
            elif family == "qwen4_exp_text":  # hyper-connection streams mixed into its input
                want = layers[index].attn_hyper_connection(want)[0]
            assert torch.equal(routes.hidden_BTLH[:, :, slot], want), (slot, index)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_decode_prefill_parity(family: str, family_dirs: dict[str, Path]) -> None:
    teacher = _load(family, family_dirs[family])
    runtime = DecodeRuntime(teacher)
    sampling = SamplingConfig(temperature=1.0, seed=1, max_new_tokens=30, stop_at_eos=False)
    assert_parity(teacher, PREFIX, runtime.decode_turn(PREFIX, sampling=sampling))
    assert_parity(teacher, PREFIX[:5], runtime.decode_turn(PREFIX[:5], forced_ids=PREFIX[5:]))


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_prefill_replayer_reaches_parity_with_decode(
    family: str, family_dirs: dict[str, Path]
) -> None:
    """The replay path proper (padded batches, explicit masks and positions), which is
    where Qwen2-MoE's unused ``sliding_window=0`` once broke the mask."""
    teacher = _load(family, family_dirs[family])
    replayer = PrefillReplayer(teacher)
    result = run_parity(replayer, decode_windows(teacher, replayer.identity_id))
    assert result.authoritative and result.mismatched_pairs == 0, result.to_json()


def test_generation_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = init_teacher(tmp_path / "a", family="deepseek_v3", seed=4)
    b = init_teacher(tmp_path / "b", family="deepseek_v3", seed=4)
    c = init_teacher(tmp_path / "c", family="deepseek_v3", seed=5)
    assert artifact_digest(a) == artifact_digest(b) != artifact_digest(c)


def test_unknown_family_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="deepseek_v3"):
        get_family("llama")


def test_rule_names_round_trip() -> None:
    for rule in (RouterRule(), RouterRule(normalize=False, scale=1.5, groups=8, topk_groups=3,
                                          group_score="max"),
                 RouterRule(scoring="sigmoid", bias=True, groups=4, topk_groups=2, scale=2.5),
                 RouterRule(scoring="sigmoid", bias=True, norm_eps=1e-6, scale=1.5),
                 RouterRule(scoring="sqrtsoftplus", bias=True, scale=1.5)):
        assert parse_rule(rule.name) == rule
    with pytest.raises(RoutingError, match="weight_rule"):
        parse_rule("sigmoid")
    with pytest.raises(RoutingError, match="bias"):
        RouterRule(scoring="sparsemixer", normalize=False, bias=True)


def test_sparsemixer_rule_is_phimoes_own_arithmetic() -> None:
    """Bitwise PhiMoE's inference sparsemixer, on logits close enough that the relative
    gap keeps several experts in each softmax (else every weight is 1)."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    rule = RouterRule(scoring="sparsemixer", normalize=False, jitter_eps=0.01)
    assert rule.name == "sparsemixer_eps0.01_topk" and parse_rule(rule.name) == rule
    logits_TE = 5.0 + 0.1 * torch.randn(500, 16, generator=torch.Generator().manual_seed(0))
    weights, ids = sparsemixer(logits_TE, jitter_eps=0.01, training=False, top_k=2)
    got_ids, got_weights = topk_with_tie_break(logits_TE, 2, weight_rule=rule.name)
    assert torch.equal(got_ids, ids) and torch.equal(got_weights, weights)
    assert float(got_weights.min()) > 0.0 and float(got_weights.max()) < 1.0 + 1e-6
    assert (got_weights < 0.99).float().mean() > 0.5
    with pytest.raises(RoutingError, match="sparsemixer"):
        RouterRule(scoring="sparsemixer", normalize=True, jitter_eps=0.01)


def test_phimoe_refuses_a_top_k_other_than_two() -> None:
    from transformers import PhimoeConfig

    from hebrus_flywheel.replay.adapters import adapter_for
    from hebrus_flywheel.replay.exceptions import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="two experts"):
        adapter_for("phimoe").geometry(PhimoeConfig(num_experts_per_tok=3))


def test_bias_changes_selection_but_not_weights() -> None:
    logits_TE = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias_E = torch.tensor([0.0, 0.0, 0.0, 5.0])
    rule = "sigmoid+bias_topk_renormalized"
    ids, weights = topk_with_tie_break(logits_TE, 2, weight_rule=rule, bias_TE=bias_E)
    assert ids.tolist() == [[3, 0]]
    expected = torch.sigmoid(torch.tensor([-1.0, 2.0]))
    assert torch.allclose(weights[0], expected / expected.sum())


def test_softmax_bias_ranks_probabilities_plus_bias() -> None:
    """ERNIE-4.5-MoE: the bias is added to the softmax PROBABILITY, not the logit (a
    logit-space bias of 0.5 would not lift expert 3 above expert 1 here)."""
    logits_TE = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias_E = torch.tensor([0.0, 0.0, 0.0, 0.5])
    ids, weights = topk_with_tie_break(logits_TE, 2, weight_rule="softmax+bias_topk_renormalized",
                                       bias_TE=bias_E)
    assert ids.tolist() == [[0, 3]]
    probs = torch.softmax(logits_TE[0], -1)[[0, 3]]
    assert torch.allclose(weights[0], probs / probs.sum())


def test_groups_mask_experts_outside_the_best_groups() -> None:
    """A softmax router's groups are scored on its probabilities: by their best one
    (``max``: the logits' order) or by the sum of their two best (Mistral 4), which a sum
    of logits would get wrong."""
    logits_TE = torch.tensor([[5.0, -5.0, 4.6, 4.6, 0.0, 0.0]])  # groups {0,1} {2,3} {4,5}
    scores = selection_scores(logits_TE, "softmax_group1of3_top2sum_topk")
    assert scores[0].tolist()[:2] == [MASKED_SCORE, MASKED_SCORE]
    ids, _ = topk_with_tie_break(logits_TE, 2, weight_rule="softmax_group1of3_top2sum_topk")
    assert ids.tolist() == [[2, 3]]
    ids, _ = topk_with_tie_break(logits_TE, 2, weight_rule="softmax_group1of3_max_topk")
    assert ids.tolist() == [[0, 1]]
    # logit sums 7.0 < 7.9, probability sums e^5 + e^2 > e^4 + e^3.9: the probabilities win
    logits_TE = torch.tensor([[5.0, 2.0, 4.0, 3.9, 0.0, 0.0]])
    ids, _ = topk_with_tie_break(logits_TE, 2, weight_rule="softmax_group1of3_top2sum_topk")
    assert ids.tolist() == [[0, 1]]


def test_cli_lists_families_and_generates_one(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from hebrus_flywheel.replay.cli import teacher_app

    listed = CliRunner().invoke(teacher_app, ["families", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert set(FAMILIES) <= {name for name, row in rows.items() if row["generate"]}
    made = CliRunner().invoke(teacher_app, ["init", "--family", "olmoe", "--out",
                                            str(tmp_path / "o"), "--seed", "3"])
    assert made.exit_code == 0, made.output
    assert "tiny-olmoe" in made.output
    assert load_teacher(tmp_path / "o").geometry.family == "olmoe"
    bad = CliRunner().invoke(teacher_app, ["init", "--family", "nope", "--out",
                                           str(tmp_path / "n")])
    assert bad.exit_code != 0 and isinstance(bad.exception, ConfigError)


def test_axk2_grouped_gate_scores_dropped_groups_zero() -> None:
    """A.X-K2's grouped gate fills the dropped groups' scores with 0.0, not -inf: where
    the kept experts' biased scores are negative, experts of dropped groups are chosen;
    the _fill0 rule selects what AXK2TopkRouter executes, on such rows too."""
    from transformers import AXK2Config
    from transformers.models.axk2.modeling_axk2 import AXK2TopkRouter

    from hebrus_flywheel.replay.adapters import adapter_for

    config = AXK2Config(hidden_size=8, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
                        topk_group=2, routed_scaling_factor=1.0)
    rule = adapter_for("axk2").geometry(config).weight_rule
    assert rule == "sigmoid+bias_group2of4_top2sum_fill0_topk_renormalized"
    assert parse_rule(rule).group_fill_zero
    gate = AXK2TopkRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(8, 8, generator=generator))
        # groups 1 and 3 kept; expert 6's biased score is negative on about half the rows
        gate.e_score_correction_bias.copy_(torch.tensor([-2.0, -2.0, 0, 0, -2.0, -2.0, -0.5, 0]))
    hidden_NH = torch.randn(64, 8, generator=generator)
    with torch.no_grad():
        logits, weights, ids = gate(hidden_NH)
    bias = gate.e_score_correction_bias
    got_ids, got_weights = topk_with_tie_break(logits, 4, weight_rule=rule, bias_TE=bias)
    # the dropped groups' experts all score 0.0: where one is chosen, they tie, and the
    # rule takes the lowest id (the exact gate executes that); torch.topk any of them
    scores = selection_scores(logits, rule, bias)
    assert torch.equal(scores.gather(-1, got_ids).sort(-1).values,
                       scores.gather(-1, ids).sort(-1).values)
    assert bool((scores.gather(-1, got_ids) == 0.0).any())  # dropped-group experts chosen
    same = (got_ids.sort(-1).values == ids.sort(-1).values).all(-1)
    assert bool(same.any())
    assert torch.allclose(got_weights[same].sort(-1).values, weights[same].sort(-1).values)


@pytest.mark.parametrize(("family", "reason", "detail"), [
    # composites of those text families, refused with their reason; Gemma 4 Unified is dense
    ("gemma4_unified", "only dense MLPs", "mixture-of-experts"),
    ("inkling_mm_model", "embed_norm again", "embed_norm"),
    ("openai_privacy_filter", "token classifier", "bidirectional"),
    ("diffusion_gemma", "block-diffusion", "denoising"),
])
def test_a_gate_a_route_cannot_record_is_refused_everywhere(
        tmp_path: Path, family: str, reason: str, detail: str) -> None:
    """No generator, no adapter, listed as refused: the weights the gate executes depend
    on something a route does not record."""
    import json

    from typer.testing import CliRunner

    from hebrus_flywheel.replay.adapters import adapter_for
    from hebrus_flywheel.replay.cli import teacher_app
    from hebrus_flywheel.replay.exceptions import UnsupportedModelError

    with pytest.raises(ConfigError, match=rf"cannot be a teacher: .*{reason}"):
        get_family(family)
    with pytest.raises(ConfigError, match="cannot be a teacher"):
        init_teacher(tmp_path / "t", family=family)
    assert not (tmp_path / "t").exists()
    with pytest.raises(UnsupportedModelError, match=detail):
        adapter_for(family)
    listed = CliRunner().invoke(teacher_app, ["families", "--json"])
    row = json.loads(listed.output)[family]
    assert not row["generate"] and row["summary"].startswith("not a teacher")


def test_doge_is_refused_with_the_reason(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from hebrus_flywheel.replay.adapters import adapter_for
    from hebrus_flywheel.replay.cli import teacher_app
    from hebrus_flywheel.replay.exceptions import UnsupportedModelError

    with pytest.raises(ConfigError, match=r"'doge' cannot be a teacher: .*decode routes"):
        get_family("doge")
    with pytest.raises(UnsupportedModelError, match="'doge' cannot be a teacher"):
        adapter_for("doge")
    made = CliRunner().invoke(teacher_app, ["init", "--family", "doge", "--out",
                                            str(tmp_path / "d")])
    assert made.exit_code != 0 and isinstance(made.exception, ConfigError)
    assert "cannot be a teacher" in str(made.exception)
    assert not (tmp_path / "d" / "config.json").exists()
    listed = json.loads(CliRunner().invoke(teacher_app, ["families", "--json"]).output)
    assert listed["doge"]["refused"] and not listed["doge"]["generate"]


COMPOSITES = {  # composite model_type: (text family, composite config class, tiny vision)
    "llama4": ("llama4_text", "Llama4Config", {
        "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 32,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
        "vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32,
        "intermediate_layers_indices": [0]}),
    "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeConfig", {
        "depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
        "out_hidden_size": 64}),
    "qwen4_exp": ("qwen4_exp_text", "Qwen4ExpConfig", {
        "depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
        "out_hidden_size": 64}),
}


@pytest.mark.parametrize("composite", sorted(COMPOSITES))
def test_composite_checkpoint_routes_as_its_text_family(
    composite: str, family_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A vision-language checkpoint (composite config.json, language-model weights under
    the composite model's keys) loads as the text family's causal LM: the text family's
    adapter and geometry, and the same routes as the text checkpoint with its weights."""
    import json

    import transformers
    from transformers import AutoModelForImageTextToText

    from hebrus_flywheel.replay.adapters import adapter_for
    from hebrus_flywheel.replay.teacher import read_geometry

    family, config_class, vision = COMPOSITES[composite]
    text = _load(family, family_dirs[family])
    config = getattr(transformers, config_class)(
        text_config=text.model.config.to_dict(), vision_config=vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        full = AutoModelForImageTextToText.from_config(config)
    # the language model's weights under the composite's keys (model.language_model.* or
    # language_model.model.*); the vision tower keeps its random init
    text_sd = text.model.state_dict()
    moved = {key: text_sd[key.replace("language_model.", "")] for key in full.state_dict()
             if "language_model." in key or key == "lm_head.weight"}
    assert len(moved) == len(text_sd)
    full.load_state_dict(moved, strict=False)
    full.save_pretrained(tmp_path / composite)
    assert json.loads((tmp_path / composite / "config.json").read_text())["model_type"] == \
        composite
    assert adapter_for(composite) is adapter_for(family)
    assert read_geometry(tmp_path / composite) == text.geometry
    teacher = load_teacher(tmp_path / composite)
    assert teacher.geometry == text.geometry
    assert type(teacher.model) is type(text.model)
    ids_BT = torch.tensor([PREFIX])
    want, got = text.forward_routes(ids_BT), teacher.forward_routes(ids_BT)
    assert torch.equal(want.router_logits_BTLE, got.router_logits_BTLE)
    assert want.executed_ids_BTLK is not None and got.executed_ids_BTLK is not None
    assert torch.equal(want.executed_ids_BTLK, got.executed_ids_BTLK)



def test_zaya_records_the_skip_class_it_executes_with_weight_zero(
        family_dirs: dict[str, Path]) -> None:
    """A ZAYA token that selects the skip class runs no expert (transformers writes it as
    expert 0 at weight 0); the route records the skip class, id ``num_experts``, weight 0,
    and the replay gate executes exactly that."""
    teacher = _load("zaya", family_dirs["zaya"])
    skip = teacher.geometry.skip_expert
    assert skip == teacher.model.config.num_experts == 16
    routes = teacher.forward_routes(torch.tensor([PREFIX * 6]))
    ids, weights = teacher.route(routes.router_logits_BTLE)
    chosen = ids == skip
    assert 0 < int(chosen.sum()) < ids.numel()  # the tiny router skips some tokens
    assert torch.equal(routes.executed_ids_BTLK, ids)
    assert bool((weights[chosen] == 0).all()) and bool((weights[~chosen] > 0).all())
    layer = teacher.adapter.decoder_layers(teacher.model)[0]
    assert float(teacher.adapter.layer_bias(layer)[-1]) == -1.0


def test_skip_last_rule_zeroes_the_last_class_weight_only() -> None:
    rule = RouterRule(scoring="softmax", bias=True, normalize=False, skip_last=True)
    assert rule.name == "softmax+bias_topk_skiplast" and parse_rule(rule.name) == rule
    logits = torch.tensor([[0.0, 1.0, 5.0], [3.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, -0.5])
    ids, weights = topk_with_tie_break(logits, 1, weight_rule=rule.name, bias_TE=bias)
    assert ids.flatten().tolist() == [2, 0]
    assert weights[0, 0] == 0.0 and weights[1, 0] == torch.softmax(logits[1], -1)[0]
    with pytest.raises(RoutingError, match="skip_last"):
        RouterRule(scoring="softmax", normalize=True, skip_last=True)


def test_gemma4_weights_carry_each_experts_learned_scale(family_dirs: dict[str, Path]) -> None:
    """Gemma 4 multiplies each renormalised top-k weight by its expert's learned
    ``per_expert_scale``: the route's weights are those products (rule suffix ``_pes``),
    read from the loaded router, and a rule that needs the scales refuses without them."""
    from hebrus_flywheel.replay.routing import topk_weights

    teacher = _load("gemma4_text", family_dirs["gemma4_text"])
    assert parse_rule(teacher.geometry.weight_rule).expert_scale
    scale_LE = teacher.expert_scale_LE
    layer = teacher.adapter.decoder_layers(teacher.model)[0]
    assert scale_LE is not None and torch.equal(scale_LE[0], layer.router.per_expert_scale)
    assert float(scale_LE.min()) < 0.9 and float(scale_LE.max()) > 1.1  # drawn, not ones
    logits = teacher.forward_routes(torch.tensor([PREFIX])).router_logits_BTLE
    ids, weights = teacher.route(logits)
    plain = topk_weights(logits, ids, "softmax_topk_renormalized")
    want = plain * scale_LE.expand_as(logits).gather(-1, ids)
    assert torch.allclose(weights, want) and not torch.allclose(weights, plain)
    assert torch.equal(teacher.weights_of(logits, ids), weights)  # replay's re-weighing
    with pytest.raises(RoutingError, match="per-expert"):
        topk_with_tie_break(logits, 4, weight_rule=teacher.geometry.weight_rule)
    rule = RouterRule(normalize=True, expert_scale=True)
    assert rule.name == "softmax_topk_renormalized_pes" and parse_rule(rule.name) == rule


def test_inkling_weights_share_their_softmax_with_the_shared_experts(
        family_dirs: dict[str, Path]) -> None:
    """Inkling weighs the chosen experts by a softmax of their log-sigmoids together with
    the shared experts', times route_scale and a learned global_scale: the route's logits
    carry the shared experts' columns (never selected), and the weights follow."""
    teacher = _load("inkling_text", family_dirs["inkling_text"])
    gate = teacher.adapter.router(teacher.adapter.decoder_layers(teacher.model)[1])
    assert float(gate.global_scale) == 0.75  # the drawn scale survives loading
    logits = teacher.forward_routes(torch.tensor([PREFIX])).router_logits_BTLE
    assert logits.shape[-1] == 16 + 1  # the shared expert's sink column
    ids, weights = teacher.route(logits)
    assert int(ids.max()) < 16  # the sink is never selected
    chosen = torch.nn.functional.logsigmoid(torch.cat([logits.gather(-1, ids), logits[..., 16:]],
                                                      -1))
    want = torch.softmax(chosen, -1)[..., :4] * 2.0 * 0.75
    assert torch.allclose(weights, want, rtol=1e-5)
    assert bool((weights.sum(-1) < 2.0 * 0.75).all())  # the shared expert takes its share
