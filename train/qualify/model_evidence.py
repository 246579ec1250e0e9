"""Evidence about the predictor: offline metrics (Gate 3), decode recall (Gate 4),
shadow I/O (Gates 5–6), runtime measurements, loader throughput and replay economics."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hebrus_flywheel.train.metrics import EVALUATION_SPLITS, RESULT_SCHEMA, TRAIN_SPLIT
from hebrus_flywheel.train.qualify import checks as v
from hebrus_flywheel.train.qualify.config import CONTROL_METHODS
from hebrus_flywheel.train.qualify.errors import InputError

SHADOW_KEYS: tuple[str, ...] = (
    "accepted_tokens", "expert_bytes", "demands", "timely_recall", "recall",
    "useful_prefetch_ratio", "physical_bytes_read", "predicted_bytes_read", "useful_bytes",
    "exposed_wait_s",
)
"""Keys every :func:`train.sim.shadow_io` result has and the gates rely on."""


def _check_result(index: int, result: Any) -> str:
    where = f"offline.results[{index}]"
    v.mapping(where, result)
    if result.get("schema") != RESULT_SCHEMA:
        raise InputError(f"{where}.schema is {result.get('schema')!r}, expected "
                         f"{RESULT_SCHEMA!r}; pass MetricsAccumulator.result() unchanged")
    v.text(f"{where}.method", result.get("method"))
    config = result.get("config")
    v.mapping(f"{where}.config", config)
    for key in ("expert_count", "top_k", "budgets"):
        if key not in config:
            raise InputError(f"{where}.config lacks {key!r}; pass MetricsAccumulator.result()")
    splits = result.get("splits")
    v.mapping(f"{where}.splits", splits)
    if TRAIN_SPLIT in splits:
        raise InputError(f"{where} ({result['method']}) holds metrics of the train split; "
                         "qualification never judges on training rows: evaluate only "
                         f"{', '.join(EVALUATION_SPLITS)}")
    unknown = set(splits) - set(EVALUATION_SPLITS)
    if unknown:
        raise InputError(f"{where} has unknown split(s) {sorted(unknown)}")
    return str(result["method"])


@dataclass(frozen=True, kw_only=True)
class OfflineEvidence:
    """Per-method route metrics on evaluation splits (one
    :meth:`~train.metrics.MetricsAccumulator.result` per method)."""

    results: tuple[dict[str, Any], ...]
    """Controls (random, frequency, lru, previous_token, adjacent_layer, native_gate)
    and learned predictors, all with the same geometry and budgets."""
    candidate: str
    """The method name of the checkpoint being qualified."""
    features: dict[str, str] = field(default_factory=dict)
    """Learned method -> the feature it reads (``pre_attention``, ``dflash``, ...)."""

    def __post_init__(self) -> None:
        v.freeze(self, "results", tuple)
        if not isinstance(self.results, tuple) or not self.results:
            raise InputError("offline.results must list at least one metrics result")
        methods = [_check_result(i, r) for i, r in enumerate(self.results)]
        if len(set(methods)) != len(methods):
            raise InputError(f"offline.results repeats a method: {methods}")
        shapes = {(r["config"]["expert_count"], r["config"]["top_k"]) for r in self.results}
        if len(shapes) != 1:
            raise InputError("offline.results disagree on (expert_count, top_k): "
                             f"{sorted(shapes)}; evaluate every method with one MetricsConfig")
        v.text("offline.candidate", self.candidate)
        if self.candidate not in methods:
            raise InputError(f"offline.candidate {self.candidate!r} has no result among "
                             f"{methods}")
        if self.candidate in CONTROL_METHODS:
            raise InputError(f"offline.candidate {self.candidate!r} is a training-free "
                             "control; name the learned checkpoint's method")
        v.mapping("offline.features", self.features)
        stray = set(self.features) - set(self.learned)
        if stray:
            raise InputError(f"offline.features names {sorted(stray)}, which are not learned "
                             "methods with a result")

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(str(r["method"]) for r in self.results)

    @property
    def controls(self) -> tuple[str, ...]:
        """Training-free controls present, in the design note's order."""
        return tuple(m for m in CONTROL_METHODS if m in self.methods)

    @property
    def learned(self) -> tuple[str, ...]:
        return tuple(m for m in self.methods if m not in CONTROL_METHODS)

    @property
    def expert_count(self) -> int:
        return int(self.results[0]["config"]["expert_count"])

    @property
    def top_k(self) -> int:
        return int(self.results[0]["config"]["top_k"])

    @property
    def common_budgets(self) -> tuple[int, ...]:
        """Budgets every method was measured at (equal candidate counts)."""
        sets = [set(int(b) for b in r["config"]["budgets"]) for r in self.results]
        return tuple(sorted(set.intersection(*sets)))

    def result(self, method: str) -> dict[str, Any]:
        if method not in self.methods:
            raise InputError(f"no offline result for method {method!r}; have {self.methods}")
        return self.results[self.methods.index(method)]

    def summary(self, method: str, split: str, dim: str = "overall",
                label: str | None = None) -> dict[str, Any] | None:
        """The summary node of ``method`` on ``split`` (overall, or one layer/domain);
        None when the method, split or group was not evaluated."""
        if method not in self.methods:
            return None
        node = self.result(method)["splits"].get(split)
        if node is None:
            return None
        return node.get("overall") if dim == "overall" else node.get(dim, {}).get(label)

    def recall(self, method: str, split: str, budget: int, dim: str = "overall",
               label: str | None = None) -> float | None:
        node = self.summary(method, split, dim, label)
        value = None if node is None else node.get("recall", {}).get(str(budget))
        return None if value is None else float(value)

    def rows(self, method: str, split: str) -> int | None:
        node = self.summary(method, split)
        return None if node is None else int(node.get("rows", 0))

    def check_geometry(self, experts: int, top_k: int) -> None:
        if (self.expert_count, self.top_k) != (experts, top_k):
            raise InputError(f"offline results were computed with E={self.expert_count}, "
                             f"K={self.top_k} but the geometry says E={experts}, K={top_k}")


