"""Route-prediction metrics for the design note's Gate 3, computed on evaluation splits only.

Per row, with ``T`` the native top-k set (``|T| = K``) and ``P_b`` the ``b`` best-ranked
candidates (ties broken by the lower expert id):

* ``exact_match``: ``set(P_K) == T`` (order ignored).
* ``recall[b] = |P_b & T| / K`` and ``precision[b] = |P_b & T| / b`` for every budget,
  budgets clipped to E and deduplicated (by default k, 2k, 3k and 4k of the teacher's k).
* ``rr_first``: ``1 / r`` with ``r`` the 1-based rank of the best-ranked native expert
  (classic reciprocal rank); ``rr_top1``: ``1 / r`` of the native rank-0 expert. Both
  are 0 when the expert is absent from a candidate list and 1 for a perfect ranking.
* ``calibration``: ECE of candidate membership (only when probabilities are given):
  for each row's ``C_cal`` best-ranked candidates (``MetricsConfig.calibration_candidates``,
  default ``2K``: the predicted top-k set and the nearest misses, i.e. the set's
  boundary), the predicted probability that the candidate is in the native top-k set
  against whether it is; equal-width bins, ``ECE = sum_bins |members - sum p| / pairs``,
  with the reliability table. (Over every (row, expert) pair the ECE would be tiny by
  construction: most of the E experts are confidently out.)
* ``union_growth``: mean number of unique experts per layer over windows of
  ``w = 1..W`` consecutive tokens of one thread, from the targets and from the top-b
  predictions (the bytes a block of w tokens would fetch). Needs thread and ordinal.

Every metric is reported per split, overall, by layer and by domain. A ``train`` row
raises :class:`~train.exceptions.SplitMixingError`: evaluation can never see training
rows, and :func:`check_train_rows` keeps fitted controls on training rows only.

Legend: B batch rows, E experts, K native top-k, C candidates, W union windows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import teacher_budgets
from hebrus_flywheel.train.exceptions import BatchError, SplitMixingError

TRAIN_SPLIT = "train"
EVALUATION_SPLITS: tuple[str, ...] = (
    "validation", "temporal_holdout", "stress_holdout", "runtime_holdout",
)
SPLITS: tuple[str, ...] = (TRAIN_SPLIT, *EVALUATION_SPLITS)
RESULT_SCHEMA = "flywheel.train.route_metrics.v1"
NO_DOMAIN = "unspecified"


def split_array(split_B: str | Sequence[str] | np.ndarray, rows: int) -> np.ndarray:
    """Every row's split name ``(B,)``; a single string applies to the whole batch."""
    splits = (np.full(rows, split_B, dtype=object) if isinstance(split_B, str)
              else np.asarray(split_B, dtype=object))
    if splits.shape != (rows,):
        raise BatchError(f"split has shape {splits.shape}, expected ({rows},)")
    unknown = set(splits.tolist()) - set(SPLITS)
    if unknown:
        raise BatchError(f"unknown split(s) {sorted(map(str, unknown))}; use {', '.join(SPLITS)}")
    return splits


def check_evaluation_rows(split_B: str | Sequence[str] | np.ndarray, rows: int) -> np.ndarray:
    """The row splits, or SplitMixingError if any row belongs to ``train``."""
    splits = split_array(split_B, rows)
    if (splits == TRAIN_SPLIT).any():
        raise SplitMixingError(
            f"{int((splits == TRAIN_SPLIT).sum())} train row(s) reached an evaluator; "
            f"evaluate only {', '.join(EVALUATION_SPLITS)} rows and keep train rows for fitting"
        )
    return splits


def check_train_rows(split_B: str | Sequence[str] | np.ndarray, rows: int) -> np.ndarray:
    """The row splits, or SplitMixingError if any row is not ``train``."""
    splits = split_array(split_B, rows)
    if (splits != TRAIN_SPLIT).any():
        raise SplitMixingError(
            f"{int((splits != TRAIN_SPLIT).sum())} evaluation row(s) reached a fit that may "
            "only see train rows; select the train split for fitting"
        )
    return splits


