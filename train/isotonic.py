"""Isotonic recalibration on top of a Platt fit, kept only when it helps held-out pairs.

A temperature and a bias (:class:`train.predictors.PlattCalibration`) bend every
probability by the same sigmoid; a gate-prior predictor's reliability curve is not a
sigmoid of its score, and that one shape leaves its ECE above the goal. The isotonic
step maps the Platt probability through the monotone step function that best fits
membership (scipy's pool-adjacent-violators, ``scipy.optimize.isotonic_regression``),
stored as :data:`KNOTS` knots and applied by linear interpolation. Monotone, so the
ranking is unchanged.

It is fitted on validation pairs only, and only kept when it lowers the held-out BCE:
the validation rows are split in two, each half's isotonic map is scored on the other
half against the Platt probabilities of the same pairs, and the map is kept when the
two held-out BCEs together are lower (isotonic regression scored on its own pairs
always wins; the split is what makes the choice honest). Then it is refitted on every
validation pair.

Legend: B rows, C candidates per row, N pairs.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import isotonic_regression

KNOTS = 64
"""Knots of a stored isotonic map (quantiles of the fitted probabilities)."""
TIE_BREAK = 1e-6
"""Weight of the Platt probability in the stored map's output (keeps it strictly monotone)."""
_EPS = 1e-6


def fit_knots(prob_N: np.ndarray, member_N: np.ndarray, knots: int = KNOTS
              ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(x, y)`` of the isotonic map of membership on ``prob``: ``knots`` points,
    x non-decreasing (quantile bins of ``prob``), y non-decreasing in [0, 1]."""
    order = np.argsort(prob_N, kind="stable")
    p, m = prob_N[order].astype(np.float64), member_N[order].astype(np.float64)
    bins = np.array_split(np.arange(p.size), min(knots, p.size))
    x = np.array([p[b].mean() for b in bins])
    mean = np.array([m[b].mean() for b in bins])
    weight = np.array([float(b.size) for b in bins])
    y = np.clip(isotonic_regression(mean, weights=weight).x, 0.0, 1.0)
    if x.size < knots:  # few pairs: repeat the last knot so every map has KNOTS points
        x, y = np.pad(x, (0, knots - x.size), mode="edge"), np.pad(y, (0, knots - y.size),
                                                                   mode="edge")
    return tuple(float(v) for v in x), tuple(float(v) for v in y)


def interpolate(prob: torch.Tensor, x: tuple[float, ...], y: tuple[float, ...]) -> torch.Tensor:
    """``prob`` through the piecewise-linear map ``(x, y)``, blended with :data:`TIE_BREAK`
    of ``prob`` itself so the map is strictly increasing (flat steps and the ends would
    otherwise tie candidates the scores rank apart)."""
    xs = torch.tensor(x, dtype=torch.float64, device=prob.device)
    ys = torch.tensor(y, dtype=torch.float64, device=prob.device)
    p = prob.double().clamp(float(xs[0]), float(xs[-1]))
    hi = torch.searchsorted(xs, p.contiguous(), right=False).clamp(1, xs.numel() - 1)
    x0, x1, y0, y1 = xs[hi - 1], xs[hi], ys[hi - 1], ys[hi]
    span = x1 - x0
    t = torch.where(span > 0, (p - x0) / torch.where(span > 0, span, torch.ones_like(span)),
                    torch.ones_like(p))
    mapped = y0 + t * (y1 - y0)
    return ((1.0 - TIE_BREAK) * mapped + TIE_BREAK * prob.double()).to(prob.dtype)


def _bce(prob_N: np.ndarray, member_N: np.ndarray) -> float:
    p = np.clip(prob_N, _EPS, 1.0 - _EPS)
    return float(-(member_N * np.log(p) + (1.0 - member_N) * np.log(1.0 - p)).mean())


def held_out_gain(prob_BC: np.ndarray, member_BC: np.ndarray) -> float:
    """Platt BCE minus isotonic BCE on held-out halves (rows split even/odd): > 0 when
    the isotonic map helps pairs it was not fitted on."""
    halves = (np.arange(prob_BC.shape[0]) % 2 == 0, np.arange(prob_BC.shape[0]) % 2 == 1)
    if min(int(h.sum()) for h in halves) < 2:
        return 0.0
    gain = 0.0
    for fit_rows, score_rows in (halves, halves[::-1]):
        x, y = fit_knots(prob_BC[fit_rows].ravel(), member_BC[fit_rows].ravel())
        held = torch.from_numpy(prob_BC[score_rows].ravel())
        member = member_BC[score_rows].ravel()
        iso = interpolate(held, x, y).numpy()
        gain += _bce(prob_BC[score_rows].ravel(), member) - _bce(iso, member)
    return gain
