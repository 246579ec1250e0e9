"""Which client properties a process of one role uses on the embedded broker.

``flywheel broker up`` (``streams/security.py``) writes, under
``$FLYWHEEL_HOME/kafka/security/``, one librdkafka properties file per role
(``<role>.properties``: SASL_SSL, SCRAM-SHA-512, the role's user and password, the local
CA). This module only finds them: when a process sets no ``--kafka-config`` /
``$FLYWHEEL_KAFKA_CONFIG`` and talks to the embedded broker, its clients use the file of
its role. The role is ``$FLYWHEEL_ROLE``, which every ``flywheel`` command sets to its own
role (:func:`declare_role`) unless it is already set; a process that declares none (a
library caller, a test, a benchmark) is ``admin``.

A home whose broker was started with ``--insecure-plaintext`` holds the marker file
:data:`INSECURE_MARKER`; its clients then use no security properties, and every report
made from such a run says so in red (:func:`insecure_plaintext`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.settings import (
    EMBEDDED_BROKER_PORT,
    KAFKA_CONFIG_ENV,
    flywheel_home,
    read_kafka_properties,
)

ROLE_ENV = "FLYWHEEL_ROLE"
ROLES: tuple[str, ...] = ("admin", "runtime", "streams", "replay", "sealer", "trainer")
DEFAULT_ROLE = "admin"
INSECURE_MARKER = "INSECURE-PLAINTEXT"
INSECURE_WARNING = ("INSECURE: this run used the embedded Kafka broker with "
                    "--insecure-plaintext (no TLS, no authentication, no ACLs)")


def check_role(role: str) -> str:
    """``role`` if it is one of :data:`ROLES`, else ConfigError naming them."""
    if role not in ROLES:
        raise ConfigError(f"role: {role!r} is not a Kafka role; use one of {', '.join(ROLES)}")
    return role


def security_dir(home: Path | None = None) -> Path:
    """``<home>/kafka/security``: CA, broker key, per-role passwords and properties."""
    return (home or flywheel_home()) / "kafka" / "security"


def role_properties_path(role: str, home: Path | None = None) -> Path:
    """The librdkafka properties file of ``role`` (written by ``flywheel broker up``)."""
    return security_dir(home) / f"{check_role(role)}.properties"


def insecure_marker(home: Path | None = None) -> Path:
    return (home or flywheel_home()) / "kafka" / INSECURE_MARKER


def insecure_plaintext(home: Path | None = None) -> bool:
    """True when this home's embedded broker was started with ``--insecure-plaintext``
    and the process uses it (no Kafka config of the user's own)."""
    return not os.environ.get(KAFKA_CONFIG_ENV) and insecure_marker(home).is_file()


def declare_role(role: str) -> str:
    """The process's role: ``$FLYWHEEL_ROLE`` if set, else ``role`` (then exported, so the
    processes it starts inherit it)."""
    current = os.environ.get(ROLE_ENV)
    if current:
        return check_role(current)
    os.environ[ROLE_ENV] = check_role(role)
    return role


@contextlib.contextmanager
def acting_as(role: str | None) -> Iterator[None]:
    """Run a block as ``role`` (``$FLYWHEEL_ROLE``), restoring the previous role after;
    None clears it, so the commands the block starts declare their own."""
    checked = None if role is None else check_role(role)
    before = os.environ.pop(ROLE_ENV, None)
    if checked is not None:
        os.environ[ROLE_ENV] = checked
    try:
        yield
    finally:
        os.environ.pop(ROLE_ENV, None)
        if before is not None:
            os.environ[ROLE_ENV] = before


def current_role() -> str:
    return check_role(os.environ.get(ROLE_ENV) or DEFAULT_ROLE)


EMBEDDED_MAX_NODES = 9
"""Nodes a local cluster may have (streams.broker.cluster); node i's client port is
``EMBEDDED_BROKER_PORT + 2(i-1)``."""


def is_embedded_bootstrap(bootstrap: str) -> bool:
    """Whether ``bootstrap`` names only the embedded broker of this process's settings, or
    only client ports of the local cluster's nodes (same home, same credentials)."""
    ports = {str(EMBEDDED_BROKER_PORT + 2 * i) for i in range(EMBEDDED_MAX_NODES)}
    entries = [e.strip().rpartition(":") for e in bootstrap.split(",")]
    return all(host in ("127.0.0.1", "localhost") and port in ports for host, _, port in entries)


def embedded_properties(bootstrap: str, role: str | None = None,
                        home: Path | None = None) -> dict[str, str]:
    """The client properties of ``role`` (default: the process's role) for ``bootstrap``:
    its properties file when ``bootstrap`` is the embedded broker and the broker was set up
    secure; nothing for any other cluster or an ``--insecure-plaintext`` home."""
    if not is_embedded_bootstrap(bootstrap) or insecure_marker(home).is_file():
        return {}
    path = role_properties_path(role or current_role(), home)
    return read_kafka_properties(path) if path.is_file() else {}
