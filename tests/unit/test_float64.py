"""The float64 compute path: float32 islands raised, decode and prefill logits agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.execution import Execution
from hebrus_flywheel.replay.adapters import capture_routes
from hebrus_flywheel.replay.decode import DecodeRuntime
from hebrus_flywheel.replay.float64 import Float64Islands
from hebrus_flywheel.replay.parity import run_parity
from hebrus_flywheel.replay.prefill import PrefillReplayer, ReplayConfig
from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
from hebrus_flywheel.replay.teacher import Teacher, load_teacher
from tests.unit.test_parity import decode_windows
from tests.unit.test_prefill import history


@pytest.fixture(scope="module")
def teacher64(teacher_dir: Path) -> Teacher:
    return load_teacher(teacher_dir, dtype="float64")


def test_every_float32_request_becomes_float64_inside_the_mode() -> None:
    x = torch.ones(4, dtype=torch.float64)
    with Float64Islands():
        made = [x.float(), x.to(torch.float32), x.to("cpu", torch.float32),
                x.to(dtype=torch.float32), x.type(torch.float32),
                torch.softmax(x, -1, dtype=torch.float32), torch.arange(3, dtype=torch.float32),
                torch.zeros(2, dtype=torch.float32)]
        kept = [x.to(torch.bfloat16), x.to(torch.long)]
    assert [t.dtype for t in made] == [torch.float64] * len(made)
    assert [t.dtype for t in kept] == [torch.bfloat16, torch.long]
    assert x.float().dtype == torch.float32  # only while the mode is active


def test_decode_and_prefill_router_logits_agree_to_float64_rounding(teacher64: Teacher) -> None:
    """Without the mode the modeling code's float32 norms and kernels keep the two
    paths about 1e-6 apart even with float64 weights."""
    model, tokens = teacher64.model, history(96, 3)
    prefill_LTE = teacher64.forward_routes(torch.tensor([tokens])).router_logits_BTLE[0]
    prefill_LTE = prefill_LTE.transpose(0, 1)  # (L, T, E)
    steps = []
    with torch.inference_mode(), capture_routes(model, teacher64.adapter,
                                                teacher64.geometry) as capture:
        cache = teacher64.adapter.new_cache(model)
        for t, token in enumerate(tokens):
            capture.clear()
            model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[t]]),
                  past_key_values=cache, use_cache=True)
            steps.append(capture.router_logits_LNE()[:, 0])
    decode_LTE = torch.stack(steps, 1)
    assert decode_LTE.dtype == prefill_LTE.dtype == torch.float64
    assert (decode_LTE - prefill_LTE).abs().max().item() < 1e-10


def test_float64_replay_reaches_parity_with_identical_weights(teacher64: Teacher) -> None:
    replayer = PrefillReplayer(teacher64, ReplayConfig(dtype="float64"))
    result = run_parity(replayer, decode_windows(teacher64, replayer.identity_id))
    assert result.authoritative and result.mismatched_pairs == 0
    assert result.teacher_dtype == "float64"
    assert result.max_weight_abs_diff is not None and result.max_weight_abs_diff <= 1e-7


def test_float64_on_mps_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="MPS has no float64"):
        Execution(device="mps", dtype="float64")


def test_float64_is_its_own_runtime_identity(teacher_dir: Path, teacher64: Teacher) -> None:
    assert Execution(dtype="float64").dtype == "float64"
    identity64 = build_runtime_identity(teacher64, teacher_dir)
    identity32 = build_runtime_identity(load_teacher(teacher_dir), teacher_dir)
    assert identity64["dtype"] == "float64"
    assert identity64["identity_id"] != identity32["identity_id"]


def test_decode_runtime_records_float32_labels_from_a_float64_teacher(
        teacher64: Teacher) -> None:
    tokens = history(40, 5)
    turn = DecodeRuntime(teacher64).decode_turn(tokens[:10], forced_ids=tokens[10:])
    assert turn.weights_TLK.dtype.name == "float32" and turn.executed_mismatches == 0
