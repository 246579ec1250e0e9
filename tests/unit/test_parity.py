"""Parity gate: fp32 replay == real KV-cache decode routes; every perturbation is caught."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.decode import DecodeRuntime
from hebrus_flywheel.replay.exceptions import ParityError
from hebrus_flywheel.replay.features import AnchorCapture
from hebrus_flywheel.replay.parity import ParityConfig, ParityResult, captured_routes, run_parity
from hebrus_flywheel.replay.parity_cli import (
    format_table,
    parity_command,
    read_window_file,
    write_window_file,
)
from hebrus_flywheel.replay.prefill import PrefillReplayer, ReplayConfig
from hebrus_flywheel.replay.routing import topk_weights
from hebrus_flywheel.replay.teacher import Teacher, load_teacher
from tests.unit.test_prefill import history, make_window

# (prefix length, decoded tokens) per window; the first crosses the 64-token chunk.
TURNS = [(20, 60), (50, 30), (5, 40)]


def decode_windows(teacher: Teacher, identity_id: str) -> list[dict[str, Any]]:
    """runtime_holdout windows whose routes were captured by real KV-cache decode."""
    runtime = DecodeRuntime(teacher)
    out = []
    for i, (prefix, decoded) in enumerate(TURNS):
        tokens = history(prefix + decoded, 100 + i)
        turn = runtime.decode_turn(tokens[:prefix], forced_ids=tokens[prefix:])
        layers, k = turn.expert_ids_TLK.shape[1:]
        routes = {
            "layer_count": layers, "top_k": k, "layers": list(range(layers)),
            "stages": [0] * layers, "expert_ids": turn.expert_ids_TLK.astype("<i2").tobytes(),
            "weights": turn.weights_TLK.astype("<f4").tobytes(),
        }
        out.append(make_window(identity_id, tokens, range(prefix, prefix + decoded),
                               routes=routes, thread=f"rt{i}", split="runtime_holdout"))
    return out


@pytest.fixture(scope="module")
def teacher(teacher_dir: Path) -> Teacher:
    return load_teacher(teacher_dir)


@pytest.fixture(scope="module")
def replayer(teacher: Teacher) -> PrefillReplayer:
    return PrefillReplayer(teacher)


@pytest.fixture(scope="module")
def windows(teacher: Teacher, replayer: PrefillReplayer) -> list[dict[str, Any]]:
    return decode_windows(teacher, replayer.identity_id)


def total_pairs(windows: list[dict[str, Any]], layers: int) -> int:
    return sum(len(w["anchor_positions"]) for w in windows) * layers


def test_fp32_replay_reaches_full_parity_with_decode(
    replayer: PrefillReplayer, windows: list[dict[str, Any]]
) -> None:
    result = run_parity(replayer, windows)
    layers = replayer.teacher.geometry.routed_layer_count
    assert result.authoritative, format_table(result)
    assert result.windows_compared == len(windows)
    assert result.pairs == total_pairs(windows, layers) and result.mismatched_pairs == 0
    assert result.max_weight_abs_diff is not None and result.max_weight_abs_diff <= 1e-5
    assert [row["mismatches"] for row in result.per_layer] == [0] * layers
    assert result.margins["boundary"]["overall"]["count"] == result.pairs
    assert result.margins["label"]["overall"]["count"] == result.pairs
    assert result.margins["boundary"]["at_mismatch"]["count"] == 0
    assert result.teacher_dtype == "float32" and result.identity_id == replayer.identity_id
    assert json.loads(result.to_json())["authoritative"] is True


def test_bf16_replay_is_caught(teacher_dir: Path, windows: list[dict[str, Any]]) -> None:
    bf16 = PrefillReplayer(load_teacher(teacher_dir, dtype="bfloat16"),
                           ReplayConfig(dtype="bfloat16"))
    relabelled = [dict(w, identity_id=bf16.identity_id) for w in windows]
    result = run_parity(bf16, relabelled)
    assert not result.authoritative and result.teacher_dtype == "bfloat16"
    assert result.mismatch_rate > 0.05, format_table(result)
    assert result.margins["boundary"]["at_mismatch"]["count"] == result.mismatched_pairs
    assert 0 < result.primary_mismatches <= result.mismatched_pairs


def _shift_positions(monkeypatch: pytest.MonkeyPatch, *, from_first_anchor: bool, by: int) -> None:
    original = PrefillReplayer._inputs

    def shifted(self: PrefillReplayer, batch: Any) -> tuple[torch.Tensor, ...]:
        ids, mask, positions, rows = original(self, batch)
        positions = positions.clone()
        for b, item in enumerate(batch):
            start = int(item.anchors_A[0]) if from_first_anchor else 0
            positions[b, start:] += by
        return ids, mask, positions, rows

    monkeypatch.setattr(PrefillReplayer, "_inputs", shifted)


def test_position_id_offset_at_the_decode_boundary_is_caught(
    monkeypatch: pytest.MonkeyPatch, replayer: PrefillReplayer, windows: list[dict[str, Any]]
) -> None:
    """Off by one where decode starts (prefix vs decoded positions): only the
    full-attention layer sees positions, and it flips."""
    _shift_positions(monkeypatch, from_first_anchor=True, by=1)
    result = run_parity(replayer, windows)
    assert not result.authoritative and result.mismatched_pairs > 0
    full = [i for i, t in enumerate(replayer.teacher.model.config.layer_types)
            if t == "full_attention"]
    assert {row["layer"] for row in result.per_layer if row["mismatches"]} <= set(full)


def test_a_constant_position_offset_is_invisible_to_rope(
    monkeypatch: pytest.MonkeyPatch, replayer: PrefillReplayer, windows: list[dict[str, Any]]
) -> None:
    """RoPE scores depend on position differences only, so shifting a whole row is not a
    labelling error; the gate rightly keeps parity (up to rounding)."""
    _shift_positions(monkeypatch, from_first_anchor=False, by=7)
    assert run_parity(replayer, windows).mismatched_pairs == 0


def test_reversed_tie_break_is_caught(teacher_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts 2j and 2j+1 get identical gate rows, so every top-k holds exact ties; decode
    ranks them lower id first, the perturbed replay higher id first."""
    tied = load_teacher(teacher_dir)
    with torch.no_grad():
        for layer in tied.model.model.layers:
            weight = layer.mlp.gate.weight
            weight[1::2] = weight[0::2]
    replayer = PrefillReplayer(tied)
    windows = decode_windows(tied, replayer.identity_id)[:1]
    assert run_parity(replayer, windows).authoritative

    def reversed_route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts, k = logits.shape[-1], tied.geometry.top_k
        order = torch.sort(logits.flip(-1), dim=-1, descending=True, stable=True).indices
        ids = (experts - 1 - order[..., :k]).contiguous()
        return ids, topk_weights(logits, ids, tied.geometry.weight_rule)

    # labels ranked by the route rule, not taken from the (lower-id-first) gates
    monkeypatch.setattr(AnchorCapture, "executed", lambda _self, _layers: None)
    monkeypatch.setattr(tied, "route", reversed_route)
    result = run_parity(replayer, windows)
    assert not result.authoritative and result.mismatch_rate == 1.0
    assert result.rank_only_mismatches == result.mismatched_pairs
    assert {e["kind"] for e in result.examples} == {"rank_order"}
    # the flips sit exactly at the ties: label margin 0, boundary margin ordinary
    assert result.margins["label"]["at_mismatch"]["quantiles"]["q1"] == 0.0
    assert result.margins["boundary"]["at_mismatch"]["quantiles"]["q0"] > 0.0


