"""ThreadRoutes reads stored runs and single observations as the per-token mapping that
load_thread used to build (one dict per token), without building it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.streams.processors.thread_routes import ThreadRoutes

LAYERS, K = 3, 2
STAGES = ("s0", "s1", "s2")


def _run(first_token: int, n: int, *, payload: bool = True) -> dict[str, Any]:
    ids = np.arange(n * LAYERS * K, dtype="<i2") + first_token
    weights = np.linspace(1.0, 0.0, n * LAYERS * K, dtype="<f4")
    return {"token_ids": list(range(first_token, first_token + n)), "turn_index": 1,
            "ids": ids.tobytes() if payload else b"",
            "weights": weights.tobytes() if payload else b"", "stages": STAGES}


def _single(token: int) -> dict[str, Any]:
    return {"token_id": token, "turn_index": 3, "ids": bytes([token % 256]) * (2 * LAYERS * K),
            "weights": b"\x00" * (4 * LAYERS * K), "stages": STAGES}


def _expanded(parts: list[tuple[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """What load_thread built before: one dict per token, ordinals ascending."""
    out: dict[int, dict[str, Any]] = {}
    for first, value in parts:
        if "token_id" in value:
            out[first] = value
            continue
        n = len(value["token_ids"])
        si, sw = len(value["ids"]) // n, len(value["weights"]) // n
        for i in range(n):
            out[first + i] = {"token_id": value["token_ids"][i], "turn_index": value["turn_index"],
                              "ids": value["ids"][i * si:(i + 1) * si],
                              "weights": value["weights"][i * sw:(i + 1) * sw],
                              "stages": value["stages"]}
    return dict(sorted(out.items()))


PARTS = [(10, _run(500, 4)), (3, _single(77)), (20, _run(900, 2, payload=False)), (5, _single(8))]


def test_reads_as_the_per_token_mapping_it_replaces() -> None:
    routes, expected = ThreadRoutes(PARTS), _expanded(PARTS)
    assert list(routes) == list(expected) == [3, 5, 10, 11, 12, 13, 20, 21]
    assert len(routes) == len(expected)
    assert {o: dict(routes[o]) for o in routes} == expected
    assert routes.ordinals.tolist() == list(expected)
    assert routes.token_ids().tolist() == [r["token_id"] for r in expected.values()]
    for ordinal, route in expected.items():
        assert routes.packed(ordinal) == (route["ids"], route["weights"])


def test_membership_of_one_ordinal_and_of_an_array() -> None:
    routes = ThreadRoutes(PARTS)
    probe = np.array([0, 3, 4, 5, 9, 10, 13, 14, 19, 21, 22, 1000], dtype=np.int64)
    expected = [int(o) in _expanded(PARTS) for o in probe]
    assert routes.routed(probe).tolist() == expected
    assert [int(o) in routes for o in probe] == expected
    assert "3" not in routes  # an ordinal is an int, as in the dict it replaces
    with pytest.raises(KeyError):
        routes[14]


def test_no_routes() -> None:
    routes = ThreadRoutes([])
    assert len(routes) == 0 and list(routes) == []
    assert routes.token_ids().tolist() == []
    assert routes.routed(np.array([0, 1], dtype=np.int64)).tolist() == [False, False]


def test_overlapping_stored_routes_are_refused_with_the_ordinal() -> None:
    with pytest.raises(ValueError, match="overlap at ordinal 12"):
        ThreadRoutes([(10, _run(0, 4)), (12, _single(5))])
