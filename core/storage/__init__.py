"""Object storage for snapshot roots: local directories and ``s3://bucket/prefix``.

:mod:`.config` says where a store is and which role's keys reach it, :mod:`.objects`
holds the store operations (:class:`S3Store` over boto3, :class:`LocalStore` for tests).
The snapshot contract's remote side (fetching a sealed epoch, verified) is
:mod:`hebrus_flywheel.core.snapshot.remote`; publication is
:mod:`hebrus_flywheel.consumers.publish`.
"""

from __future__ import annotations

from hebrus_flywheel.core.storage.config import (
    READ_ROLE,
    STORAGE_ROLES,
    WRITE_ROLE,
    S3Target,
    s3_target,
)
from hebrus_flywheel.core.storage.exceptions import StorageError
from hebrus_flywheel.core.storage.objects import (
    LocalStore,
    ObjectStore,
    S3Store,
    S3Url,
    is_object_url,
    open_store,
)

__all__ = ["READ_ROLE", "STORAGE_ROLES", "WRITE_ROLE", "LocalStore", "ObjectStore", "S3Store",
           "S3Target", "S3Url", "StorageError", "is_object_url", "open_store", "s3_target"]
