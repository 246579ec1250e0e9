"""The reference decode runtime: KV-cache decode routes == one-prefill routes (Gate 1).

The parity check is the design note's strict one: expert ids AND rank order must be
identical at every (token, routed layer); weights are compared with a declared
tolerance. On failure the message reports how many pairs differ and their margins.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.decode import (
    FINISH_EOS,
    FINISH_FORCED,
    FINISH_LENGTH,
    DecodedTurn,
    DecodeRuntime,
    SamplingConfig,
    sample_token,
)
from hebrus_flywheel.replay.exceptions import DecodeError
from hebrus_flywheel.replay.teacher import Teacher, TeacherPreset, init_teacher, load_teacher

WEIGHT_ATOL = 1e-5
PREFIX = [(7 * i + 3) % 4000 + 5 for i in range(70)]  # crosses the 64-token chunk boundary


@pytest.fixture(scope="module")
def teacher(teacher_dir: Path) -> Teacher:
    return load_teacher(teacher_dir)


@pytest.fixture(scope="module")
def runtime(teacher: Teacher) -> DecodeRuntime:
    return DecodeRuntime(teacher)


def parity_report(teacher: Teacher, prefix: list[int], turn: DecodedTurn) -> dict[str, object]:
    """Compare a decoded turn's routes with ONE plain prefill over prefix + decoded tokens."""
    full_BT = torch.tensor([prefix + turn.token_ids])
    logits_TLE = teacher.forward_routes(full_BT).router_logits_BTLE[0, len(prefix):]
    ids_TLK, weights_TLK = teacher.route(logits_TLE)
    differ_TL = (ids_TLK.numpy() != turn.expert_ids_TLK.astype(np.int64)).any(-1)
    return {
        "pairs": differ_TL.size,
        "differing_pairs": int(differ_TL.sum()),
        "margins_at_differences": turn.margins_TL[differ_TL].tolist(),
        "min_margin": float(turn.margins_TL.min()),
        "max_weight_diff": float(np.abs(weights_TLK.numpy() - turn.weights_TLK).max()),
    }


def assert_parity(teacher: Teacher, prefix: list[int], turn: DecodedTurn) -> None:
    report = parity_report(teacher, prefix, turn)
    assert report["differing_pairs"] == 0, f"decode/prefill route mismatch: {report}"
    assert report["max_weight_diff"] <= WEIGHT_ATOL, report


def test_sampled_decode_routes_equal_prefill_routes(
    teacher: Teacher, runtime: DecodeRuntime
) -> None:
    sampling = SamplingConfig(temperature=1.0, seed=7, max_new_tokens=60, stop_at_eos=False)
    turn = runtime.decode_turn(PREFIX, sampling=sampling)
    assert len(turn.token_ids) == 60 and turn.finish_reason == FINISH_LENGTH
    assert_parity(teacher, PREFIX, turn)


def test_forced_decode_routes_equal_prefill_routes(
    teacher: Teacher, runtime: DecodeRuntime
) -> None:
    forced = [(11 * i + 5) % 4000 + 7 for i in range(50)]
    turn = runtime.decode_turn(PREFIX[:20], forced_ids=forced)
    assert turn.token_ids == forced and turn.finish_reason == FINISH_FORCED
    assert_parity(teacher, PREFIX[:20], turn)


def test_turn_layout_ordinals_and_dtypes(teacher: Teacher, runtime: DecodeRuntime) -> None:
    turn = runtime.decode_turn(PREFIX[:10], forced_ids=[20, 21, 22])
    layers, k = teacher.geometry.routed_layer_count, teacher.geometry.top_k
    assert turn.prefix_length == 10
    assert turn.ordinals.tolist() == [10, 11, 12]
    assert turn.expert_ids_TLK.shape == (3, layers, k) and turn.expert_ids_TLK.dtype == np.uint16
    assert turn.weights_TLK.shape == (3, layers, k) and turn.weights_TLK.dtype == np.float32
    assert turn.margins_TL.shape == (3, layers)
    np.testing.assert_allclose(turn.weights_TLK.sum(-1), 1.0, rtol=1e-5)
    assert turn.executed_mismatches == 0
    assert turn.timing.steps == 3 and turn.timing.decode_s > 0


def test_decode_feeds_one_token_per_step_through_the_cache(
    teacher: Teacher, runtime: DecodeRuntime
) -> None:
    seen: list[int] = []
    embed = teacher.model.get_input_embeddings()
    handle = embed.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[-1]))
    try:
        runtime.decode_turn(PREFIX[:12], forced_ids=[30, 31, 32, 33])
    finally:
        handle.remove()
    assert seen == [12, 1, 1, 1, 1]


