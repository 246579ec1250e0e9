"""``routes.check_route_block``: the checks of a run of tokens' routes at once.

The duplicate-id and rank-order checks compare columns of the whole block instead of
sorting every row; these tests plant one fault at every rank pair and at row and token
boundaries, and check it is caught and located exactly as the row-by-row check locates it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from hebrus_flywheel.streams import routes
from hebrus_flywheel.streams.exceptions import PublishValidationError
from tests.unit.test_validation import EXPERTS, GEOMETRY, LAYERS, K

TOKENS = 6


def _block(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Clean routes: distinct ids per row, weights falling along rank, and each row's last
    weight below the next row's first (a rise across rows is not a rank-order violation)."""
    rng = np.random.default_rng(seed)
    ids_TLK = np.stack([np.stack([rng.choice(EXPERTS, K, replace=False) for _ in range(LAYERS)])
                        for _ in range(TOKENS)]).astype("<u2")
    weights_TLK = np.sort(rng.random((TOKENS, LAYERS, K)), axis=2)[..., ::-1] * 0.5
    weights_TLK[..., 0] = 0.9  # each row starts above the previous row's last rank
    return ids_TLK, np.ascontiguousarray(weights_TLK, dtype="<f4")


def _verdict(ids_TLK: np.ndarray, weights_TLK: np.ndarray) -> tuple[str, str] | None:
    try:
        routes.check_route_block(ids_TLK, weights_TLK, GEOMETRY)
    except PublishValidationError as exc:
        return exc.reason, str(exc)
    return None


def test_a_clean_block_passes_though_weights_rise_across_rows() -> None:
    ids_TLK, weights_TLK = _block()
    flat = weights_TLK.ravel()
    assert (flat[1:] > flat[:-1]).any()  # the rows' boundaries rise
    assert _verdict(ids_TLK, weights_TLK) is None


def _repeat_id(first: int, second: int) -> Callable[[np.ndarray, np.ndarray, int, int], None]:
    def plant(ids_TLK: np.ndarray, _: np.ndarray, token: int, row: int) -> None:
        ids_TLK[token, row, second] = ids_TLK[token, row, first]
    return plant


def _raise_weight(rank: int) -> Callable[[np.ndarray, np.ndarray, int, int], None]:
    def plant(_: np.ndarray, weights_TLK: np.ndarray, token: int, row: int) -> None:
        weights_TLK[token, row, rank] = weights_TLK[token, row, rank - 1] + 0.01
    return plant


FAULTS = [
    *((_repeat_id(first, second), "duplicate_expert_id")
      for first, second in itertools.combinations(range(K), 2)),
    *((_raise_weight(rank), "rank_order_violation") for rank in range(1, K)),
]


@pytest.mark.parametrize(("token", "row"), [(0, 0), (2, 1), (TOKENS - 1, LAYERS - 1)])
@pytest.mark.parametrize(("plant", "reason"), FAULTS)
def test_a_repeated_id_or_rising_weight_at_any_rank_is_caught_and_located(
    plant: Callable[[np.ndarray, np.ndarray, int, int], None], reason: str, token: int,
    row: int,
) -> None:
    ids_TLK, weights_TLK = _block()
    plant(ids_TLK, weights_TLK, token, row)
    verdict = _verdict(ids_TLK, weights_TLK)
    assert verdict is not None
    assert verdict[0] == reason
    assert f"token {token}, row {row} " in verdict[1]


def test_an_id_repeated_across_rows_or_tokens_is_no_duplicate() -> None:
    ids_TLK, weights_TLK = _block()
    ids_TLK[1, 0] = ids_TLK[0, 0]
    ids_TLK[0, 1] = ids_TLK[0, 0]
    assert _verdict(ids_TLK, weights_TLK) is None


def test_the_first_faulty_token_is_named_when_several_are() -> None:
    ids_TLK, weights_TLK = _block()
    ids_TLK[4, 3, 3] = ids_TLK[4, 3, 0]
    ids_TLK[1, 2, 2] = ids_TLK[1, 2, 1]
    verdict = _verdict(ids_TLK, weights_TLK)
    assert verdict is not None and "token 1, row 2 " in verdict[1]
