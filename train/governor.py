"""Model C: the block-size and admission governor, calibrated on trace summaries.

Not a neural model. From candidate-path trace summaries (one per proposal path: the
accepted-prefix length, the drafter's log-probabilities, the native route union of the
first B candidates and, when Model B's predictions are given, the predicted union)
it reports for every block size B = 1..B_max:

* ``tau``: τ(B) = E[min(accepted_prefix_length, B)], the expected accepted tokens of a
  block of B candidates (the verifier's bonus token is not counted);
* ``union``: U_B, the mean over layers of the unique native experts of the block's B
  candidate positions (``predicted_union`` from Model B's top-k when given);
* ``break_even``: U_B < k·τ(B), the design note's routed-byte break-even against top-k
  autoregressive routing; ``net_experts`` = k·τ(B) − U_B per layer and block;
* ``rejected_risk``: E[B − min(a, B)] / B, the share of the block's candidates rejected;
* ``missing_bytes``: U_B × (1 − resident_fraction) × expert_bytes per layer, and whether
  reading them fits the deadline slack at the declared SSD bandwidth.

It recommends the B with the largest net saving that breaks even and fits the slack
(``None``: do not speculate), and an admission threshold: a path is admitted when its
predicted accepted tokens per predicted fetched expert (from a logistic model of
acceptance on the drafter's log-probabilities, fitted on train) reaches the threshold
that maximises the net saving Σ(k·accepted − U) of admitted paths on validation.
Calibration reads train and validation only; :func:`governor_report` scores the
recommendation on every split present.

Legend: P paths, B block positions, L layers, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.candidates.rows import CandidateRows


@dataclass(frozen=True, kw_only=True)
class GovernorConfig:
    """What the governor weighs beyond the trace."""

    expert_bytes: int = 1
    """Bytes of one routed expert."""
    resident_fraction: float = 0.0
    """Share of a block's union already resident (the simulator's cache hit rate)."""
    bandwidth_bytes_per_s: float | None = None
    """SSD bandwidth; with ``slack_s`` bounds B by the deadline. None: unbounded."""
    slack_s: float | None = None
    """Deadline slack per layer of a block: the time missing bytes may take to read."""

    def __post_init__(self) -> None:
        if isinstance(self.expert_bytes, bool) or self.expert_bytes < 1:
            raise ConfigError("GovernorConfig.expert_bytes must be a positive integer")
        if not 0 <= self.resident_fraction <= 1:
            raise ConfigError("GovernorConfig.resident_fraction must be in [0, 1]")
        for name in ("bandwidth_bytes_per_s", "slack_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"GovernorConfig.{name} must be > 0 or None")


@dataclass(eq=False)
class PathSummaries:
    """One trace summary per proposal path of one split."""

    split: str
    accepted_P: np.ndarray
    """Accepted-prefix length (0..B)."""
    logprob_PB: np.ndarray
    """Drafter log-probability per candidate position (NaN where absent)."""
    union_PB: np.ndarray
    """Mean over layers of the native route union of positions 1..b."""
    predicted_union_PB: np.ndarray | None
    """The same for Model B's top-k predictions (None: not given)."""
    top_k: int


def _union(ids_PLBC: np.ndarray, expert_count: int) -> np.ndarray:
    """Mean over layers of the unique ids of positions 1..b ``(P, B)``; -1 = absent."""
    P, L, B, _ = ids_PLBC.shape
    seen = np.zeros((P, L, B, expert_count + 1), bool)
    idx = np.where(ids_PLBC < 0, expert_count, ids_PLBC)
    np.put_along_axis(seen, idx, True, axis=3)
    cumulative = np.logical_or.accumulate(seen[..., :expert_count], axis=2)
    return cumulative.sum(axis=3).mean(axis=1)