def test_greedy_and_seeded_sampling_are_reproducible(runtime: DecodeRuntime) -> None:
    greedy = SamplingConfig(max_new_tokens=12, stop_at_eos=False)
    assert runtime.decode_turn(PREFIX, sampling=greedy).token_ids == \
        runtime.decode_turn(PREFIX, sampling=greedy).token_ids
    hot = SamplingConfig(temperature=1.5, seed=3, max_new_tokens=12, stop_at_eos=False)
    first = runtime.decode_turn(PREFIX, sampling=hot)
    second = runtime.decode_turn(PREFIX, sampling=hot)
    assert first.token_ids == second.token_ids
    assert np.array_equal(first.expert_ids_TLK, second.expert_ids_TLK)
    other = runtime.decode_turn(PREFIX, sampling=dataclasses.replace(hot, seed=4))
    assert other.token_ids != first.token_ids


def test_generation_stops_after_feeding_eos(teacher: Teacher, runtime: DecodeRuntime) -> None:
    greedy = SamplingConfig(max_new_tokens=8, stop_at_eos=False)
    tokens = runtime.decode_turn(PREFIX, sampling=greedy).token_ids
    stop = next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 2)
    eos_runtime = DecodeRuntime(dataclasses.replace(teacher, eos_token_ids=(tokens[stop],)))
    turn = eos_runtime.decode_turn(PREFIX, sampling=dataclasses.replace(greedy, stop_at_eos=True))
    assert turn.finish_reason == FINISH_EOS
    assert turn.token_ids == tokens[: stop + 1]
    assert turn.expert_ids_TLK.shape[0] == stop + 1


def test_sample_token_filters() -> None:
    logits_V = torch.tensor([1.0, 3.0, 3.0, 0.5, 2.9])
    gen = torch.Generator().manual_seed(0)
    assert sample_token(logits_V, SamplingConfig(), gen) == 1  # greedy: lowest id of the tie
    for _ in range(20):
        assert sample_token(logits_V, SamplingConfig(temperature=1.0, top_k=1), gen) == 1
        assert sample_token(logits_V, SamplingConfig(temperature=1.0, top_p=0.01), gen) == 1
        assert sample_token(logits_V, SamplingConfig(temperature=1.0, top_k=3), gen) in {1, 2, 4}


def test_invalid_requests_raise(runtime: DecodeRuntime, teacher: Teacher) -> None:
    with pytest.raises(DecodeError, match="empty"):
        runtime.decode_turn([], forced_ids=[1])
    with pytest.raises(DecodeError, match="outside"):
        runtime.decode_turn([1, teacher.vocab_size], forced_ids=[1])
    with pytest.raises(DecodeError, match="either"):
        runtime.decode_turn([1], forced_ids=[2], sampling=SamplingConfig())
    for field, value in [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2),
                         ("max_new_tokens", 0), ("seed", -1)]:
        with pytest.raises(ConfigError, match=field):
            SamplingConfig(**{field: value})


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_other_family_decode_prefill_parity(family: str, tmp_path: Path) -> None:
    from tests.unit.test_teacher import save_family_checkpoint

    other = load_teacher(save_family_checkpoint(family, tmp_path / family))
    runtime = DecodeRuntime(other)
    prefix = [(5 * i + 2) % 120 + 2 for i in range(30)]
    sampling = SamplingConfig(temperature=1.0, seed=1, max_new_tokens=40, stop_at_eos=False)
    turn = runtime.decode_turn(prefix, sampling=sampling)
    assert_parity(other, prefix, turn)
    forced = runtime.decode_turn(prefix[:5], forced_ids=prefix[5:])
    assert_parity(other, prefix[:5], forced)


def test_deeper_hybrid_teacher_keeps_parity(tmp_path: Path) -> None:
    preset = TeacherPreset(name="test-12l", num_hidden_layers=12)
    deep = load_teacher(init_teacher(tmp_path / "deep", preset=preset, seed=3))
    sampling = SamplingConfig(temperature=1.0, seed=2, max_new_tokens=40, stop_at_eos=False)
    turn = DecodeRuntime(deep).decode_turn(PREFIX, sampling=sampling)
    assert_parity(deep, PREFIX, turn)


@pytest.mark.slow
def test_48_layer_teacher_keeps_parity(tmp_path: Path) -> None:
    deep = load_teacher(init_teacher(tmp_path / "48l", preset="tiny-qwen3-next-48l", seed=0))
    sampling = SamplingConfig(temperature=1.0, seed=5, max_new_tokens=100, stop_at_eos=False)
    turn = DecodeRuntime(deep).decode_turn(PREFIX, sampling=sampling)
    assert_parity(deep, PREFIX, turn)
