"""The declared service objective of Gate 6 (end-to-end promotion).

Promotion is judged against a :class:`ServiceObjective` the operator states up front;
nothing is assumed. Every stated target must be met, p95/p99 per-step exposed wait may
regress only within the stated bounds, and exact target output must be preserved. A
figure that is missing makes its check ``not_measurable``, so the gate cannot pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.qualify.verdict import Check, judged, unmeasured

EVIDENCE_SOURCES: tuple[str, ...] = ("simulator", "runtime")


def _bounded(name: str, value: Any, *, optional: bool, high: float | None) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and value >= 0.0 and (high is None or value <= high)):
        raise ConfigError(f"ServiceObjective.{name} must be a finite number >= 0"
                          f"{'' if high is None else f' and <= {high}'}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ServiceObjective:
    """What promotion must achieve. At least one improvement target is required."""

    name: str
    """A short name for the objective, printed in the report."""
    min_exposed_wait_reduction: float | None = None
    """Least fraction of the no-prediction exposed I/O wait the predictions must remove."""
    min_throughput_gain: float | None = None
    """Least fractional gain in output tokens per second over no prediction."""
    max_p95_regression: float = 0.0
    """Largest fractional rise of the p95 per-step exposed wait over no prediction."""
    max_p99_regression: float = 0.0
    """Largest fractional rise of the p99 per-step exposed wait over no prediction."""
    regression_tolerance_s: float = 0.0
    """Absolute slack (seconds) added to both tail bounds, e.g. for a zero baseline."""
    evidence: str = "simulator"
    """``simulator``: the shadow simulation may decide; ``runtime``: only measurements
    on the real runtime count (the simulator alone is then not enough)."""
    require_exact_output: bool = True
    """Require evidence that target output is unchanged by the predictions."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"ServiceObjective.name must be a non-empty string, "
                              f"got {self.name!r}")
        _bounded("min_exposed_wait_reduction", self.min_exposed_wait_reduction,
                 optional=True, high=1.0)
        _bounded("min_throughput_gain", self.min_throughput_gain, optional=True, high=None)
        if self.min_exposed_wait_reduction is None and self.min_throughput_gain is None:
            raise ConfigError("ServiceObjective needs min_exposed_wait_reduction or "
                              "min_throughput_gain: state what promotion must improve")
        for name in ("max_p95_regression", "max_p99_regression", "regression_tolerance_s"):
            _bounded(name, getattr(self, name), optional=False, high=None)
        if self.evidence not in EVIDENCE_SOURCES:
            raise ConfigError(f"ServiceObjective.evidence must be one of {EVIDENCE_SOURCES}, "
                              f"got {self.evidence!r}")
        if not isinstance(self.require_exact_output, bool):
            raise ConfigError("ServiceObjective.require_exact_output must be True or False")

    def statement(self) -> str:
        """The objective in one sentence, as the report prints it."""
        parts = []
        if self.min_exposed_wait_reduction is not None:
            parts.append(f"exposed I/O wait reduced by >= {self.min_exposed_wait_reduction:.1%}")
        if self.min_throughput_gain is not None:
            parts.append(f"output tokens/s raised by >= {self.min_throughput_gain:.1%}")
        parts.append(f"p95 per-step wait regression <= {self.max_p95_regression:.1%} and p99 "
                     f"<= {self.max_p99_regression:.1%} (+{self.regression_tolerance_s:g} s)")
        if self.require_exact_output:
            parts.append("exact target output preserved")
        return f"{self.name}: " + "; ".join(parts) + f" (evidence: {self.evidence})"


