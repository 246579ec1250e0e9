"""The trainer's configuration: keyword-only dataclasses, loadable from TOML.

A TOML file mirrors :class:`TrainConfig`; every section and key is optional and
unknown keys are refused (with the known ones listed)::

    seed = 0
    method = "sidecar"

    [model]                 # ModelOptions (geometry D, L, E comes from the snapshot)
    offsets = [[0, 0], [0, 1]]   # the P1 near-term head: layers l and l+1
    rank = 64

    [loss]                  # train.losses.LossConfig
    order_weight = 0.5
    [loss.acceptance]       # train.losses.WeightSchedule
    kind = "exponential"

    [data]                  # DataOptions
    batch_size = 4096
    [optim]                 # OptimConfig
    lr = 3e-3
    [schedule]              # ScheduleConfig
    eval_every = 100

:func:`config_to_dict` / :func:`config_from_dict` round-trip a config through plain
JSON types (how checkpoints record it).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hebrus_flywheel.core.configfile import read_toml
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.losses import LossConfig
from hebrus_flywheel.train.metrics import EVALUATION_SPLITS, TRAIN_SPLIT

CONTROL_NAMES: tuple[str, ...] = ("random", "frequency", "lru", "previous_token",
                                  "adjacent_layer", "native_gate")
"""Method names the evaluation gives the training-free controls."""


MODEL_ARCHITECTURES: tuple[str, ...] = ("sidecar", "per_layer_mlp", "shared_lowrank",
                                        "gate_adapter")
"""``ModelOptions.architecture`` values (the last three: :data:`train.predictors.ARCHITECTURES`)."""


def _positive(owner: str, names: tuple[str, ...], obj: Any) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """The model's architecture, capacity and heads; D, L and E are read from the snapshot."""

    architecture: str = "sidecar"
    """``sidecar``: the shared low-rank route sidecar (:class:`train.models.RouteSidecar`);
    or a predictor of the ablation (:mod:`train.predictor_model`): ``per_layer_mlp``
    (two linear layers per source layer), ``shared_lowrank`` or ``gate_adapter`` (the
    latter two and a gate prior need the teacher: ``flywheel train --teacher``)."""
    gate_prior: bool = False
    """Predictors only: add the target layer's native-gate logits, scaled per layer, and
    learn the residual (needs the teacher's routers)."""

    offsets: tuple[tuple[int, int], ...] = ((0, 0),)
    """``(dposition, dlayer)`` targets of one feature. Clean-path snapshots hold the same
    token's routes, so ``dposition`` must be 0: ``[[0, 0]]`` (own layer) or
    ``[[0, 0], [0, 1]]`` (P1). Evaluation scores the ``(0, 0)`` head."""
    rank: int = 64
    """R: low-rank trunk and expert-embedding width; for predictors, their width (MLP
    width of ``per_layer_mlp``, low-rank width of ``shared_lowrank``)."""
    hidden: int = 256
    """H: conditioning-MLP width (sidecar only)."""
    dropout: float = 0.0
    """Dropout inside the conditioning MLP, in [0, 1) (sidecar only)."""
    layer_expert_bias: bool = True
    """Learn a per-(layer, expert) popularity bias (sidecar only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(tuple(o) for o in self.offsets))
        _positive("ModelOptions", ("rank", "hidden"), self)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"ModelOptions.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.offsets or any(len(o) != 2 or o[0] != 0 or o[1] < 0 for o in self.offsets):
            raise ConfigError(
                f"ModelOptions.offsets {self.offsets!r}: a clean-path snapshot has targets for "
                "the same token only; use [[0, 0]] or [[0, 0], [0, 1]] (dposition 0, dlayer >= 0)")
        if (0, 0) not in self.offsets:
            raise ConfigError("ModelOptions.offsets must include [0, 0]: evaluation and "
                              "validation score the feature's own layer")
        if self.architecture not in MODEL_ARCHITECTURES:
            raise ConfigError(f"ModelOptions.architecture must be one of "
                              f"{MODEL_ARCHITECTURES}, got {self.architecture!r}")
        if self.gate_prior and self.architecture not in ("per_layer_mlp", "shared_lowrank"):
            raise ConfigError("ModelOptions.gate_prior applies to per_layer_mlp and "
                              f"shared_lowrank only, not {self.architecture!r}")
        if self.architecture != "sidecar" and any(o[1] > 1 for o in self.offsets):
            raise ConfigError(f"ModelOptions.offsets {self.offsets!r}: predictors have an own-"
                              "layer head and at most the P1 head [0, 1]")

    @property
    def needs_teacher(self) -> bool:
        """Whether the model reads the teacher's routers (gate prior or gate adapter)."""
        return self.gate_prior or self.architecture == "gate_adapter"


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """Which splits feed training and validation, and how they are streamed."""

    train_split: str = TRAIN_SPLIT
    """The split optimised on; must be ``train``."""
    validation_split: str = "validation"
    """The split of periodic validation and early stopping; never ``train``."""
    batch_size: int = 4096
    """(token, layer) rows per optimiser step and rank."""
    shuffle_buffer: int = 65536
    """(token, layer) rows mixed before batches are cut."""
    num_workers: int = 1
    """DataLoader worker processes per rank (0 reads in the training process)."""
    verify: Literal["lazy", "full"] = "lazy"
    """``lazy``: manifest at open, each shard's SHA-256 before its first read; ``full``:
    every shard at open (``flywheel verify``)."""

    def __post_init__(self) -> None:
        if self.train_split != TRAIN_SPLIT:
            raise ConfigError(f"DataOptions.train_split must be {TRAIN_SPLIT!r}: only training "
                              f"rows may be optimised on, got {self.train_split!r}")
        if self.validation_split not in EVALUATION_SPLITS:
            raise ConfigError(f"DataOptions.validation_split must be one of "
                              f"{', '.join(EVALUATION_SPLITS)}, got {self.validation_split!r}")
        _positive("DataOptions", ("batch_size", "shuffle_buffer"), self)
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or (
                self.num_workers < 0):
            raise ConfigError(f"DataOptions.num_workers must be >= 0, got {self.num_workers!r}")
        if self.verify not in ("lazy", "full"):
            raise ConfigError(f"DataOptions.verify must be lazy or full, got {self.verify!r}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay (per optimiser step)."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at ``max_steps`` after cosine decay."""
    warmup_steps: int = 20
    """Linear warm-up steps from 0 to ``lr``."""
    max_steps: int = 1000
    """Optimiser steps at most (early stopping may end sooner)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay on matrices (not on norms, biases, embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 turns clipping off."""

    def __post_init__(self) -> None:
        _positive("OptimConfig", ("max_steps",), self)
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ConfigError("OptimConfig.lr must be > 0 and OptimConfig.min_lr in [0, lr]")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("OptimConfig.warmup_steps, .weight_decay and .grad_clip must be "
                              ">= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError("OptimConfig.beta1 and .beta2 must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Validation cadence, early stopping and logging."""

    eval_every: int = 100
    """Validate every this many steps (and after the last step)."""
    eval_max_batches: int = 0
    """Validation batches per rank and evaluation; 0 reads the whole split."""
    monitor: Literal["recall", "loss"] = "recall"
    """Early-stopping metric: validation recall@K (higher is better) or loss (lower)."""
    patience: int = 5
    """Stop after this many validations without improvement; 0 never stops early."""
    min_delta: float = 1e-4
    """Smallest change of the monitored metric that counts as an improvement."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""

    def __post_init__(self) -> None:
        _positive("ScheduleConfig", ("eval_every",), self)
        if self.eval_max_batches < 0 or self.patience < 0 or self.min_delta < 0:
            raise ConfigError("ScheduleConfig.eval_max_batches, .patience and .min_delta must "
                              "be >= 0")
        if self.monitor not in ("recall", "loss"):
            raise ConfigError(f"ScheduleConfig.monitor must be recall or loss, got "
                              f"{self.monitor!r}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one training run is a function of, besides the snapshot."""

    seed: int = 0
    """Seed of the model initialisation and of the data order."""
    method: str = "sidecar"
    """Name of the learned method in evaluation tables and qualification."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    threads: int = 0
    """torch intra-op threads per rank; 0 keeps torch's default (torchrun sets 1)."""
    model: ModelOptions = field(default_factory=ModelOptions)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"TrainConfig.seed must be an integer >= 0, got {self.seed!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or (
                self.threads < 0):
            raise ConfigError(f"TrainConfig.threads must be an integer >= 0, got {self.threads!r}")
        if not self.method or not self.method.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"TrainConfig.method must be a plain name, got {self.method!r}")
        if self.method in CONTROL_NAMES:
            raise ConfigError(f"TrainConfig.method {self.method!r} is the name of a "
                              "training-free control; name the learned method differently")


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def _check_scalar(hint: Any, value: Any, where: str) -> None:
    if typing.get_origin(hint) is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where} must be one of {typing.get_args(hint)}, got {value!r}")
        return
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return
    expected = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}.get(hint)
    bad_bool = hint in (int, float) and isinstance(value, bool)
    if expected is not None and (bad_bool or not isinstance(value, expected)):
        raise ConfigError(f"{where} must be a {hint.__name__}, got {value!r}")


def from_mapping(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from a mapping, recursing into dataclass-typed fields."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a table of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys: {', '.join(known)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = from_mapping(hint, value, f"{where}.{name}")  # type: ignore[arg-type]
        else:
            _check_scalar(hint, value, f"{where}.{name}")
            kwargs[name] = _tuples(value)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_config(path: Path | None) -> TrainConfig:
    """The defaults, overridden by a TOML file when ``path`` is given."""
    if path is None:
        return TrainConfig()
    return from_mapping(TrainConfig, read_toml(path), str(path))


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain JSON types (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Inverse of :func:`config_to_dict`."""
    return from_mapping(TrainConfig, data, "config")
