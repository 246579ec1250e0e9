"""Thresholds of the qualification gates and falsifiers.

Every bound here is a *declared* policy, not a measurement: the report prints the
configuration it was judged against, so a reader can see what "pass" meant. Defaults
are illustrative starting points for a small controlled run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.metrics import EVALUATION_SPLITS

CONTROL_METHODS: tuple[str, ...] = (
    "random", "frequency", "lru", "previous_token", "adjacent_layer", "native_gate",
)
"""The training-free controls of Gate 3, in the design note's order."""

HEURISTIC_METHODS: tuple[str, ...] = ("previous_token", "adjacent_layer")
"""The history heuristics named by falsifier #2."""


def _number(owner: str, name: str, value: Any, *, low: float, high: float | None,
            optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and value >= low and (high is None or value <= high)
    if not ok:
        upper = "" if high is None else f" and <= {high}"
        none = " (or None)" if optional else ""
        raise ConfigError(f"{owner}.{name} must be a finite number >= {low}{upper}{none}, "
                          f"got {value!r}")


def _flag(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be True or False, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ReplayGateConfig:
    """Gate 1 (replay correctness)."""

    require_rebuild: bool = True
    """A rebuild whose digest equals the snapshot's is needed to pass; False records
    determinism as not measured without blocking the gate."""
    max_quarantine_fraction: float | None = None
    """Fail when more than this fraction of the records seen was quarantined (a
    systemic capture problem); None reports the fraction without bounding it."""

    def __post_init__(self) -> None:
        _flag("ReplayGateConfig", "require_rebuild", self.require_rebuild)
        _number("ReplayGateConfig", "max_quarantine_fraction", self.max_quarantine_fraction,
                low=0.0, high=1.0, optional=True)


@dataclass(frozen=True, kw_only=True)
class IntegrityGateConfig:
    """Gate 2 (data integrity and leakage)."""

    allow_owner_overlap: bool = False
    """Accept an owner present in two splits (threads may never be shared)."""
    owner_disjoint_pairs: tuple[tuple[str, str], ...] = (("train", "validation"),)
    """Split pairs that may not share an owner. The split policy puts owners, stickily,
    in train or validation; holdouts are chosen per thread (a newer or stress-tagged
    thread of a train owner is the point of a temporal or stress holdout), so owners
    shared with a holdout are reported but allowed."""
    coverage_dimensions: tuple[str, ...] = ("domain", "language", "prompt_length", "tool_calls")
    """Coverage dimensions every split should report; a missing one is listed as not
    measured (it does not block the gate)."""
    require_authorization: bool = True
    """Block the gate (not measurable) when the snapshot has no consent measurement (a
    manifest sealed before the consent ledger)."""

    def __post_init__(self) -> None:
        _flag("IntegrityGateConfig", "allow_owner_overlap", self.allow_owner_overlap)
        _flag("IntegrityGateConfig", "require_authorization", self.require_authorization)
        if not isinstance(self.owner_disjoint_pairs, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)
                for p in self.owner_disjoint_pairs):
            raise ConfigError("IntegrityGateConfig.owner_disjoint_pairs must be a tuple of "
                              f"(split, split) pairs, got {self.owner_disjoint_pairs!r}")
        if not isinstance(self.coverage_dimensions, tuple) or not all(
                isinstance(d, str) and d for d in self.coverage_dimensions):
            raise ConfigError("IntegrityGateConfig.coverage_dimensions must be a tuple of "
                              f"non-empty names, got {self.coverage_dimensions!r}")


@dataclass(frozen=True, kw_only=True)
class OfflineGateConfig:
    """Gate 3 (offline predictor value at equal candidate count and byte budget)."""

    budget: int | None = None
    """Candidates per (token, layer) at which the decision is made; the byte budget is
    ``budget * expert_bytes``. None: the native top-k."""
    margin: float = 0.02
    """Least absolute recall@budget by which the candidate must beat the strongest
    training-free control on every decision split."""
    decision_splits: tuple[str, ...] = ("validation",)
    """Evaluation splits the decision is made on (never ``train``); every one is required."""
    required_controls: tuple[str, ...] = ("random", "frequency", "previous_token",
                                          "adjacent_layer")
    """Controls that must be present for the comparison to count."""
    max_ece: float | None = None
    """Fail when the candidate's expected calibration error on a decision split exceeds
    this; None reports calibration without bounding it."""

    def __post_init__(self) -> None:
        owner = "OfflineGateConfig"
        if self.budget is not None and (isinstance(self.budget, bool)
                                        or not isinstance(self.budget, int) or self.budget < 1):
            raise ConfigError(f"{owner}.budget must be a positive integer or None, "
                              f"got {self.budget!r}")
        _number(owner, "margin", self.margin, low=0.0, high=1.0)
        _number(owner, "max_ece", self.max_ece, low=0.0, high=1.0, optional=True)
        if not self.decision_splits or set(self.decision_splits) - set(EVALUATION_SPLITS):
            raise ConfigError(f"{owner}.decision_splits must name evaluation splits among "
                              f"{', '.join(EVALUATION_SPLITS)}, got {self.decision_splits!r}")
        if set(self.required_controls) - set(CONTROL_METHODS):
            raise ConfigError(f"{owner}.required_controls must be among "
                              f"{', '.join(CONTROL_METHODS)}, got {self.required_controls!r}")


@dataclass(frozen=True, kw_only=True)
class DecodeGateConfig:
    """Gate 4 (replay-validation vs real-decode vs timely recall)."""

    max_recall_gap: float = 0.05
    """Largest accepted drop from replay-validation recall to real-decode recall."""
    min_timely_recall: float = 0.5
    """Least real-decode timely recall (the decisive number)."""
    max_timely_gap: float | None = None
    """Largest accepted drop from real-decode recall to timely recall; None: report only."""

    def __post_init__(self) -> None:
        _number("DecodeGateConfig", "max_recall_gap", self.max_recall_gap, low=0.0, high=1.0)
        _number("DecodeGateConfig", "min_timely_recall", self.min_timely_recall,
                low=0.0, high=1.0)
        _number("DecodeGateConfig", "max_timely_gap", self.max_timely_gap, low=0.0, high=1.0,
                optional=True)


@dataclass(frozen=True, kw_only=True)
class ShadowGateConfig:
    """Gate 5 (shadow I/O): bounds on what the predictions cost the device."""

    min_useful_prefetch_ratio: float = 0.5
    """Least predicted bytes consumed / predicted bytes read."""
    max_byte_amplification_ratio: float = 1.5
    """Most physical bytes read with predictions / without them (same trace, config)."""
    max_pollution_miss_fraction: float | None = 0.01
    """Most exact misses caused by prefetch evictions (misses the no-prediction run
    served from its cache), as a fraction of exact demands."""
    max_p0_starvation_per_token: float | None = None
    """Most P0 starvation attempts per accepted token; None: report only."""
    require_misses_avoided: bool = True
    """Fail unless the predictions avoid at least one exact miss."""

    def __post_init__(self) -> None:
        owner = "ShadowGateConfig"
        _number(owner, "min_useful_prefetch_ratio", self.min_useful_prefetch_ratio,
                low=0.0, high=1.0)
        _number(owner, "max_byte_amplification_ratio", self.max_byte_amplification_ratio,
                low=1.0, high=None)
        _number(owner, "max_pollution_miss_fraction", self.max_pollution_miss_fraction,
                low=0.0, high=1.0, optional=True)
        _number(owner, "max_p0_starvation_per_token", self.max_p0_starvation_per_token,
                low=0.0, high=None, optional=True)
        _flag(owner, "require_misses_avoided", self.require_misses_avoided)


@dataclass(frozen=True, kw_only=True)
class FalsifierConfig:
    """Thresholds that turn the ten falsifiers into verdicts."""

    match_tolerance: float = 0.01
    """#2: a heuristic "matches" the candidate when its recall is within this of it."""
    useful_timely_recall: float = 0.5
    """#4: the timely recall a budget must reach to count as useful."""
    max_byte_amplification_ratio: float = 1.5
    """#4: the byte amplification (with / without predictions) that counts as rising."""
    meaningful_wait_reduction: float = 0.1
    """#5: the least fraction of exposed SSD wait the predictions must hide."""
    min_temporal_advantage: float = 0.0
    """#7: the least recall advantage over the best control on ``temporal_holdout``."""
    min_oracle_hidden_fraction: float = 0.5
    """#9: the least hidden fraction a perfect predictor must reach."""
    min_token_accuracy: float = 0.3
    """#3: the drafter's next-token accuracy from which it "predicts tokens"."""

    def __post_init__(self) -> None:
        for name in ("match_tolerance", "useful_timely_recall", "meaningful_wait_reduction",
                     "min_oracle_hidden_fraction", "min_token_accuracy"):
            _number("FalsifierConfig", name, getattr(self, name), low=0.0, high=1.0)
        _number("FalsifierConfig", "max_byte_amplification_ratio",
                self.max_byte_amplification_ratio, low=1.0, high=None)
        _number("FalsifierConfig", "min_temporal_advantage", self.min_temporal_advantage,
                low=-1.0, high=1.0)


@dataclass(frozen=True, kw_only=True)
class QualificationConfig:
    """Every threshold of one qualification run (the service objective is declared
    separately, in :class:`train.qualify.objective.ServiceObjective`)."""

    replay: ReplayGateConfig = field(default_factory=ReplayGateConfig)
    """Gate 1."""
    integrity: IntegrityGateConfig = field(default_factory=IntegrityGateConfig)
    """Gate 2."""
    offline: OfflineGateConfig = field(default_factory=OfflineGateConfig)
    """Gate 3."""
    decode: DecodeGateConfig = field(default_factory=DecodeGateConfig)
    """Gate 4."""
    shadow: ShadowGateConfig = field(default_factory=ShadowGateConfig)
    """Gate 5."""
    falsifiers: FalsifierConfig = field(default_factory=FalsifierConfig)
    """The ten falsifiers."""

    def __post_init__(self) -> None:
        expected = {"replay": ReplayGateConfig, "integrity": IntegrityGateConfig,
                    "offline": OfflineGateConfig, "decode": DecodeGateConfig,
                    "shadow": ShadowGateConfig, "falsifiers": FalsifierConfig}
        for name, kind in expected.items():
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"QualificationConfig.{name} must be a {kind.__name__}")