def _tamper(window: dict[str, Any], anchor: int, slot: int, fn: Any) -> dict[str, Any]:
    ids, weights = captured_routes(window)
    ids, weights = ids.copy(), weights.copy()
    fn(ids[anchor, slot], weights[anchor, slot])
    routes = dict(window["routes"], expert_ids=ids.astype("<i2").tobytes(),
                  weights=weights.astype("<f4").tobytes())
    return dict(window, routes=routes)


def test_tampered_captured_routes_are_caught(
    replayer: PrefillReplayer, windows: list[dict[str, Any]]
) -> None:
    def swap(ids: np.ndarray, _w: np.ndarray) -> None:
        ids[[3, 4]] = ids[[4, 3]]

    def replace(ids: np.ndarray, _w: np.ndarray) -> None:
        ids[9] = next(e for e in range(512) if e not in ids)

    def reweigh(_ids: np.ndarray, w: np.ndarray) -> None:
        w[0] += 0.01

    for fn, kind in ((swap, "rank_order"), (replace, "expert_set")):
        result = run_parity(replayer, [_tamper(windows[0], 5, 1, fn), *windows[1:]])
        assert result.mismatched_pairs == result.primary_mismatches == 1
        assert not result.authoritative
        assert result.per_layer[1]["mismatches"] == 1
        assert [(e["kind"], e["layer_slot"]) for e in result.examples] == [(kind, 1)]
    result = run_parity(replayer, [_tamper(windows[0], 5, 1, reweigh)])
    assert result.mismatched_pairs == 0 and result.weight_violations == 1
    assert not result.authoritative


