"""Errors of the snapshot contract: a shard, manifest or sealed snapshot that is not what
it claims. Writers and readers in every stage raise or catch these same types."""

from __future__ import annotations

from hebrus_flywheel.core.errors import FlywheelError


class SnapshotContractError(FlywheelError):
    """Base class: something on disk does not follow the snapshot contract."""


class ShardFormatError(SnapshotContractError):
    """A shard's footer metadata is missing, of another contract version, or inconsistent."""


class ManifestError(SnapshotContractError):
    """A manifest is missing, malformed, or its digest does not match its content."""


class VerifyError(SnapshotContractError):
    """A sealed snapshot differs from its manifest (byte flip, missing or extra file)."""


class KeyAccessError(SnapshotContractError):
    """An encrypted shard cannot be written or read: no key, the wrong key, or a key file
    that is not private."""


class ProductError(SnapshotContractError):
    """A reader of one replay product (clean-path, candidate-path) was pointed at the
    other; the two are never mixed unless the caller asks for both explicitly."""
