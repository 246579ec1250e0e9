"""Prefill replay engine: labels from one forward, batch-invariant, identity-pinned."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.exceptions import WindowFormatError, WindowIdentityError
from hebrus_flywheel.replay.features import AnchorCapture
from hebrus_flywheel.replay.prefill import (
    PrefillReplayer,
    ReplayConfig,
    WindowLabels,
    is_diagnostic,
    padded_length,
    plan_batches,
)
from hebrus_flywheel.replay.teacher import Teacher, load_teacher

LABEL_FIELDS = ("anchor_ordinals_A", "token_ids_A", "expert_ids_ALK", "weights_ALK",
                "margins_AL", "features_ALD")


def history(length: int, seed: int) -> list[int]:
    """Deterministic token ids in the tiny teacher's vocabulary."""
    return np.random.default_rng(seed).integers(5, 4000, length).tolist()


def make_window(
    identity_id: str, token_ids: Sequence[int], anchors: Sequence[int], *, first: int = 0,
    routes: dict[str, Any] | None = None, thread: str = "t0", split: str = "train",
) -> dict[str, Any]:
    """A complete Window.v1 record (valid for the Avro codec)."""
    body = f"{identity_id}|{thread}|{first}|{list(anchors)}|{list(token_ids)}".encode()
    return {
        "window_id": hashlib.sha256(body).hexdigest(), "content_digest": "0" * 64,
        "split": split, "split_rule": "test", "owner": "owner-a", "thread": thread,
        "generation": 0, "identity_id": identity_id, "domain_tags": ["test"],
        "thread_digest": "0" * 64, "thread_token_count": first + len(token_ids),
        "window_index": 0, "window_count": 1, "token_ids": list(token_ids),
        "first_token_ordinal": first, "anchor_positions": [int(a) for a in anchors],
        "turns": [], "routes": routes, "config_digest": "0" * 64,
    }


@pytest.fixture(scope="module")
def teacher(teacher_dir: Path) -> Teacher:
    return load_teacher(teacher_dir)


@pytest.fixture(scope="module")
def replayer(teacher: Teacher) -> PrefillReplayer:
    return PrefillReplayer(teacher, ReplayConfig())


