"""Durations written by people (``7d``, ``36h``, ``90m``, ``45s``) as milliseconds and back."""

from __future__ import annotations

import re

from hebrus_flywheel.core.errors import ConfigError

FOREVER = -1
"""What ``forever`` (or ``-1``) parses to, matching Kafka's ``retention.ms=-1``."""
_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_DURATION_RE = re.compile(r"^\s*(?P<n>[0-9]+)\s*(?P<unit>ms|s|m|h|d|w)\s*$")


def parse_duration_ms(text: str | int, *, what: str, allow_forever: bool = False) -> int:
    """``text`` (``7d``, ``36h``, ``90m``, ``45s``, ``500ms``, ``2w``) in milliseconds.

    ``forever`` or ``-1`` give :data:`FOREVER` when ``allow_forever``; a bare integer is
    milliseconds. ``what`` names the setting in the :class:`ConfigError` raised otherwise.
    """
    if isinstance(text, bool):
        raise ConfigError(f"{what} must be a duration like 7d or 36h, got {text!r}")
    if isinstance(text, int) or (isinstance(text, str) and text.strip().lstrip("-").isdigit()):
        value = int(text)
        if value == FOREVER and allow_forever:
            return FOREVER
        if value > 0:
            return value
        raise ConfigError(f"{what} must be > 0 milliseconds"
                          + (" or -1 (forever)" if allow_forever else "") + f", got {text!r}")
    if not isinstance(text, str):
        raise ConfigError(f"{what} must be a duration like 7d or 36h, got {text!r}")
    if allow_forever and text.strip().lower() == "forever":
        return FOREVER
    match = _DURATION_RE.match(text.lower())
    if match is None or int(match["n"]) == 0:
        raise ConfigError(
            f"{what} must be a positive duration like 7d, 36h, 90m or 45s"
            + (" (or 'forever')" if allow_forever else "") + f", got {text!r}")
    return int(match["n"]) * _UNITS_MS[match["unit"]]


def format_duration_ms(ms: int) -> str:
    """``ms`` in the largest unit that divides it exactly (``604800000`` -> ``7d``)."""
    if ms == FOREVER:
        return "forever"
    for unit in ("d", "h", "m", "s"):
        if ms and ms % _UNITS_MS[unit] == 0:
            return f"{ms // _UNITS_MS[unit]}{unit}"
    return f"{ms}ms"