def summarize_paths(rows: CandidateRows, *, expert_count: int,
                    predicted_NC: np.ndarray | None = None) -> PathSummaries:
    """Trace summaries of ``rows`` (``predicted_NC``: Model B's top-k per row, aligned)."""
    paths, path_idx = np.unique(rows.path_N.astype(str), return_inverse=True)
    L, B, K = int(rows.layer_N.max()) + 1, rows.block, rows.target_NK.shape[1]
    pos = rows.position_N - 1
    ids = np.full((len(paths), L, B, K), -1, np.int64)
    ids[path_idx, rows.layer_N, pos] = rows.target_NK
    logprob = np.full((len(paths), B), np.nan)
    logprob[path_idx, pos] = rows.logprob_N
    accepted = np.zeros(len(paths), np.int64)
    accepted[path_idx] = rows.accepted_length_N
    predicted = None
    if predicted_NC is not None:
        pred = np.full((len(paths), L, B, predicted_NC.shape[1]), -1, np.int64)
        pred[path_idx, rows.layer_N, pos] = predicted_NC
        predicted = _union(pred, expert_count)
    return PathSummaries(split=rows.split, accepted_P=accepted, logprob_PB=logprob,
                         union_PB=_union(ids, expert_count), predicted_union_PB=predicted,
                         top_k=K)


def block_table(s: PathSummaries, config: GovernorConfig) -> list[dict[str, Any]]:
    """τ(B), U_B, the break-even and the costs for every block size."""
    out = []
    for b in range(1, s.union_PB.shape[1] + 1):
        accepted = np.minimum(s.accepted_P, b)
        tau, union = float(accepted.mean()), float(s.union_PB[:, b - 1].mean())
        predicted = (None if s.predicted_union_PB is None
                     else float(s.predicted_union_PB[:, b - 1].mean()))
        missing = union * (1 - config.resident_fraction) * config.expert_bytes
        fits = (None if config.bandwidth_bytes_per_s is None or config.slack_s is None
                else missing / config.bandwidth_bytes_per_s <= config.slack_s)
        out.append({"block": b, "tau": tau, "union": union, "predicted_union": predicted,
                    "k_tau": s.top_k * tau, "break_even": union < s.top_k * tau,
                    "net_experts": s.top_k * tau - union,
                    "rejected_risk": float((b - accepted).mean()) / b,
                    "missing_bytes": missing, "fits_deadline": fits})
    return out


def recommend_block(table: list[dict[str, Any]]) -> int | None:
    """The block size with the largest net saving that breaks even and fits the slack."""
    ok = [r for r in table if r["break_even"] and r["fits_deadline"] is not False]
    return max(ok, key=lambda r: (r["net_experts"], -r["block"]))["block"] if ok else None


@dataclass(frozen=True)
class AcceptanceModel:
    """P(position p survives | p - 1 survived) = sigmoid(w · [1, logprob_p, p])."""

    weights: tuple[float, float, float]

    def survival_PB(self, logprob_PB: np.ndarray) -> np.ndarray:
        B = logprob_PB.shape[1]
        x = np.nan_to_num(logprob_PB, nan=-30.0)
        z = self.weights[0] + self.weights[1] * x + self.weights[2] * np.arange(1, B + 1)
        return np.where(np.isnan(logprob_PB), 0.0, 1 / (1 + np.exp(-z)))

    def expected_accepted_PB(self, logprob_PB: np.ndarray) -> np.ndarray:
        """Predicted accepted tokens of a block of b candidates, ``(P, B)``."""
        return np.cumsum(np.cumprod(self.survival_PB(logprob_PB), axis=1), axis=1)