@pytest.fixture(scope="module")
def windows(replayer: PrefillReplayer) -> list[dict[str, Any]]:
    """Lengths around the 64-token alignment: unaligned, exact multiples, and one past
    512 tokens (where sdpa's CPU kernel changes its kv block size)."""
    out = []
    for i, n in enumerate([100, 64, 37, 128, 150, 65, 300, 700]):
        anchors = sorted({n // 3, n // 2, *range(max(0, n - 20), n)})
        out.append(make_window(replayer.identity_id, history(n, i), anchors, thread=f"t{i}"))
    return out


def assert_same_labels(a: WindowLabels, b: WindowLabels) -> None:
    assert a.window_id == b.window_id
    for name in LABEL_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), f"{a.window_id[:8]} {name} differs"


def test_labels_layout_and_dtypes(replayer: PrefillReplayer, windows: list[dict[str, Any]]) -> None:
    labels = replayer.replay(windows[:1])[0]
    geometry = replayer.teacher.geometry
    a, layers, k = len(windows[0]["anchor_positions"]), geometry.routed_layer_count, geometry.top_k
    assert labels.expert_ids_ALK.shape == (a, layers, k)
    assert labels.expert_ids_ALK.dtype == np.uint16
    assert labels.weights_ALK.shape == (a, layers, k) and labels.weights_ALK.dtype == np.float32
    assert labels.margins_AL.shape == (a, layers) and labels.margins_AL.dtype == np.float32
    assert labels.features_ALD.shape == (a, layers, 64)
    assert labels.features_ALD.dtype == np.float16
    assert labels.anchor_ordinals_A.dtype == np.int64 and labels.token_ids_A.dtype == np.int32
    assert labels.hidden_ALH is None and labels.label_count == a * layers
    np.testing.assert_allclose(labels.weights_ALK.sum(-1), 1.0, rtol=1e-5)
    assert (labels.margins_AL >= 0).all()
    tokens = np.asarray(windows[0]["token_ids"])
    assert labels.token_ids_A.tolist() == tokens[windows[0]["anchor_positions"]].tolist()
    assert (labels.window_id, labels.split, labels.identity_id) == (
        windows[0]["window_id"], "train", replayer.identity_id)


def test_batch_composition_does_not_change_labels(
    teacher: Teacher, windows: list[dict[str, Any]]
) -> None:
    """Alone, all together, unsorted, tiny budgets: bit-identical labels and features."""
    alone = [PrefillReplayer(teacher).replay([w])[0] for w in windows]
    configs = [ReplayConfig(), ReplayConfig(sort_by_length=False, max_batch_tokens=1 << 16),
               ReplayConfig(max_batch_tokens=256), ReplayConfig(max_batch_tokens=640)]
    for config in configs:
        batched = PrefillReplayer(teacher, config).replay(list(reversed(windows)))[::-1]
        for a, b in zip(alone, batched, strict=True):
            assert_same_labels(a, b)


def test_labels_match_a_plain_unpadded_prefill(
    teacher: Teacher, replayer: PrefillReplayer, windows: list[dict[str, Any]]
) -> None:
    for window, labels in zip(windows, replayer.replay(windows), strict=True):
        ids_BT = torch.tensor([window["token_ids"]])
        plain = teacher.forward_routes(ids_BT, capture_hidden=True)
        anchors = window["anchor_positions"]
        ids_ALK, _ = teacher.route(plain.router_logits_BTLE[0, anchors])
        assert np.array_equal(ids_ALK.numpy(), labels.expert_ids_ALK.astype(np.int64))
        expected = replayer.projection.reduce(plain.hidden_BTLH[0, anchors].numpy())
        np.testing.assert_allclose(labels.features_ALD.astype(np.float32),
                                   expected.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_executed_routes_equal_the_route_rule_on_the_captured_logits(
    monkeypatch: pytest.MonkeyPatch, replayer: PrefillReplayer, windows: list[dict[str, Any]]
) -> None:
    """Labels taken from the gates are, bit for bit, the rule applied to the same logits."""
    executed = replayer.replay(windows)
    monkeypatch.setattr(AnchorCapture, "executed", lambda _self, _layers: None)
    for a, b in zip(executed, replayer.replay(windows), strict=True):
        assert_same_labels(a, b)


def test_positions_are_thread_ordinals_and_trailing_tokens_are_ignored(
    replayer: PrefillReplayer
) -> None:
    tokens = history(90, 11)
    base = make_window(replayer.identity_id, tokens, [40, 60, 89], first=500)
    labels = replayer.replay([base])[0]
    assert labels.anchor_ordinals_A.tolist() == [540, 560, 589]
    longer = make_window(replayer.identity_id, tokens + history(30, 12), [40, 60, 89], first=500)
    assert_same_labels(labels, dataclasses.replace(replayer.replay([longer])[0],
                                                   window_id=labels.window_id))


def test_diagnostic_sample_keeps_full_width_states(teacher: Teacher,
                                                   windows: list[dict[str, Any]]) -> None:
    every = PrefillReplayer(teacher, ReplayConfig(diagnostic_hidden_every_n=1)).replay(windows)
    for labels in every:
        assert labels.hidden_ALH is not None and labels.hidden_ALH.dtype == np.float32
        assert labels.hidden_ALH.shape == (*labels.margins_AL.shape, teacher.geometry.hidden_size)
    projection = PrefillReplayer(teacher).projection
    np.testing.assert_allclose(projection.reduce(every[0].hidden_ALH).astype(np.float32),
                               every[0].features_ALD.astype(np.float32), rtol=1e-3, atol=1e-3)
    sampled = PrefillReplayer(teacher, ReplayConfig(diagnostic_hidden_every_n=3)).replay(windows)
    chosen = [lab.hidden_ALH is not None for lab in sampled]
    assert chosen == [is_diagnostic(w["window_id"], 3) for w in windows]


def test_identity_mismatch_is_refused_with_the_window_id(
    replayer: PrefillReplayer, windows: list[dict[str, Any]]
) -> None:
    foreign = dict(windows[1], identity_id="f" * 64)
    with pytest.raises(WindowIdentityError) as info:
        replayer.replay([windows[0], foreign])
    assert info.value.window_id == foreign["window_id"]
    assert info.value.reason == "identity_mismatch"
    assert "identity_mismatch" in str(info.value)


@pytest.mark.parametrize(("change", "match"), [
    ({"token_ids": [1, 2, 10**6]}, "outside"),
    ({"token_ids": []}, "non-empty"),
    ({"anchor_positions": [3, 2]}, "ascend"),
    ({"anchor_positions": [500]}, "ascend"),
    ({"first_token_ordinal": -1}, "first_token_ordinal"),
    ({"owner": None}, "owner"),
    ({"domain_tags": "code"}, "domain_tags"),
])
def test_malformed_windows_are_refused(
    replayer: PrefillReplayer, windows: list[dict[str, Any]], change: dict[str, Any], match: str
) -> None:
    bad = {**windows[0], **change}
    with pytest.raises(WindowFormatError, match=match) as info:
        replayer.check_window(bad)
    assert info.value.reason == "invalid_window" and info.value.window_id == bad["window_id"]


def test_config_is_validated(teacher: Teacher) -> None:
    for name, value in [("feature_dim", 0), ("max_batch_tokens", -1), ("pad_multiple", 0),
                        ("feature_dtype", "int8"), ("dtype", "float128"),
                        ("diagnostic_hidden_every_n", -2), ("projection_seed", -1),
                        ("sort_by_length", 1)]:
        with pytest.raises(ConfigError, match=name):
            ReplayConfig(**{name: value})
    with pytest.raises(ConfigError, match="dtype"):
        PrefillReplayer(teacher, ReplayConfig(dtype="bfloat16"))


def test_plan_batches_one_padded_length_per_batch_within_the_budget() -> None:
    lengths = [100, 64, 37, 700, 128, 150, 65, 120, 110]
    plan = plan_batches(lengths, max_batch_tokens=256, pad_multiple=64, sort_by_length=True)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    padded = [{padded_length(lengths[i], 64) for i in batch} for batch in plan]
    assert all(len(p) == 1 for p in padded)
    assert [p.pop() for p in padded] == [64, 128, 128, 128, 192, 704]
    assert plan[:4] == [[1, 2], [0, 4], [6, 7], [8]]  # 2 rows of 128 fit 256 tokens
    for batch in plan:
        assert len(batch) * padded_length(max(lengths[i] for i in batch), 64) <= 256 \
            or len(batch) == 1
    unsorted = plan_batches(lengths, max_batch_tokens=10**6, pad_multiple=64,
                            sort_by_length=False)
    assert unsorted == [[0, 4, 6, 7, 8], [1, 2], [3], [5]]


def test_replay_contract_pins_the_feature_projection(replayer: PrefillReplayer) -> None:
    contract = replayer.replay_contract()
    assert contract["identity_id"] == replayer.identity_id
    assert contract["feature_contract"]["projection_digest"] == replayer.projection.digest
    assert contract["experts_implementation"] == "tiled_mm"
    assert contract["replay_config"]["pad_multiple"] == 64