def test_sample_size_and_skipped_windows(
    replayer: PrefillReplayer, windows: list[dict[str, Any]]
) -> None:
    no_routes = dict(windows[0], routes=None)
    truncated = dict(windows[1], first_token_ordinal=9)
    foreign = dict(windows[2], identity_id="f" * 64)
    result = run_parity(replayer, [no_routes, truncated, foreign, windows[0]],
                        ParityConfig(min_sample=2))
    assert result.windows_skipped == {"identity_mismatch": 1, "no_routes": 1,
                                      "truncated_history": 1}
    assert result.windows_compared == 1 and result.mismatched_pairs == 0
    assert not result.authoritative  # below min_sample
    empty = run_parity(replayer, [])
    assert not empty.authoritative and empty.pairs == 0
    assert isinstance(empty, ParityResult) and json.loads(empty.to_json())["pairs"] == 0


def test_malformed_routes_raise(windows: list[dict[str, Any]]) -> None:
    short = dict(windows[0], routes=dict(windows[0]["routes"], expert_ids=b"\0\0"))
    with pytest.raises(ParityError, match="bytes"):
        captured_routes(short)
    shuffled = dict(windows[0], routes=dict(windows[0]["routes"], layers=[1, 0, 2, 3]))
    with pytest.raises(ParityError, match="layers"):
        captured_routes(shuffled)
    for name, value in [("min_sample", 0), ("weight_atol", -1.0), ("batch_windows", 0)]:
        with pytest.raises(ConfigError, match=name):
            ParityConfig(**{name: value})


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(parity_command)
    return app


def test_cli_reads_a_window_file_and_writes_json(
    tmp_path: Path, teacher_dir: Path, windows: list[dict[str, Any]]
) -> None:
    source = tmp_path / "windows.bin"
    assert write_window_file(source, windows) == len(windows)
    assert [w["window_id"] for w in read_window_file(source)] == [w["window_id"] for w in windows]
    out = tmp_path / "parity.json"
    args = ["--teacher", str(teacher_dir), "--windows-file", str(source), "--out", str(out)]
    run = CliRunner().invoke(_cli(), args)
    assert run.exit_code == 0, run.output
    assert "AUTHORITATIVE" in run.output
    assert json.loads(out.read_text())["pairs"] == total_pairs(windows, 4)
    bad = tmp_path / "tampered.bin"
    write_window_file(bad, [_tamper(windows[0], 0, 0, lambda ids, _w: ids.__setitem__(
        slice(0, 2), ids[[1, 0]]))])
    assert CliRunner().invoke(_cli(), [*args[:3], str(bad), "--max-windows", "1"]).exit_code == 1
    neither = CliRunner().invoke(_cli(), ["--teacher", str(teacher_dir)])
    assert isinstance(neither.exception, ConfigError)