def _number(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if value is None or isinstance(value, bool):
        return None
    return float(value) if math.isfinite(float(value)) else None


def _tail(metrics: Mapping[str, Any], q: int, bound: float, slack: float) -> Check:
    name = f"p{q}_regression"
    value = _number(metrics, f"exposed_wait_step_p{q}_s")
    base = _number(metrics, f"baseline_exposed_wait_step_p{q}_s")
    rule = f"<= no-prediction p{q} x (1 + {bound:.1%}) + {slack:g} s (max_p{q}_regression)"
    if value is None or base is None:
        return unmeasured(name, f"p{q} per-step exposed wait with and without predictions "
                                "is missing; run the shadow simulation against its baseline",
                          threshold=rule)
    allowed = base * (1.0 + bound) + slack
    return judged(name, value <= allowed,
                  figure=f"p{q} per-step exposed wait {value:.3g} s vs {base:.3g} s without "
                  "predictions", threshold=f"<= {allowed:.3g} s ({rule})",
                  reason="" if value <= allowed else "predictions make the slow steps slower")


def _wait_check(target: float, got: float | None) -> Check:
    threshold = f">= {target:.1%} (ServiceObjective.min_exposed_wait_reduction)"
    if got is None:
        return unmeasured("exposed_wait_reduction", "exposed wait reduction is missing (no "
                          "baseline run, or no exposed wait to reduce)", threshold=threshold)
    return judged("exposed_wait_reduction", got >= target,
                  figure=f"exposed I/O wait reduced by {got:.1%}", threshold=threshold,
                  reason="" if got >= target else "too little SSD wait is hidden")


def _throughput_check(target: float, tps: float | None, base: float | None) -> Check:
    threshold = f">= {target:+.1%} (ServiceObjective.min_throughput_gain)"
    if tps is None or not base:
        return unmeasured("throughput_gain", "tokens/s with and without predictions are "
                          "missing", threshold=threshold)
    gain = tps / base - 1.0
    return judged("throughput_gain", gain >= target,
                  figure=f"output tokens/s {tps:.4g} vs {base:.4g} ({gain:+.1%})",
                  threshold=threshold, reason="" if gain >= target else "too small a gain")


def _improvements(objective: ServiceObjective, metrics: Mapping[str, Any]) -> list[Check]:
    checks = []
    if objective.min_exposed_wait_reduction is not None:
        checks.append(_wait_check(objective.min_exposed_wait_reduction,
                                  _number(metrics, "exposed_wait_reduction")))
    if objective.min_throughput_gain is not None:
        checks.append(_throughput_check(objective.min_throughput_gain,
                                        _number(metrics, "tokens_per_s"),
                                        _number(metrics, "baseline_tokens_per_s")))
    return checks


def _exact_output(objective: ServiceObjective, source: str,
                  output_preserved: bool | None) -> list[Check]:
    if not objective.require_exact_output:
        return []
    threshold = "bit-identical target output (ServiceObjective.require_exact_output)"
    if source == "simulator":
        return [judged("exact_output", True, figure="exact by construction in the simulator",
                       threshold=threshold, reason="predictions only move bytes; the recorded "
                       "native routes execute; re-verify on the runtime canary")]
    if output_preserved is None:
        return [unmeasured("exact_output", "the runtime run did not report whether target "
                           "output was bit-identical", threshold=threshold)]
    return [judged("exact_output", output_preserved,
                   figure="output bit-identical" if output_preserved else "output CHANGED",
                   threshold=threshold, reason="" if output_preserved else
                   "target output CHANGED under predictions")]


def evaluate_objective(objective: ServiceObjective, metrics: Mapping[str, Any], *,
                       source: str, output_preserved: bool | None = None) -> list[Check]:
    """The checks of ``objective`` on ``metrics`` (named as :func:`train.sim.summarize`
    names them) measured by ``source`` (``simulator`` or ``runtime``)."""
    checks = _improvements(objective, metrics)
    checks.append(_tail(metrics, 95, objective.max_p95_regression,
                        objective.regression_tolerance_s))
    checks.append(_tail(metrics, 99, objective.max_p99_regression,
                        objective.regression_tolerance_s))
    return checks + _exact_output(objective, source, output_preserved)
