"""Number formatting shared by verdict lines and the report."""

from __future__ import annotations


def fmt_bytes(n: float | None) -> str:
    """``n`` bytes in binary units (``"3.75 MiB"``); ``"n/a"`` for None."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"  # pragma: no cover - the loop always returns


def fmt_num(value: object, digits: int = 4) -> str:
    """A figure for a table cell: floats with ``digits`` significant digits, None as
    ``"n/a"``, everything else as ``str``."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)
