"""Where an S3-compatible store is and with which keys a role reaches it.

Two roles hold storage keys (secure by default, like the broker's SCRAM principals):

* ``sealer`` — read-write: publishes sealed snapshots, expires and supersedes them;
* ``trainer`` — read-only: training, verification, rebuild and DuckDB reads.

The embedded store (``flywheel storage up``, :mod:`.server`) writes each role's keys to
``$FLYWHEEL_HOME/storage/security/<role>.json`` (0600) on its first start, with the TLS
CA the clients trust (``ca.crt``). A managed S3 (AWS, MinIO, Ceph, ...) is reached with
the environment instead, which wins over the files:

``FLYWHEEL_S3_ENDPOINT`` (``https://host:port``; unset: AWS), ``FLYWHEEL_S3_CA_BUNDLE``,
``FLYWHEEL_S3_REGION``, ``FLYWHEEL_S3_ACCESS_KEY_ID`` and ``FLYWHEEL_S3_SECRET_ACCESS_KEY``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.core.storage.exceptions import StorageError

STORAGE_ROLES: tuple[str, ...] = ("sealer", "trainer")
"""``sealer`` writes (read-write identity), ``trainer`` only reads (read-only identity)."""
WRITE_ROLE = "sealer"
READ_ROLE = "trainer"
PORT_ENV = "FLYWHEEL_STORAGE_PORT"
DEFAULT_PORT = 19480
ENDPOINT_ENV = "FLYWHEEL_S3_ENDPOINT"
CA_ENV = "FLYWHEEL_S3_CA_BUNDLE"
REGION_ENV = "FLYWHEEL_S3_REGION"
ACCESS_ENV = "FLYWHEEL_S3_ACCESS_KEY_ID"
SECRET_ENV = "FLYWHEEL_S3_SECRET_ACCESS_KEY"
DEFAULT_REGION = "us-east-1"
DEFAULT_BUCKET = "flywheel-snapshots"
CHECKPOINT_BUCKET = "flywheel-checkpoints"
"""The embedded store's bucket for trained checkpoints: the one the ``trainer`` may write."""
CHECKPOINT_ROLE = READ_ROLE


def storage_port() -> int:
    """The embedded store's TLS port: ``$FLYWHEEL_STORAGE_PORT`` or 19480."""
    raw = os.environ.get(PORT_ENV) or str(DEFAULT_PORT)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise StorageError(f"{PORT_ENV} must be a TCP port number, got {raw!r}")
    return int(raw)


def storage_dir(home: Path | None = None) -> Path:
    return (home or flywheel_home()) / "storage"


def security_dir(home: Path | None = None) -> Path:
    return storage_dir(home) / "security"


def credentials_path(role: str, home: Path | None = None) -> Path:
    return security_dir(home) / f"{check_role(role)}.json"


def check_role(role: str) -> str:
    if role not in STORAGE_ROLES:
        raise StorageError(f"role: {role!r} has no storage keys; use one of "
                           f"{', '.join(STORAGE_ROLES)}")
    return role


@dataclass(frozen=True, kw_only=True)
class S3Target:
    """How one role reaches an S3-compatible store.

    Fields:
        endpoint: ``https://host:port`` of the store; None for AWS itself.
        access_key: the role's access key id.
        secret_key: the role's secret access key.
        ca_bundle: PEM file of the CA the store's certificate chains to (None: system CAs).
        region: the SigV4 signing region.
        role: the role these keys belong to (for messages).
    """

    endpoint: str | None
    access_key: str
    secret_key: str
    ca_bundle: Path | None
    region: str = DEFAULT_REGION
    role: str = READ_ROLE

    def __post_init__(self) -> None:
        if self.endpoint is not None and not self.endpoint.startswith("https://"):
            raise StorageError(f"S3Target.endpoint must be https:// (TLS is not optional), "
                               f"got {self.endpoint!r}")
        if not self.access_key or not self.secret_key:
            raise StorageError("S3Target.access_key and secret_key must be set")

    def __repr__(self) -> str:  # never print the secret
        return f"S3Target(endpoint={self.endpoint!r}, role={self.role!r})"


def embedded_endpoint() -> str:
    return f"https://127.0.0.1:{storage_port()}"


def _from_env(role: str) -> S3Target | None:
    access, secret = os.environ.get(ACCESS_ENV), os.environ.get(SECRET_ENV)
    if not access or not secret:
        return None
    ca = os.environ.get(CA_ENV)
    return S3Target(endpoint=os.environ.get(ENDPOINT_ENV) or None, access_key=access,
                    secret_key=secret, ca_bundle=Path(ca) if ca else None,
                    region=os.environ.get(REGION_ENV) or DEFAULT_REGION, role=role)


def s3_target(role: str = READ_ROLE, home: Path | None = None) -> S3Target:
    """The role's target: the environment's keys if set, else the embedded store's."""
    check_role(role)
    env = _from_env(role)
    if env is not None:
        return env
    path = credentials_path(role, home)
    try:
        keys = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise StorageError(
            f"no storage keys for role {role} ({path}); run `flywheel storage up` for the "
            f"embedded store, or set {ACCESS_ENV}/{SECRET_ENV} (and {ENDPOINT_ENV}) for "
            "another S3-compatible store") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise StorageError(f"cannot read the storage keys {path}: {exc}") from exc
    ca = security_dir(home) / "ca.crt"
    return S3Target(endpoint=os.environ.get(ENDPOINT_ENV) or embedded_endpoint(),
                    access_key=str(keys.get("access_key") or ""),
                    secret_key=str(keys.get("secret_key") or ""),
                    ca_bundle=Path(os.environ[CA_ENV]) if os.environ.get(CA_ENV) else ca,
                    region=os.environ.get(REGION_ENV) or DEFAULT_REGION, role=role)
