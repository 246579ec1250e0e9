"""Gate 1 measurements at their sources: token/position parity in the parity accumulator,
sequence-id reuse over captured windows, window-id reuse over shard lineage."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from hebrus_flywheel.consumers.holdout import sequence_id_reuse
from hebrus_flywheel.replay.parity import ParityAccumulator, ParityConfig
from hebrus_flywheel.train.qualify import collect_ids

L, K = 2, 2


def _window(tokens: list[int], positions: list[int], first: int = 0) -> dict[str, Any]:
    ids = np.tile(np.arange(K, dtype="<i2"), (len(positions), L, 1))
    weights = np.full((len(positions), L, K), 0.5, dtype="<f4")
    return {"window_id": "w", "token_ids": tokens, "anchor_positions": positions,
            "first_token_ordinal": first,
            "routes": {"layer_count": L, "top_k": K, "layers": list(range(L)),
                       "expert_ids": ids.tobytes(), "weights": weights.tobytes()}}


def _labels(ordinals: list[int], tokens: list[int]) -> Any:
    a = len(ordinals)
    return SimpleNamespace(
        window_id="w", anchor_ordinals_A=np.asarray(ordinals), token_ids_A=np.asarray(tokens),
        expert_ids_ALK=np.tile(np.arange(K), (a, L, 1)),
        weights_ALK=np.full((a, L, K), 0.5, np.float32), margins_AL=np.ones((a, L), np.float32))


def _result(window: dict[str, Any], labels: Any) -> Any:
    acc = ParityAccumulator(ParityConfig(), identity_id="rt", teacher_dtype="float32",
                            tie_break_rule="r", weight_rule="w")
    acc.add(window, labels)
    return acc.result()


def test_token_and_position_parity_pass_when_replay_saw_the_captured_tokens() -> None:
    result = _result(_window([5, 6, 7, 8], [2, 3]), _labels([2, 3], [7, 8]))
    assert (result.tokens_compared, result.token_id_mismatches,
            result.position_mismatches) == (2, 0, 0)
    assert result.authoritative


def test_planted_token_and_position_mismatches_are_counted_and_not_authoritative() -> None:
    result = _result(_window([5, 6, 7, 8], [2, 3]), _labels([2, 4], [9, 8]))
    assert (result.tokens_compared, result.token_id_mismatches,
            result.position_mismatches) == (2, 1, 1)
    assert result.mismatched_pairs == 0 and not result.authoritative


def test_sequence_ids_reused_across_owners_or_generations_are_counted() -> None:
    def window(owner: str, generation: int, *seqs: str) -> dict[str, Any]:
        return {"owner": owner, "generation": generation,
                "turns": [{"sequence_id": s} for s in seqs]}
    good = [window("o1", 0, "a", "b"), window("o1", 0, "b", "c"), window("o2", 0, "d")]
    assert sequence_id_reuse(good) == {"sequence_ids": 4, "reused": 0, "examples": []}
    bad = [*good, window("o2", 0, "a"), window("o1", 1, "c")]
    found = sequence_id_reuse(bad)
    assert (found["sequence_ids"], found["reused"]) == (4, 2)
    assert found["examples"] == ["a: o1 g0, o2 g0", "c: o1 g0, o1 g1"]


def test_window_ids_reused_across_lineages_are_counted() -> None:
    rows = [{"window_id": "w1", "owner": "o1", "thread": "t1", "generation": 0},
            {"window_id": "w2", "owner": "o1", "thread": "t1", "generation": 0}]
    assert collect_ids.window_id_reuse(rows, "test").reused == 0
    rows.append({"window_id": "w1", "owner": "o1", "thread": "t1", "generation": 1})
    found = collect_ids.window_id_reuse(rows, "test")
    assert (found.checked, found.reused) == (2, 1)
    assert found.examples == ("w1: o1/t1 g0, o1/t1 g1",)


def test_sequence_id_measurement_is_read_from_the_manifest_parity() -> None:
    assert collect_ids.sequence_id_reuse({"pairs": 3}) is None
    found = collect_ids.sequence_id_reuse({"opaque_ids": {
        "sequence_ids": 5, "reused": 1, "examples": ["a: o1 g0, o2 g0"], "source": "s"}})
    assert found is not None and (found.kind, found.checked, found.reused) == (
        "sequence_id", 5, 1)