@dataclass(frozen=True, kw_only=True)
class DecodeEvidence:
    """The candidate's recall on replay validation, on real decode, and timely (Gate 4)."""

    budget: int
    """Candidates per (token, layer) all three recalls were measured at."""
    replay_validation_recall: float | None = None
    """recall@budget on the replayed ``validation`` split."""
    real_decode_recall: float | None = None
    """recall@budget on ``runtime_holdout`` real decode captures."""
    timely_recall: float | None = None
    """Simulated timely recall of the same predictions on those captures."""
    real_decode_rows: int | None = None
    """(token, layer) rows behind the real-decode recall."""
    captures_regenerated: bool = False
    """True if the runtime-holdout labels were regenerated by replay (not allowed)."""

    def __post_init__(self) -> None:
        v.count("decode.budget", self.budget, positive=True)
        for name in ("replay_validation_recall", "real_decode_recall", "timely_recall"):
            v.number(f"decode.{name}", getattr(self, name), optional=True, high=1.0)
        v.count("decode.real_decode_rows", self.real_decode_rows, optional=True)
        v.flag("decode.captures_regenerated", self.captures_regenerated)

    @classmethod
    def from_offline(cls, offline: OfflineEvidence, *, budget: int,
                     timely_recall: float | None) -> DecodeEvidence:
        """The candidate's recalls on ``validation`` and ``runtime_holdout`` at ``budget``,
        with the simulator's timely recall of the same predictions."""
        c = offline.candidate
        return cls(budget=budget,
                   replay_validation_recall=offline.recall(c, "validation", budget),
                   real_decode_recall=offline.recall(c, "runtime_holdout", budget),
                   timely_recall=timely_recall,
                   real_decode_rows=offline.rows(c, "runtime_holdout"))


def _check_metrics(where: str, metrics: Any, required: tuple[str, ...]) -> None:
    v.mapping(where, metrics)
    missing = [k for k in required if k not in metrics]
    if missing:
        raise InputError(f"{where} lacks {missing}; pass train.sim.shadow_io(...) unchanged")
    for key, value in metrics.items():
        if value is not None and not isinstance(value, bool | int | float):
            raise InputError(f"{where}[{key}] must be a number, true/false or null")