def fit_acceptance(s: PathSummaries, *, iterations: int = 25, ridge: float = 1e-3
                   ) -> AcceptanceModel:
    """Logistic regression (Newton steps) of survival at every position a path reached."""
    B = s.logprob_PB.shape[1]
    position = np.arange(1, B + 1)[None, :].repeat(len(s.accepted_P), 0)
    reached = (position <= s.accepted_P[:, None] + 1) & ~np.isnan(s.logprob_PB)
    y = (position <= s.accepted_P[:, None])[reached].astype(float)
    X = np.stack([np.ones(y.size), s.logprob_PB[reached], position[reached]], axis=1)
    w = np.zeros(3)
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-X @ w))
        hessian = X.T @ (X * (p * (1 - p))[:, None]) + ridge * np.eye(3)
        w = w - np.linalg.solve(hessian, X.T @ (p - y) + ridge * w)
    return AcceptanceModel(weights=(float(w[0]), float(w[1]), float(w[2])))


def _net(s: PathSummaries, block: int) -> np.ndarray:
    """Measured net experts saved per layer by each path at ``block``: k·accepted − U."""
    return s.top_k * np.minimum(s.accepted_P, block) - s.union_PB[:, block - 1]


def predicted_net(s: PathSummaries, model: AcceptanceModel, block: int,
                  mean_union: float) -> np.ndarray:
    """The governor's admission score: k·(predicted accepted) − (predicted union)."""
    union = (np.full(len(s.accepted_P), mean_union) if s.predicted_union_PB is None
             else s.predicted_union_PB[:, block - 1])
    return s.top_k * model.expected_accepted_PB(s.logprob_PB)[:, block - 1] - union


def admission_threshold(score_P: np.ndarray, net_P: np.ndarray) -> float:
    """The threshold on ``score_P`` that maximises the measured net of admitted paths
    (``inf``: admit none)."""
    candidates = np.concatenate([np.unique(score_P), [np.inf]])
    totals = [net_P[score_P >= t].sum() for t in candidates]
    return float(candidates[int(np.argmax(totals))])


def admission_result(s: PathSummaries, score_P: np.ndarray, threshold: float,
                     block: int) -> dict[str, Any]:
    net = _net(s, block)
    admitted = score_P >= threshold
    return {"paths": len(net), "admitted": int(admitted.sum()),
            "net_experts_governed": float(net[admitted].sum()) / max(len(net), 1),
            "net_experts_admit_all": float(net.sum()) / max(len(net), 1),
            "accepted_tokens_governed": float(np.minimum(s.accepted_P, block)[admitted].sum())}


def governor_report(summaries: dict[str, PathSummaries],
                    config: GovernorConfig | None = None) -> dict[str, Any]:
    """Model C's result (JSON types): block tables per split, the recommended B and
    admission threshold (calibrated on train + validation), and the admission's
    measured net saving per path on every split (``net_experts_*``: experts per layer
    saved against top-k autoregressive routing; 0 = no speculation)."""
    config = GovernorConfig() if config is None else config
    if "train" not in summaries or "validation" not in summaries:
        raise ConfigError("governor_report needs train and validation summaries")
    tables = {split: block_table(s, config) for split, s in summaries.items()}
    train, validation = summaries["train"], summaries["validation"]
    model = fit_acceptance(train)
    block = recommend_block(tables["validation"])
    out: dict[str, Any] = {"config": {"expert_bytes": config.expert_bytes,
                                      "resident_fraction": config.resident_fraction,
                                      "bandwidth_bytes_per_s": config.bandwidth_bytes_per_s,
                                      "slack_s": config.slack_s},
                           "top_k": validation.top_k, "tables": tables,
                           "recommended_block": block, "acceptance_model": list(model.weights),
                           "admission_threshold": None, "admission": {}}
    if block is None:  # no B breaks even on average: admission may still pick paths that do
        block = max(tables["validation"], key=lambda r: r["net_experts"])["block"]
    out["admission_block"] = block
    mean_union = float(train.union_PB[:, block - 1].mean())
    threshold = admission_threshold(predicted_net(validation, model, block, mean_union),
                                    _net(validation, block))
    out["admission_threshold"] = None if not np.isfinite(threshold) else threshold
    for split, s in summaries.items():
        out["admission"][split] = admission_result(
            s, predicted_net(s, model, block, mean_union), threshold, block)
    return out