def as_numpy(x: Any) -> np.ndarray:
    """A numpy view of a numpy array, a torch tensor (detached, on CPU) or a sequence."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def ranking(scores_BE: np.ndarray) -> np.ndarray:
    """Experts ordered best first ``(B, E)``; equal scores keep the lower expert id first."""
    scores_BE = np.asarray(scores_BE, dtype=np.float64)
    if not np.isfinite(scores_BE).all():
        raise BatchError("scores contain NaN or infinity; check the model or baseline output")
    return np.argsort(-scores_BE, axis=1, kind="stable")


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """What :class:`MetricsAccumulator` measures."""

    expert_count: int = 512
    """E: experts per routed layer."""
    top_k: int = 10
    """K: native experts per row; targets must have exactly K columns."""
    budgets: tuple[int, ...] | None = None
    """Candidate budgets for recall/precision, clipped to E and deduplicated; None: the
    teacher's k, 2k, 3k and 4k (:func:`core.geometry.teacher_budgets`)."""
    calibration_bins: int = 10
    """Equal-width probability bins of the ECE reliability table."""
    calibration_candidates: int = 0
    """Best-ranked candidates per row whose top-k membership the ECE judges; 0 means
    ``2 * top_k`` (clipped to E)."""
    union_max_window: int = 8
    """Largest token window W of route-union growth; 0 turns union growth off."""

    def __post_init__(self) -> None:
        for name in ("expert_count", "top_k", "calibration_bins"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"MetricsConfig.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.expert_count:
            raise ConfigError("MetricsConfig.top_k must not exceed MetricsConfig.expert_count")
        if self.budgets is not None and (not self.budgets or min(self.budgets) < 1):
            raise ConfigError(f"MetricsConfig.budgets must be positive, got {self.budgets!r}")
        if self.union_max_window < 0:
            raise ConfigError("MetricsConfig.union_max_window must be >= 0 (0 = off)")
        if isinstance(self.calibration_candidates, bool) or self.calibration_candidates < 0:
            raise ConfigError("MetricsConfig.calibration_candidates must be >= 0 (0 = 2k), "
                              f"got {self.calibration_candidates!r}")

    @property
    def calibration_width(self) -> int:
        """Candidates per row of the ECE (see the module doc)."""
        return min(self.calibration_candidates or 2 * self.top_k, self.expert_count)

    @property
    def effective_budgets(self) -> tuple[int, ...]:
        """The budgets clipped to E, sorted, without repeats."""
        budgets = teacher_budgets(self.top_k) if self.budgets is None else self.budgets
        return tuple(sorted({min(b, self.expert_count) for b in budgets}))


def row_metrics(candidates_BC: np.ndarray, target_ids_BK: np.ndarray,
                budgets: Sequence[int]) -> dict[str, np.ndarray]:
    """Per-row exact match, recall/precision at each budget and reciprocal ranks."""
    hit_BC = (candidates_BC[:, :, None] == target_ids_BK[:, None, :]).any(axis=2)  # (B, C)
    hits_BC = np.cumsum(hit_BC, axis=1)  # (B, C)
    K = target_ids_BK.shape[1]
    out = {"exact_match": (hits_BC[:, K - 1] == K).astype(np.float64)}
    for b in budgets:
        out[f"recall@{b}"] = hits_BC[:, b - 1] / K
        out[f"precision@{b}"] = hits_BC[:, b - 1] / b
    out["rr_first"] = _reciprocal_rank(hit_BC)
    out["rr_top1"] = _reciprocal_rank(candidates_BC == target_ids_BK[:, :1])
    return out


def _reciprocal_rank(hit_BC: np.ndarray) -> np.ndarray:
    first_B = hit_BC.argmax(axis=1)
    return np.where(hit_BC.any(axis=1), 1.0 / (first_B + 1), 0.0)


def reliability_counts(prob_BE: np.ndarray, target_ids_BK: np.ndarray, bins: int,
                       candidates_BC: np.ndarray | None = None) -> np.ndarray:
    """Per-row ``(B, 3, bins)``: count, probability sum and member count of each bin, over
    the experts ``candidates_BC`` of each row (every expert when None)."""
    B, E = prob_BE.shape
    if not np.isfinite(prob_BE).all() or prob_BE.min() < 0 or prob_BE.max() > 1:
        raise BatchError("membership probabilities must be finite and within [0, 1]")
    member_BE = np.zeros((B, E))
    np.put_along_axis(member_BE, target_ids_BK, 1.0, axis=1)
    if candidates_BC is not None:
        prob_BE = np.take_along_axis(prob_BE, candidates_BC, axis=1)
        member_BE = np.take_along_axis(member_BE, candidates_BC, axis=1)
    C = prob_BE.shape[1]
    bin_BE = np.minimum((prob_BE * bins).astype(np.int64), bins - 1)
    flat_B = (np.arange(B)[:, None] * bins + bin_BE).ravel()
    out = np.zeros((3, B * bins))
    for i, values in enumerate((np.ones(B * C), prob_BE.ravel(), member_BE.ravel())):
        out[i] = np.bincount(flat_B, weights=values, minlength=B * bins)
    return out.reshape(3, B, bins).transpose(1, 0, 2)


class _Stats:
    """Running sums of one group (split x overall/layer/domain)."""

    def __init__(self, metric_count: int, bins: int, streams: int, windows: int) -> None:
        self.rows = 0
        self.metric_sums = np.zeros(metric_count)
        self.calibration = np.zeros((3, bins))
        self.calibrated = False
        self.union_sums = np.zeros((streams, windows))
        self.union_counts = np.zeros(windows)


class _UnionTracker:
    """Tails of the last W rows of every (split, thread, layer), as expert bitmasks."""

    def __init__(self, windows: int) -> None:
        self.windows = windows
        self.tails: dict[tuple[str, str, int], deque[tuple[int, tuple[int, ...]]]] = {}

    def push(self, key: tuple[str, str, int], ordinal: int,
             masks: tuple[int, ...]) -> list[np.ndarray]:
        """Add one row; return the union sizes ``(streams,)`` of windows 1..w it closes."""
        tail = self.tails.setdefault(key, deque(maxlen=self.windows))
        if tail and tail[-1][0] >= ordinal:
            raise BatchError(
                f"thread {key[1]!r} layer {key[2]}: ordinal {ordinal} arrived after "
                f"{tail[-1][0]}; union growth needs each thread's rows in ordinal order "
                "(sort the evaluation stream, or set MetricsConfig.union_max_window=0)"
            )
        tail.append((ordinal, masks))
        unions, sizes = list(masks), []
        for w in range(1, len(tail) + 1):
            past_ordinal, past_masks = tail[-w]
            if past_ordinal != ordinal - (w - 1):
                break
            unions = [u | m for u, m in zip(unions, past_masks, strict=True)]
            sizes.append(np.array([u.bit_count() for u in unions], dtype=np.float64))
        return sizes


def _bitmasks(ids_BC: np.ndarray, expert_count: int) -> list[int]:
    member_BE = np.zeros((ids_BC.shape[0], expert_count), dtype=bool)
    np.put_along_axis(member_BE, ids_BC, True, axis=1)
    packed = np.packbits(member_BE, axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


class MetricsAccumulator:
    """Streams evaluation batches of one method; :meth:`result` is JSON-serialisable."""

    def __init__(self, config: MetricsConfig, *, method: str) -> None:
        self.config = config
        self.method = method
        self.budgets = config.effective_budgets
        self.metric_names = ["exact_match", *(f"recall@{b}" for b in self.budgets),
                             *(f"precision@{b}" for b in self.budgets), "rr_first", "rr_top1"]
        self.streams = ("target", *(str(b) for b in self.budgets))
        self._groups: dict[tuple[str, str, str], _Stats] = {}
        self._union = _UnionTracker(config.union_max_window) if config.union_max_window else None
        self._with_probabilities: bool | None = None

    def update(
        self, *, target_ids_BK: Any, layer_B: Any, split_B: str | Sequence[str] | np.ndarray,
        scores_BE: Any = None, candidates_BC: Any = None, membership_prob_BE: Any = None,
        domain_B: Any = None, thread_B: Any = None, ordinal_B: Any = None,
    ) -> None:
        """Add one batch. Give ``scores_BE`` (full ranking) or ranked ``candidates_BC``
        (at least the largest budget); ``thread_B`` and ``ordinal_B`` enable union growth."""
        targets_BK = self._targets(target_ids_BK)
        B = targets_BK.shape[0]
        splits_B = check_evaluation_rows(split_B, B)
        layers_B = _labels(_layers(layer_B), B, "layer")
        domains_B = np.full(B, NO_DOMAIN, dtype=object) if domain_B is None else _labels(
            as_numpy(domain_B), B, "domain")
        candidates = self._candidates(scores_BE, candidates_BC, B)
        per_row = row_metrics(candidates, targets_BK, self.budgets)
        values_BM = np.stack([per_row[name] for name in self.metric_names], axis=1)
        calibration = self._calibration_counts(membership_prob_BE, targets_BK, candidates)
        unions = None
        if self._union is not None and thread_B is not None and ordinal_B is not None:
            threads_B = _labels(as_numpy(thread_B), B, "thread")
            ordinals_B = as_numpy(ordinal_B).astype(np.int64).reshape(B)
            unions = self._union_sizes(splits_B, layers_B, threads_B, ordinals_B, targets_BK,
                                       candidates)
        keys_3B = [np.full(B, "all", dtype=object), layers_B, domains_B]
        self._add_rows(splits_B, keys_3B, values_BM, calibration, unions)

    def _targets(self, target_ids_BK: Any) -> np.ndarray:
        targets_BK = as_numpy(target_ids_BK)
        K, E = self.config.top_k, self.config.expert_count
        if targets_BK.ndim != 2 or targets_BK.shape[1] != K or targets_BK.shape[0] == 0:
            raise BatchError(f"targets have shape {targets_BK.shape}, expected (B>0, K={K})")
        _check_ids(targets_BK, E, "target")
        return targets_BK.astype(np.int64)

    def _candidates(self, scores_BE: Any, candidates_BC: Any, rows: int) -> np.ndarray:
        if (scores_BE is None) == (candidates_BC is None):
            raise BatchError("give exactly one of scores_BE or candidates_BC")
        E, needed = self.config.expert_count, max(self.budgets[-1], self.config.top_k)
        if scores_BE is not None:
            scores = as_numpy(scores_BE)
            if scores.shape != (rows, E):
                raise BatchError(f"scores have shape {scores.shape}, expected ({rows}, {E})")
            return ranking(scores)
        candidates = as_numpy(candidates_BC).astype(np.int64)
        if candidates.ndim != 2 or candidates.shape[0] != rows or candidates.shape[1] < needed:
            raise BatchError(f"candidates have shape {candidates.shape}; expected ({rows}, C) "
                             f"with C >= {needed} (largest budget and K)")
        _check_ids(candidates, E, "candidate")
        ordered = np.sort(candidates, axis=1)
        if (ordered[:, 1:] == ordered[:, :-1]).any():
            raise BatchError("a candidate list repeats an expert; rank each expert once")
        return candidates

    def _calibration_counts(self, prob_BE: Any, targets_BK: np.ndarray,
                            candidates_BC: np.ndarray) -> np.ndarray | None:
        given = prob_BE is not None
        if self._with_probabilities not in (None, given):
            raise BatchError("membership probabilities must be given for every batch or none")
        self._with_probabilities = given
        if not given:
            return None
        prob = as_numpy(prob_BE).astype(np.float64)
        if prob.shape != (targets_BK.shape[0], self.config.expert_count):
            raise BatchError(f"membership probabilities have shape {prob.shape}, expected "
                             f"({targets_BK.shape[0]}, {self.config.expert_count})")
        width = self.config.calibration_width
        if candidates_BC.shape[1] < width:
            raise BatchError(f"calibration needs the {width} best-ranked candidates per row, "
                             f"got {candidates_BC.shape[1]}; give scores or more candidates")
        return reliability_counts(prob, targets_BK, self.config.calibration_bins,
                                  candidates_BC[:, :width])

    def _stats(self, split: str, dim: str, label: str) -> _Stats:
        key = (split, dim, label)
        if key not in self._groups:
            self._groups[key] = _Stats(len(self.metric_names), self.config.calibration_bins,
                                       len(self.streams), self.config.union_max_window)
        return self._groups[key]

    def _add_rows(self, splits_B: np.ndarray, keys_3B: list[np.ndarray], values_BM: np.ndarray,
                  calibration_B3n: np.ndarray | None,
                  unions: tuple[np.ndarray, np.ndarray] | None) -> None:
        for dim, labels_B in zip(_DIMENSIONS, keys_3B, strict=True):
            pairs = np.array([f"{s}\x1f{lab}" for s, lab in zip(splits_B, labels_B, strict=True)])
            unique, inverse = np.unique(pairs, return_inverse=True)
            for g, pair in enumerate(unique):
                rows = inverse == g
                split, label = pair.split("\x1f", 1)
                stats = self._stats(split, dim, label)
                stats.rows += int(rows.sum())
                stats.metric_sums += values_BM[rows].sum(axis=0)
                if calibration_B3n is not None:
                    stats.calibration += calibration_B3n[rows].sum(axis=0)
                    stats.calibrated = True
                if unions is not None:
                    stats.union_sums += unions[0][rows].sum(axis=0)
                    stats.union_counts += unions[1][rows].sum(axis=0)

    def _union_sizes(self, splits_B: np.ndarray, layers_B: np.ndarray, threads_B: np.ndarray,
                     ordinals_B: np.ndarray, targets_BK: np.ndarray,
                     candidates_BC: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Union sizes ``(B, streams, W)`` of the windows each row closes, and which it
        closes ``(B, W)``; rows are pushed per (split, thread, layer) in ordinal order."""
        if self._union is None:
            raise BatchError("union growth is off (MetricsConfig.union_max_window=0)")
        E, W = self.config.expert_count, self.config.union_max_window
        masks = [_bitmasks(targets_BK, E), *(_bitmasks(candidates_BC[:, :b], E)
                                             for b in self.budgets)]
        sizes_BSW = np.zeros((len(ordinals_B), len(self.streams), W))
        closed_BW = np.zeros((len(ordinals_B), W))
        order = np.lexsort((ordinals_B, layers_B.astype(str), threads_B.astype(str),
                            splits_B.astype(str)))
        for i in order:
            key = (str(splits_B[i]), str(threads_B[i]), int(layers_B[i]))
            sizes = self._union.push(key, int(ordinals_B[i]), tuple(m[i] for m in masks))
            if sizes:
                sizes_BSW[i, :, : len(sizes)] = np.stack(sizes, axis=1)
                closed_BW[i, : len(sizes)] = 1.0
        return sizes_BSW, closed_BW

    def result(self) -> dict[str, Any]:
        """Means per split, overall / by layer / by domain, as plain JSON types."""
        c = self.config
        out: dict[str, Any] = {
            "schema": RESULT_SCHEMA, "method": self.method,
            "config": {"expert_count": c.expert_count, "top_k": c.top_k,
                       "budgets": list(self.budgets), "calibration_bins": c.calibration_bins,
                       "calibration_candidates": c.calibration_width,
                       "union_max_window": c.union_max_window},
            "splits": {},
        }
        for (split, dim, label), stats in sorted(self._groups.items(), key=_group_order):
            node = out["splits"].setdefault(split, {"overall": None, "by_layer": {},
                                                    "by_domain": {}})
            if dim == "overall":
                node["overall"] = self._summary(stats)
            else:
                node[dim][label] = self._summary(stats)
        return out

    def _summary(self, stats: _Stats) -> dict[str, Any]:
        mean = dict(zip(self.metric_names, stats.metric_sums / max(stats.rows, 1), strict=True))
        return {
            "rows": stats.rows,
            "exact_match": float(mean["exact_match"]),
            "recall": {str(b): float(mean[f"recall@{b}"]) for b in self.budgets},
            "precision": {str(b): float(mean[f"precision@{b}"]) for b in self.budgets},
            "rr_first": float(mean["rr_first"]),
            "rr_top1": float(mean["rr_top1"]),
            "calibration": _calibration_summary(stats) if stats.calibrated else None,
            "union_growth": self._union_summary(stats),
        }

    def _union_summary(self, stats: _Stats) -> dict[str, Any] | None:
        if not stats.union_counts.any():
            return None
        means_SW = [[float(s / n) if n else None for s, n in zip(row, stats.union_counts,
                                                                  strict=True)]
                    for row in stats.union_sums]
        return {"windows": list(range(1, self.config.union_max_window + 1)),
                "target": means_SW[0],
                "predicted": dict(zip(self.streams[1:], means_SW[1:], strict=True))}


_DIMENSIONS = ("overall", "by_layer", "by_domain")


def _group_order(item: tuple[tuple[str, str, str], _Stats]) -> tuple[Any, ...]:
    split, dim, label = item[0]
    numeric = label.lstrip("-").isdigit()
    return (SPLITS.index(split), _DIMENSIONS.index(dim), not numeric,
            int(label) if numeric else 0, label)


def _calibration_summary(stats: _Stats) -> dict[str, Any]:
    count_n, prob_n, member_n = stats.calibration
    bins = len(count_n)
    table = [{"low": i / bins, "high": (i + 1) / bins, "count": int(count_n[i]),
              "mean_probability": float(prob_n[i] / count_n[i]) if count_n[i] else None,
              "frequency": float(member_n[i] / count_n[i]) if count_n[i] else None}
             for i in range(bins)]
    ece = float(np.abs(member_n - prob_n).sum() / max(count_n.sum(), 1))
    return {"ece": ece, "reliability": table}


def _labels(values: np.ndarray, rows: int, name: str) -> np.ndarray:
    if values.shape != (rows,):
        raise BatchError(f"{name} has shape {values.shape}, expected ({rows},)")
    return np.array([str(v) for v in values.tolist()], dtype=object)


def _layers(layer_B: Any) -> np.ndarray:
    layers = as_numpy(layer_B)
    if not np.issubdtype(layers.dtype, np.integer) or (layers.size and layers.min() < 0):
        raise BatchError("layer ids must be non-negative integers")
    return layers


def _check_ids(ids: np.ndarray, expert_count: int, name: str) -> None:
    if not np.issubdtype(ids.dtype, np.integer):
        raise BatchError(f"{name} expert ids must be integers, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= expert_count):
        raise BatchError(f"{name} expert ids must lie in [0, {expert_count}); "
                         "check MetricsConfig.expert_count against the snapshot geometry")
