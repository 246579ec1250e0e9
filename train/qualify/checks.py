"""Small validators for the input bundle: each raises :class:`InputError` naming the
field (``owner.name``) and what to give instead."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hebrus_flywheel.train.qualify.errors import InputError


def text(where: str, value: Any, *, optional: bool = False) -> None:
    """A non-empty string (or None when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise InputError(f"{where} must be a non-empty string, got {value!r}")


def count(where: str, value: Any, *, optional: bool = False, positive: bool = False) -> None:
    """A non-negative (or positive) integer, not a bool."""
    if value is None and optional:
        return
    low = 1 if positive else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{where} must be an integer >= {low}, got {value!r}")


def number(where: str, value: Any, *, optional: bool = False, low: float | None = 0.0,
           high: float | None = None) -> None:
    """A finite number within ``[low, high]``."""
    if value is None and optional:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InputError(f"{where} must be a finite number {span}, got {value!r}")


def flag(where: str, value: Any, *, optional: bool = False) -> None:
    """True or False (or None when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise InputError(f"{where} must be true or false, got {value!r}")


def mapping(where: str, value: Any) -> None:
    """A mapping with string keys."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InputError(f"{where} must be a mapping with string keys, got {type(value).__name__}")


def strings(where: str, value: Any) -> None:
    """A tuple or frozenset of non-empty strings."""
    if not isinstance(value, tuple | frozenset) or not all(
            isinstance(v, str) and v for v in value):
        raise InputError(f"{where} must be a list of non-empty strings, got {value!r}")


def instance(where: str, value: Any, kind: type, *, optional: bool = True) -> None:
    """An instance of ``kind`` (or None when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, kind):
        raise InputError(f"{where} must be a {kind.__name__}, got {type(value).__name__}")


def freeze(obj: object, name: str, kind: type[tuple[Any, ...]] | type[frozenset[Any]]) -> None:
    """Turn a list (or set) given for field ``name`` of a frozen dataclass into ``kind``,
    so callers may pass plain lists; anything else is left for the field's own check."""
    value = getattr(obj, name)
    if isinstance(value, list | tuple | set | frozenset) and not isinstance(value, kind):
        object.__setattr__(obj, name, kind(value))