@dataclass(frozen=True, kw_only=True)
class ShadowEvidence:
    """The simulator's shadow run of the candidate's predictions on real decode traces."""

    metrics: dict[str, Any]
    """:func:`train.sim.shadow_io` of the candidate at the declared configuration."""
    budget: int | None = None
    """Candidate budget of those predictions (None: every candidate)."""
    sim_config: dict[str, Any] = field(default_factory=dict)
    """``dataclasses.asdict(SimConfig)`` of the run, reported verbatim."""
    sweep: tuple[dict[str, Any], ...] = ()
    """:func:`train.sim.sweep` rows over SSD bandwidth and candidate budget."""
    break_even: tuple[dict[str, Any], ...] = ()
    """:func:`train.sim.break_even` rows."""
    oracle: dict[str, Any] | None = None
    """:func:`train.sim.shadow_io` of a perfect predictor on the same trace and config."""
    controls: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Shadow runs of control predictors (e.g. ``previous_token``), by method."""

    def __post_init__(self) -> None:
        v.freeze(self, "sweep", tuple)
        v.freeze(self, "break_even", tuple)
        _check_metrics("shadow_io.metrics", self.metrics, SHADOW_KEYS)
        v.count("shadow_io.budget", self.budget, optional=True, positive=True)
        v.mapping("shadow_io.sim_config", self.sim_config)
        for i, row in enumerate(self.sweep):
            _check_metrics(f"shadow_io.sweep[{i}]", row,
                           ("ssd_bandwidth_bytes_per_s", "candidate_budget", *SHADOW_KEYS))
        for i, row in enumerate(self.break_even):
            _check_metrics(f"shadow_io.break_even[{i}]", row, ("block_size", "tau", "holds"))
        if self.oracle is not None:
            _check_metrics("shadow_io.oracle", self.oracle, SHADOW_KEYS)
        v.mapping("shadow_io.controls", self.controls)
        for name, metrics in self.controls.items():
            _check_metrics(f"shadow_io.controls[{name}]", metrics, SHADOW_KEYS)

    def check_expert_bytes(self, expert_bytes: int) -> None:
        runs: list[tuple[str, Mapping[str, Any]]] = [("metrics", self.metrics)]
        runs += [(f"sweep[{i}]", row) for i, row in enumerate(self.sweep)]
        runs += [] if self.oracle is None else [("oracle", self.oracle)]
        for where, metrics in runs:
            if metrics["expert_bytes"] != expert_bytes:
                raise InputError(f"shadow_io.{where} was simulated with expert_bytes "
                                 f"{metrics['expert_bytes']} but the run declares "
                                 f"{expert_bytes}; simulate with the snapshot's geometry")


@dataclass(frozen=True, kw_only=True)
class RuntimeEvidence:
    """Measurements on the real runtime (shadow or canary), for an objective that asks
    for runtime evidence. Metric names follow :func:`train.sim.summarize`."""

    metrics: dict[str, Any]
    """e.g. ``exposed_wait_reduction``, ``exposed_wait_step_p95_s`` and its
    ``baseline_`` counterpart, ``tokens_per_s`` and ``baseline_tokens_per_s``."""
    output_preserved: bool | None = None
    """Whether the target output was bit-identical with and without predictions."""
    device: str | None = None
    """Where it was measured."""

    def __post_init__(self) -> None:
        _check_metrics("runtime.metrics", self.metrics, ())
        v.flag("runtime.output_preserved", self.output_preserved, optional=True)
        v.text("runtime.device", self.device, optional=True)


@dataclass(frozen=True, kw_only=True)
class ThroughputEvidence:
    """Feature-loader versus trainer throughput (falsifier #10)."""

    loader_examples_per_s: float | None = None
    """Examples per second the shard reader delivers."""
    trainer_examples_per_s: float | None = None
    """Examples per second the trainer consumes when fed from memory."""
    data_wait_s: float | None = None
    """Trainer wall time spent waiting for batches in a measured run."""
    compute_s: float | None = None
    """Trainer wall time spent computing in that run."""
    device: str | None = None
    """Where it was measured (the design note's question is about two RTX 3090s)."""

    def __post_init__(self) -> None:
        for name in ("loader_examples_per_s", "trainer_examples_per_s", "data_wait_s",
                     "compute_s"):
            v.number(f"throughput.{name}", getattr(self, name), optional=True)
        v.text("throughput.device", self.device, optional=True)


@dataclass(frozen=True, kw_only=True)
class EconomicsEvidence:
    """Candidate-path replay cost against expected deployment savings (falsifier #6)."""

    deployment_tokens: float
    """Output tokens the checkpoint is expected to serve before it is replaced."""
    candidate_replay_cost_s: float | None = None
    """Device seconds spent on candidate-path replay for this checkpoint; None: only the
    cost measured on a candidate-path snapshot counts (``--candidate-replay-cost``)."""
    saving_s_per_token: float | None = None
    """Expected saving per output token; None: the shadow run's exposed-wait saving."""

    def __post_init__(self) -> None:
        v.number("economics.candidate_replay_cost_s", self.candidate_replay_cost_s,
                 optional=True)
        v.number("economics.deployment_tokens", self.deployment_tokens)
        v.number("economics.saving_s_per_token", self.saving_s_per_token, optional=True,
                 low=None)
