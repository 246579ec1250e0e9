"""train.isotonic: the isotonic map on top of Platt, kept only when held-out pairs gain."""

from __future__ import annotations

import numpy as np
import torch

from hebrus_flywheel.train.isotonic import KNOTS, interpolate
from hebrus_flywheel.train.predictors import fit_platt, pair_ece


def _step_reliability(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores whose membership rate is a step, not a sigmoid, of the score."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(rows, 8))
    rate = np.where(scores > 0.5, 0.9, np.where(scores > -0.5, 0.5, 0.05))
    member = (rng.random(size=scores.shape) < rate).astype(np.float64)
    return torch.from_numpy(scores), torch.from_numpy(member)


def test_the_map_is_kept_when_held_out_pairs_gain_and_lowers_their_ece() -> None:
    scores, member = _step_reliability(4000, seed=0)
    platt = fit_platt(scores, member, isotonic=False)
    chosen = fit_platt(scores, member)
    assert len(chosen.knot_x) == KNOTS and len(chosen.knot_y) == KNOTS
    assert (chosen.scale, chosen.bias) == (platt.scale, platt.bias)
    fresh_scores, fresh_member = _step_reliability(4000, seed=1)  # pairs it never saw
    before = pair_ece(platt.probabilities(fresh_scores), fresh_member)
    after = pair_ece(chosen.probabilities(fresh_scores), fresh_member)
    assert after < before / 2, (before, after)
    # monotone and strictly so: the ranking of every row is the scores' ranking
    ranked = chosen.probabilities(fresh_scores).argsort(dim=1, stable=True)
    assert torch.equal(ranked, fresh_scores.argsort(dim=1, stable=True))


def test_platt_is_unchanged_under_the_map_when_it_already_fits() -> None:
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(3000, 8))
    member = (rng.random(size=scores.shape) < 1 / (1 + np.exp(-2 * scores))).astype(float)
    chosen = fit_platt(torch.from_numpy(scores), torch.from_numpy(member))
    assert abs(chosen.scale - 2.0) < 0.2


def test_interpolation_is_the_knots_between_them_and_monotone_beyond() -> None:
    x, y = (0.1, 0.5, 0.9), (0.0, 0.5, 1.0)
    p = torch.tensor([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0], dtype=torch.float64)
    out = interpolate(p, x, y)
    assert torch.allclose(out[1:6], torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0],
                                                 dtype=torch.float64), atol=1e-5)
    assert bool((out[1:] > out[:-1]).all()) and 0.0 <= float(out.min()) <= float(out.max()) <= 1.0
