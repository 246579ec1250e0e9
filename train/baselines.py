"""Training-free route predictors: the controls of the design note's Gate 3.

Every baseline returns a float64 score array ``(B, E)`` that ranks *all* E experts
without ties (``score = E - rank``), so at any budget every method proposes exactly
``budget`` candidates. A method's own evidence decides first; experts it cannot order
(short history, equal scores) are filled deterministically by the per-layer training
frequency of a :class:`FrequencyTable`, then by the lower expert id.

* :class:`RandomBaseline`: a seeded random permutation per row.
* :class:`FrequencyTable` / :func:`frequency_scores`: per-layer native-route
  frequency, fitted on ``train`` rows only (anything else raises SplitMixingError).
* :class:`HistoryBaselines`: per thread, in causal order, the previous token's route
  at the same layer (``previous_token``), the same token's route at the previous layer
  (``adjacent_layer``) and a per-layer LRU of recently routed experts (``lru``).
* :class:`NativeGateBaseline`: the router of layer l applied to an earlier
  representation (the pre-attention state): ``logits = h @ W_l^T``. Full-width hidden
  states are used directly; reduced features are lifted with the pseudo-inverse of the
  capture plane's linear reduction.

Legend: B batch rows, L routed layers, E experts, K native top-k, C candidates,
H full hidden width, D reduced feature width.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.exceptions import BaselineError, BatchError
from hebrus_flywheel.train.metrics import as_numpy, check_train_rows

HISTORY_METHODS: tuple[str, ...] = ("previous_token", "adjacent_layer", "lru")


@dataclass(frozen=True, kw_only=True)
class BaselineConfig:
    """Geometry and knobs shared by the baselines."""

    layer_count: int = 48
    """L: routed layers of the target model."""
    expert_count: int = 512
    """E: experts per routed layer."""
    seed: int = 0
    """Seed of the random baseline's generator."""
    lru_capacity: int = 64
    """Experts remembered per (thread, layer) by the LRU baseline (>= largest budget)."""

    def __post_init__(self) -> None:
        for name in ("layer_count", "expert_count", "lru_capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"BaselineConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"BaselineConfig.seed must be a non-negative int, got {self.seed!r}")


def ranked_scores(primary_BE: np.ndarray, fill_BE: np.ndarray) -> np.ndarray:
    """Tie-free scores ``E - rank``: by ``primary`` desc, then ``fill`` desc, then id asc."""
    B, E = primary_BE.shape
    ids_BE = np.broadcast_to(np.arange(E), (B, E))
    order_BE = np.lexsort((ids_BE, -np.broadcast_to(fill_BE, (B, E)), -primary_BE), axis=-1)
    scores_BE = np.empty((B, E))
    np.put_along_axis(scores_BE, order_BE, np.broadcast_to(E - np.arange(E, dtype=float),
                                                           (B, E)), axis=1)
    return scores_BE


def list_scores(candidates: Sequence[Sequence[int]], fill_BE: np.ndarray) -> np.ndarray:
    """Scores that put each row's (ranked, possibly short or empty) list first, then fill."""
    B, E = fill_BE.shape
    primary_BE = np.zeros((B, E))
    for b, ids in enumerate(candidates):
        n = len(ids)
        # Reversed so that a repeated id keeps its best (earliest) position.
        for j, expert in reversed(list(enumerate(ids))):
            primary_BE[b, expert] = n - j
    return ranked_scores(primary_BE, fill_BE)


class FrequencyTable:
    """Per-layer counts of native experts over ``train`` rows: the fill order of every
    baseline and the frequency control itself."""

    def __init__(self, config: BaselineConfig) -> None:
        self.config = config
        self.counts_LE = np.zeros((config.layer_count, config.expert_count))  # (L, E)
        self.rows = 0

    def fit(self, *, layer_B: Any, target_ids_BK: Any, split_B: str | Sequence[str]) -> None:
        """Count one batch of rows; every row must belong to ``train``."""
        targets_BK = as_numpy(target_ids_BK).astype(np.int64)
        check_train_rows(split_B, targets_BK.shape[0])
        layers_B = _layers(layer_B, targets_BK.shape[0], self.config.layer_count)
        _check_ids(targets_BK, self.config.expert_count)
        np.add.at(self.counts_LE, (np.repeat(layers_B, targets_BK.shape[1]),
                                   targets_BK.ravel()), 1.0)
        self.rows += targets_BK.shape[0]

    def fill(self, layer_B: np.ndarray) -> np.ndarray:
        """Fill keys ``(B, E)`` (higher first); all zero before any fit (id order)."""
        return self.counts_LE[layer_B]


