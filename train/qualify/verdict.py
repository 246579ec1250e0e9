"""Verdict types shared by the gates, the falsifiers and the report.

A gate is a list of :class:`Check`\\ s. Its status follows one fail-closed rule
(:func:`combine`): any failed check fails the gate; otherwise a *required* check that
could not be measured makes the gate ``not_measurable``; only when every required check
passed does the gate pass. An optional check that was not measured is listed in the
reasons but never turns into a pass of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hebrus_flywheel.train.qualify.errors import QualificationError

PASS = "pass"
FAIL = "fail"
NOT_MEASURABLE = "not_measurable"
GATE_STATUSES: tuple[str, ...] = (PASS, FAIL, NOT_MEASURABLE)

FALSIFIED = "falsified"
NOT_FALSIFIED = "not_falsified"
FALSIFIER_STATUSES: tuple[str, ...] = (FALSIFIED, NOT_FALSIFIED, NOT_MEASURABLE)


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types: tuples and sets become lists (sets sorted), numpy
    scalars become Python numbers, non-finite floats become None, keys become strings."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return [jsonable(v) for v in sorted(value, key=str)]
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


@dataclass(frozen=True, kw_only=True)
class Check:
    """One condition of a gate."""

    name: str
    """Short identifier, e.g. ``"parity"``."""
    status: str
    """``pass``, ``fail`` or ``not_measurable``."""
    detail: str
    """One line: what was measured against what, or why it could not be."""
    required: bool = True
    """Whether the gate may pass without this check having been measured."""
    measured: str = ""
    """The measured figure(s) with units (``"not measured"`` when missing); empty for
    a check that only carries ``detail``."""
    threshold: str = ""
    """The threshold (from the qualification config or objective) the figure is
    compared against."""
    reason: str = ""
    """Why the check passed or failed, or what evidence was missing and where it
    would come from."""

    def __post_init__(self) -> None:
        if self.status not in GATE_STATUSES:
            raise QualificationError(f"Check.status must be one of {GATE_STATUSES}, "
                                     f"got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "measured": self.measured,
                "threshold": self.threshold, "reason": self.reason, "detail": self.detail,
                "required": self.required}


def combine(checks: Iterable[Check]) -> str:
    """The gate status of ``checks``: fail > required not measurable > pass. No checks
    at all is ``not_measurable``."""
    checks = list(checks)
    if any(c.status == FAIL for c in checks):
        return FAIL
    if not checks or any(c.status == NOT_MEASURABLE and c.required for c in checks):
        return NOT_MEASURABLE
    return PASS


def _reasons(checks: list[Check]) -> list[str]:
    failed = [c.detail for c in checks if c.status == FAIL]
    missing = [c.detail for c in checks if c.status == NOT_MEASURABLE and c.required]
    optional = [f"(optional, not measured) {c.detail}" for c in checks
                if c.status == NOT_MEASURABLE and not c.required]
    passed = [c.detail for c in checks if c.status == PASS]
    return failed + missing + passed + optional


@dataclass(frozen=True, kw_only=True)
class GateVerdict:
    """The verdict of one gate of the qualification matrix."""

    gate: int
    """1..6."""
    name: str
    """The design note's name of the gate."""
    status: str
    """``pass``, ``fail`` or ``not_measurable``."""
    reasons: list[str]
    """One line each, the decisive ones first: failures, what was missing, passes,
    then optional checks that were not measured."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Every number the verdict used, as JSON types."""
    checks: list[Check] = field(default_factory=list)
    """The individual conditions."""

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def headline(self) -> str:
        """The one-line reason shown in the summary."""
        return self.reasons[0] if self.reasons else "no checks were evaluated"

    def to_dict(self) -> dict[str, Any]:
        return {"gate": self.gate, "name": self.name, "status": self.status,
                "reasons": list(self.reasons), "figures": jsonable(self.figures),
                "checks": [c.to_dict() for c in self.checks]}


def gate_verdict(gate: int, name: str, checks: list[Check],
                 figures: dict[str, Any]) -> GateVerdict:
    """A :class:`GateVerdict` whose status and reasons follow from ``checks``."""
    return GateVerdict(gate=gate, name=name, status=combine(checks), reasons=_reasons(checks),
                       figures=jsonable(figures), checks=list(checks))


@dataclass(frozen=True, kw_only=True)
class FalsifierVerdict:
    """The verdict on one of the design note's ten falsifiers."""

    number: int
    """1..10, the design note's numbering."""
    statement: str
    """The falsifier as the design note words it."""
    status: str
    """``falsified`` (this evidence falsifies the approach), ``not_falsified`` or
    ``not_measurable``."""
    reason: str
    """Why, in one or two sentences, naming the figures used or what is missing."""
    figures: dict[str, Any] = field(default_factory=dict)
    """The numbers the verdict used, as JSON types."""
    measured: str = ""
    """The decisive measured figure(s) with units, or ``"not measured"``."""
    threshold: str = ""
    """The threshold from :class:`FalsifierConfig` (or the gates' config) it was
    compared against."""

    def __post_init__(self) -> None:
        if self.status not in FALSIFIER_STATUSES:
            raise QualificationError("FalsifierVerdict.status must be one of "
                                     f"{FALSIFIER_STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "statement": self.statement, "status": self.status,
                "measured": self.measured, "threshold": self.threshold,
                "reason": self.reason, "figures": jsonable(self.figures)}


NOT_MEASURED = "not measured"
"""The ``measured`` field of a check or falsifier whose evidence is missing."""


def measured(name: str, ok: bool, detail: str, *, required: bool = True) -> Check:
    """A check that was measured: pass when ``ok`` (a free-form ``detail`` only; prefer
    :func:`judged`, which also fills the structured fields)."""
    return Check(name=name, status=PASS if ok else FAIL, detail=detail, required=required)


def judged(name: str, ok: bool, *, figure: str, threshold: str, reason: str = "",
           required: bool = True) -> Check:
    """A measured check with its structured fields: ``figure`` (with units) compared
    against ``threshold``; ``reason`` says why it passed or failed (it defaults to the
    comparison itself). ``detail`` reads ``"<figure> (threshold: <threshold>) —
    passed|failed: <reason>"``."""
    word = "passed" if ok else "failed"
    why = reason or ("meets the threshold" if ok else "misses the threshold")
    return Check(name=name, status=PASS if ok else FAIL, required=required,
                 measured=figure, threshold=threshold, reason=why,
                 detail=f"{figure} (threshold: {threshold}) — {word}"
                 + (f": {reason}" if reason else ""))


def unmeasured(name: str, detail: str, *, threshold: str = "",
               required: bool = True) -> Check:
    """A check that could not be measured; ``detail`` says what evidence is missing and
    where it would come from, ``threshold`` what it would have been compared against."""
    return Check(name=name, status=NOT_MEASURABLE, detail=detail, required=required,
                 measured=NOT_MEASURED, threshold=threshold, reason=detail)
