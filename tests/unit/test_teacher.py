"""Teacher init/load, family adapters, runtime identity and the ``flywheel teacher`` CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.identity import compute_identity_id
from hebrus_flywheel.replay.adapters import ADAPTERS, adapter_for
from hebrus_flywheel.replay.exceptions import (
    IdentityMismatchError,
    TeacherError,
    UnsupportedModelError,
)
from hebrus_flywheel.replay.routing import WEIGHT_SOFTMAX_TOPK, WEIGHT_SOFTMAX_TOPK_RENORMALIZED
from hebrus_flywheel.replay.runtime_identity import build_runtime_identity, require_identity
from hebrus_flywheel.replay.teacher import (
    MANIFEST_FILE,
    PRESETS,
    Teacher,
    TeacherPreset,
    artifact_digest,
    init_teacher,
    load_teacher,
    read_manifest,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def teacher(teacher_dir: Path) -> Teacher:
    return load_teacher(teacher_dir)


# --- presets and init -------------------------------------------------------------------


def test_default_preset_has_the_design_geometry() -> None:
    preset = PRESETS["tiny-qwen3-next"]
    assert (preset.num_experts, preset.num_experts_per_tok) == (512, 10)
    types = preset.layer_types()
    assert "full_attention" in types and "linear_attention" in types
    assert PRESETS["tiny-qwen3-next-48l"].num_hidden_layers == 48


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_experts", 0), ("hidden_size", -1), ("router_logit_std", 0.0), ("head_dim", 1.5),
     ("num_experts_per_tok", 600)],
)
def test_preset_validation_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        TeacherPreset(name="bad", **{field: value})


def test_unknown_preset_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="preset"):
        init_teacher(tmp_path / "t", preset="no-such-preset")


def test_same_seed_gives_the_same_artifact_digest(teacher_dir: Path, tmp_path: Path) -> None:
    again = init_teacher(tmp_path / "again", preset="tiny-qwen3-next", seed=0)
    other = init_teacher(tmp_path / "other", preset="tiny-qwen3-next", seed=1)
    assert artifact_digest(again) == artifact_digest(teacher_dir)
    assert artifact_digest(other) != artifact_digest(teacher_dir)
    assert (again / "tokenizer.json").read_bytes() == (teacher_dir / "tokenizer.json").read_bytes()


def test_init_refuses_a_non_empty_directory(teacher_dir: Path) -> None:
    with pytest.raises(TeacherError, match="overwrite"):
        init_teacher(teacher_dir)


def test_checkpoint_layout_and_manifest(teacher_dir: Path) -> None:
    names = {p.name for p in teacher_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            MANIFEST_FILE} <= names
    manifest = read_manifest(teacher_dir)
    assert manifest is not None
    assert (manifest["preset"], manifest["seed"]) == ("tiny-qwen3-next", 0)


def test_digest_covers_config_and_weights_but_not_timestamps(
    teacher_dir: Path, tmp_path: Path
) -> None:
    import shutil

    copy = Path(shutil.copytree(teacher_dir, tmp_path / "copy"))
    before = artifact_digest(copy)
    for path in copy.iterdir():
        os.utime(path, (1, 1))
    (copy / "tokenizer_config.json").write_text("{}")
    assert artifact_digest(copy) == before
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    assert artifact_digest(copy) != before


# --- load -------------------------------------------------------------------------------


def test_loaded_teacher_is_frozen_qwen3_next(teacher: Teacher, teacher_dir: Path) -> None:
    from hebrus_flywheel.replay.tokenizer import load_tokenizer

    tok = load_tokenizer(teacher_dir)
    geometry = teacher.geometry
    assert geometry.family == "qwen3_next"
    assert (geometry.expert_count, geometry.top_k, geometry.routed_layer_count) == (512, 10, 4)
    assert geometry.weight_rule == WEIGHT_SOFTMAX_TOPK_RENORMALIZED
    assert not teacher.model.training
    assert not any(p.requires_grad for p in teacher.model.parameters())
    assert teacher.vocab_size == tok.tokenizer.get_vocab_size(with_added_tokens=True)
    assert teacher.eos_token_ids == (tok.eos_id,)
    assert teacher.artifact_digest == artifact_digest(teacher_dir)


def test_router_scaling_makes_routing_decisive_and_input_dependent(teacher: Teacher) -> None:
    ids_BT = torch.arange(10, 74).reshape(1, 64)
    logits_BTLE = teacher.forward_routes(ids_BT).router_logits_BTLE
    assert 1.5 < float(logits_BTLE.std()) < 2.5
    ids_BTLK, weights_BTLK = teacher.route(logits_BTLE)
    assert float(weights_BTLK[..., 0].mean()) > 0.2
    distinct = {tuple(row) for row in ids_BTLK[0, :, 0].sort(-1).values.tolist()}
    assert len(distinct) > 50


def test_load_errors_are_clear(tmp_path: Path, teacher_dir: Path) -> None:
    with pytest.raises(TeacherError, match=r"config\.json"):
        load_teacher(tmp_path)
    with pytest.raises(ConfigError, match="dtype"):
        load_teacher(teacher_dir, dtype="float8")


def test_unsupported_family_is_refused(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=16, vocab_size=32).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"placeholder")
    with pytest.raises(UnsupportedModelError, match="llama"):
        load_teacher(tmp_path)
    with pytest.raises(UnsupportedModelError):
        adapter_for("llama")


# --- adapters for other families -------------------------------------------------------


def _family_config(family: str) -> Any:
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, num_experts_per_tok=2, eos_token_id=1)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=16,
                              intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[2],
                              norm_topk_prob=True, head_dim=16)
    if family == "mixtral":
        return MixtralConfig(**common, num_local_experts=8, intermediate_size=16)
    return OlmoeConfig(**common, num_experts=8, intermediate_size=16)


def save_family_checkpoint(family: str, out: Path, seed: int = 0) -> Path:
    """A randomly initialised tiny checkpoint of ``family`` with decisive routers."""
    from transformers import AutoModelForCausalLM

    config = _family_config(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.weight.normal_(0.0, 2.0 / config.hidden_size**0.5)
    model.save_pretrained(out)
    return out


EXPECTED = {
    "qwen3_moe": ((0, 1, 3), 8, 2, WEIGHT_SOFTMAX_TOPK_RENORMALIZED, 16),
    "mixtral": ((0, 1, 2, 3), 8, 2, WEIGHT_SOFTMAX_TOPK_RENORMALIZED, 16),
    "olmoe": ((0, 1, 2, 3), 8, 2, WEIGHT_SOFTMAX_TOPK, 16),
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_family_adapter_geometry_and_capture(family: str, tmp_path: Path) -> None:
    teacher = load_teacher(save_family_checkpoint(family, tmp_path / family))
    g = teacher.geometry
    assert (g.routed_layers, g.expert_count, g.top_k, g.weight_rule,
            g.routed_intermediate_size) == EXPECTED[family]
    _check_capture_matches_model_outputs(teacher)


def test_qwen3_next_capture_matches_model_outputs(teacher: Teacher) -> None:
    _check_capture_matches_model_outputs(teacher)


def _check_capture_matches_model_outputs(teacher: Teacher) -> None:
    """Hook capture == output_router_logits, == executed top-k, hidden == layer inputs."""
    ids_BT = torch.tensor([[3, 5, 7, 11, 13, 17], [19, 23, 29, 31, 37, 41]])
    routes = teacher.forward_routes(ids_BT, capture_hidden=True)
    batch, tokens = ids_BT.shape
    with torch.inference_mode():
        out = teacher.model(ids_BT, output_router_logits=True, output_hidden_states=True,
                            use_cache=False)
    assert len(out.router_logits) == teacher.geometry.routed_layer_count
    for slot, layer in enumerate(teacher.geometry.routed_layers):
        native_BTE = out.router_logits[slot].reshape(batch, tokens, -1)
        assert torch.equal(routes.router_logits_BTLE[:, :, slot], native_BTE)
        assert routes.hidden_BTLH is not None
        assert torch.equal(routes.hidden_BTLH[:, :, slot], out.hidden_states[layer])
    ids_BTLK, weights_BTLK = teacher.route(routes.router_logits_BTLE)
    assert routes.executed_ids_BTLK is not None
    assert torch.equal(ids_BTLK.sort(-1).values, routes.executed_ids_BTLK.sort(-1).values)
    assert torch.isfinite(weights_BTLK).all()


def test_adapter_registry_covers_the_required_families() -> None:
    assert {"qwen3_next", "qwen3_moe", "mixtral", "olmoe"} <= set(ADAPTERS)


# --- runtime identity --------------------------------------------------------------------


def _avsc() -> dict[str, Any]:
    return json.loads((REPO / "schemas" / "RuntimeIdentity.v3.avsc").read_text())


def test_identity_has_every_schema_field_and_validates(teacher: Teacher) -> None:
    import fastavro
    from fastavro.validation import validate

    identity = build_runtime_identity(teacher)
    schema = _avsc()
    assert set(identity) == {f["name"] for f in schema["fields"]}
    assert validate(identity, fastavro.parse_schema(schema), raise_errors=True)
    assert identity["identity_id"] == compute_identity_id(identity)
    assert identity["model_family"] == "qwen3_next"
    assert identity["quantization"] == "none"
    assert identity["tie_break_rule"] == "score_desc_then_expert_id_asc"
    assert (identity["routed_layer_count"], identity["expert_count"], identity["top_k"]) == (
        4, 512, 10)
    assert identity["runtime_name"] == "hebrus-flywheel-reference"


def test_identity_changes_with_dtype_and_mismatch_names_fields(teacher: Teacher) -> None:
    identity = build_runtime_identity(teacher)
    other = build_runtime_identity(dataclasses.replace(teacher, dtype="bfloat16"))
    assert other["identity_id"] != identity["identity_id"]
    require_identity(identity, identity)
    with pytest.raises(IdentityMismatchError, match="dtype"):
        require_identity(other, identity)
    native = build_runtime_identity(dataclasses.replace(teacher, exact_tie_break=False))
    assert native["runtime_name"] == "hebrus-flywheel-reference+native-topk"
    assert native["identity_id"] != identity["identity_id"]
    tampered = {**identity, "top_k": 8}
    with pytest.raises(IdentityMismatchError, match="corrupt or partial"):
        require_identity(tampered, identity)


# --- CLI ---------------------------------------------------------------------------------


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, replay.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_cli_describe_prints_identity(teacher_dir: Path, teacher: Teacher) -> None:
    from typer.testing import CliRunner

    from hebrus_flywheel.replay.cli import teacher_app

    result = CliRunner().invoke(teacher_app, ["describe", str(teacher_dir), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["family"] == "qwen3_next"
    assert info["identity"] == build_runtime_identity(teacher)


def test_cli_init_creates_a_loadable_teacher(tmp_path: Path, teacher_dir: Path) -> None:
    from typer.testing import CliRunner

    from hebrus_flywheel.replay.cli import teacher_app

    out = tmp_path / "cli-teacher"
    result = CliRunner().invoke(teacher_app, ["init", "--out", str(out), "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert artifact_digest(out) in result.output
    assert artifact_digest(out) == artifact_digest(teacher_dir)


# --- executed tie-break ------------------------------------------------------------------


def test_exact_gates_match_native_gates_when_scores_are_distinct(teacher_dir: Path) -> None:
    exact = load_teacher(teacher_dir)
    native = load_teacher(teacher_dir, exact_tie_break=False)
    ids_BT = torch.arange(100, 164).reshape(2, 32)
    with torch.inference_mode():
        a = exact.model(ids_BT, use_cache=False).logits
        b = native.model(ids_BT, use_cache=False).logits
    assert torch.equal(a, b)
    routes = native.forward_routes(ids_BT)
    assert routes.executed_ids_BTLK is not None
    assert torch.equal(native.route(routes.router_logits_BTLE)[0], routes.executed_ids_BTLK)


def test_exact_gates_execute_lower_ids_on_exact_ties(teacher_dir: Path) -> None:
    tied = load_teacher(teacher_dir)
    with torch.no_grad():
        tied.model.model.layers[0].mlp.gate.weight.zero_()  # every logit of layer 0 is 0.0
    routes = tied.forward_routes(torch.arange(40, 60).reshape(1, 20))
    assert routes.executed_ids_BTLK is not None
    executed_TK = routes.executed_ids_BTLK[0, :, 0]
    assert executed_TK.tolist() == [list(range(10))] * 20
    _, weights_BTLK = tied.route(routes.router_logits_BTLE)
    torch.testing.assert_close(weights_BTLK[0, :, 0], torch.full((20, 10), 0.1))