def frequency_scores(table: FrequencyTable, layer_B: Any) -> np.ndarray:
    """The frequency control: each layer's most frequent training experts first."""
    if table.rows == 0:
        raise BaselineError("the frequency table is empty; fit it on train rows first")
    layers_B = _layers(layer_B, None, table.config.layer_count)
    return ranked_scores(table.fill(layers_B), np.zeros(table.config.expert_count))


class RandomBaseline:
    """A uniformly random ranking per row from a seeded generator (stream-deterministic)."""

    def __init__(self, config: BaselineConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)

    def scores(self, rows: int) -> np.ndarray:
        """``(rows, E)`` random tie-free scores."""
        return self._rng.permuted(np.tile(np.arange(1.0, self.config.expert_count + 1),
                                          (rows, 1)), axis=1)


class NativeGateBaseline:
    """The target's router of layer l applied to a representation available earlier.

    ``router_weight_LEH`` holds every routed layer's gate matrix. Without
    ``reduction_HD`` features must be full-width (H) hidden states; with it they are
    the capture plane's reduced features (``feature = hidden @ reduction_HD``, any D,
    including D == H) and are lifted with its pseudo-inverse. ``norm_weight_LH``
    optionally applies the RMSNorm gain that precedes the router, ``bias_LE`` the logit
    bias of routers whose linear has one (GPT-OSS). Without a bias the ``1/rms`` factor is
    dropped (a positive scale does not change a row's ranking); with one the scale
    decides how much the bias counts, so the hidden state is RMS-normalised as the
    router's input is.
    """

    def __init__(self, router_weight_LEH: Any, *, fill: FrequencyTable | None = None,
                 reduction_HD: Any = None, norm_weight_LH: Any = None,
                 bias_LE: Any = None) -> None:
        self.router_LEH = as_numpy(router_weight_LEH).astype(np.float64)
        if self.router_LEH.ndim != 3:
            raise BaselineError("router weights must be (L, E, H): one gate matrix per layer")
        L, _, H = self.router_LEH.shape
        self.fill = fill
        self.lift_DH = None if reduction_HD is None else np.linalg.pinv(
            _matrix(reduction_HD, H, "reduction_HD"))  # (D, H)
        self.norm_LH = None if norm_weight_LH is None else _matrix(norm_weight_LH, L,
                                                                   "norm_weight_LH")
        if self.norm_LH is not None and self.norm_LH.shape[1] != H:
            raise BaselineError(f"norm_weight_LH must be (L, {H}), got {self.norm_LH.shape}")
        self.bias_LE = None if bias_LE is None else _matrix(bias_LE, L, "bias_LE")
        if self.bias_LE is not None and self.bias_LE.shape[1] != self.router_LEH.shape[1]:
            raise BaselineError(f"bias_LE must be (L, {self.router_LEH.shape[1]}), got "
                                f"{self.bias_LE.shape}")

    def scores(self, feature_BX: Any, layer_B: Any) -> np.ndarray:
        """Router-of-``layer_B`` scores ``(B, E)`` of full-width or reduced features."""
        hidden_BH = self._hidden(as_numpy(feature_BX).astype(np.float64))  # (B, H)
        layers_B = _layers(layer_B, hidden_BH.shape[0], self.router_LEH.shape[0])
        if self.bias_LE is not None:
            hidden_BH = hidden_BH / np.sqrt((hidden_BH**2).mean(axis=1, keepdims=True) + 1e-6)
        if self.norm_LH is not None:
            hidden_BH = hidden_BH * self.norm_LH[layers_B]  # (B, H)
        logits_BE = np.empty((hidden_BH.shape[0], self.router_LEH.shape[1]))  # (B, E)
        for layer in np.unique(layers_B):  # one matmul per layer, no (B, E, H) gather
            rows = layers_B == layer
            logits_BE[rows] = hidden_BH[rows] @ self.router_LEH[layer].T
            if self.bias_LE is not None:
                logits_BE[rows] += self.bias_LE[layer]
        fill_BE = np.zeros_like(logits_BE) if self.fill is None else self.fill.fill(layers_B)
        return ranked_scores(logits_BE, fill_BE)

    def _hidden(self, feature_BX: np.ndarray) -> np.ndarray:
        # With a reduction the features ARE reduced, even when D happens to equal H.
        H = self.router_LEH.shape[2]
        width = self.lift_DH.shape[0] if self.lift_DH is not None else H
        if feature_BX.ndim == 2 and feature_BX.shape[1] == width:
            return feature_BX if self.lift_DH is None else feature_BX @ self.lift_DH  # (B, H)
        raise BatchError(
            f"feature has shape {feature_BX.shape}; the native gate needs full-width (B, {H}) "
            "hidden states, or reduced features plus the capture plane's reduction_HD"
        )


