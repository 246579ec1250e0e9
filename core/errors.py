"""The root of every error this project raises on purpose.

Each package (``schemas``, ``streams``, ``replay``, ``consumers``, ``train``) has an
``exceptions.py`` whose classes derive from :class:`FlywheelError`, so a caller can
catch one type and the CLI can turn any of them into a clear message and exit code.
Messages say what was wrong and what to do about it.
"""

from __future__ import annotations


class FlywheelError(Exception):
    """Base class for every error raised deliberately by hebrus-flywheel."""


class ConfigError(FlywheelError, ValueError):
    """A configuration value is invalid; the message names the field."""
