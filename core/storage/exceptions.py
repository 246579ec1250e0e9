"""The root exception of object storage (:mod:`hebrus_flywheel.core.storage`)."""

from __future__ import annotations

from hebrus_flywheel.core.errors import FlywheelError


class StorageError(FlywheelError):
    """An object store refused, failed or is not set up; the message says what to do."""