class HistoryBaselines:
    """Previous-token, adjacent-layer and LRU routes over each thread's committed history.

    :meth:`score_and_observe` scores every row from history alone, then records its
    native route. Rows are processed per thread in ``(ordinal, layer)`` order, so a row
    may use the same token's earlier layers from the same batch; each thread's rows
    must arrive in that order across batches (BatchError otherwise).
    """

    def __init__(self, config: BaselineConfig, *, fill: FrequencyTable | None = None) -> None:
        self.config = config
        self.fill = fill
        self._threads: dict[str, _ThreadHistory] = {}

    def score_and_observe(self, *, thread_B: Any, ordinal_B: Any, layer_B: Any,
                          target_ids_BK: Any) -> dict[str, np.ndarray]:
        """Scores ``(B, E)`` per method in :data:`HISTORY_METHODS`, rows in input order."""
        targets_BK = as_numpy(target_ids_BK).astype(np.int64)
        B = targets_BK.shape[0]
        _check_ids(targets_BK, self.config.expert_count)
        layers_B = _layers(layer_B, B, self.config.layer_count)
        ordinals_B = as_numpy(ordinal_B).astype(np.int64).reshape(B)
        threads_B = np.array([str(t) for t in as_numpy(thread_B).reshape(B).tolist()])
        lists: dict[str, list[list[int]]] = {m: [[] for _ in range(B)] for m in HISTORY_METHODS}
        for i in np.lexsort((layers_B, ordinals_B, threads_B)):
            history = self._threads.setdefault(threads_B[i], _ThreadHistory(self.config))
            found = history.lookup(int(ordinals_B[i]), int(layers_B[i]))
            for method, ids in zip(HISTORY_METHODS, found, strict=True):
                lists[method][i] = ids
            history.observe(int(ordinals_B[i]), int(layers_B[i]), targets_BK[i].tolist())
        fill_BE = (np.zeros((B, self.config.expert_count)) if self.fill is None
                   else self.fill.fill(layers_B))
        return {method: list_scores(lists[method], fill_BE) for method in HISTORY_METHODS}


class _ThreadHistory:
    """One thread's latest route per layer and per-layer LRU lists."""

    def __init__(self, config: BaselineConfig) -> None:
        self.capacity = config.lru_capacity
        self.last: tuple[int, int] = (-1, -1)
        self.routes: dict[int, tuple[int, list[int]]] = {}
        self.lru: dict[int, OrderedDict[int, None]] = {}

    def lookup(self, ordinal: int, layer: int) -> tuple[list[int], list[int], list[int]]:
        """(previous token same layer, same token previous layer, LRU most recent first)."""
        if (ordinal, layer) <= self.last:
            raise BatchError(
                f"row (ordinal {ordinal}, layer {layer}) arrived after {self.last}; history "
                "baselines need each thread's rows in (ordinal, layer) order"
            )
        same_layer = self.routes.get(layer)
        previous = same_layer[1] if same_layer and same_layer[0] == ordinal - 1 else []
        below = self.routes.get(layer - 1)
        adjacent = below[1] if below and below[0] == ordinal else []
        recent = list(reversed(self.lru.get(layer, OrderedDict())))
        return previous, adjacent, recent

    def observe(self, ordinal: int, layer: int, route: list[int]) -> None:
        """Record the native route (rank order) of ``(ordinal, layer)``."""
        self.last = (ordinal, layer)
        self.routes[layer] = (ordinal, route)
        lru = self.lru.setdefault(layer, OrderedDict())
        for expert in reversed(route):  # rank 0 becomes the most recent
            lru[expert] = None
            lru.move_to_end(expert)
        while len(lru) > self.capacity:
            lru.popitem(last=False)


def _layers(layer_B: Any, rows: int | None, layer_count: int) -> np.ndarray:
    layers = as_numpy(layer_B)
    if layers.ndim != 1 or (rows is not None and layers.shape[0] != rows):
        raise BatchError(f"layer has shape {layers.shape}, expected ({rows},)")
    if not np.issubdtype(layers.dtype, np.integer) or (
            layers.size and (layers.min() < 0 or layers.max() >= layer_count)):
        raise BatchError(f"layer ids must be integers in [0, {layer_count})")
    return layers.astype(np.int64)


def _check_ids(targets_BK: np.ndarray, expert_count: int) -> None:
    if targets_BK.ndim != 2 or (targets_BK.size and (
            targets_BK.min() < 0 or targets_BK.max() >= expert_count)):
        raise BatchError(f"target ids must be (B, K) integers in [0, {expert_count})")


def _matrix(value: Any, rows: int, name: str) -> np.ndarray:
    matrix = as_numpy(value).astype(np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != rows:
        raise BaselineError(f"{name} must be a ({rows}, N) matrix, got shape {matrix.shape}")
    return matrix
