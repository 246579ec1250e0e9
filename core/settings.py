"""Where the flywheel keeps local state and which Kafka cluster it talks to.

Every command takes ``--bootstrap-servers``; without it, ``FLYWHEEL_BOOTSTRAP_SERVERS``
is read, and without that the embedded broker's address is used. The cluster's other
client properties (``security.protocol``, ``sasl.*``, ``ssl.*``, ``client.id``, ...)
come from a file of ``key=value`` lines: ``flywheel --kafka-config FILE``, which sets
``FLYWHEEL_KAFKA_CONFIG`` so that child processes use the same file.
"""

from __future__ import annotations

import os
from pathlib import Path

from hebrus_flywheel.core.errors import ConfigError

PORT_ENV = "FLYWHEEL_BROKER_PORT"
# The controller listens on the next port up. Override the pair to run a second
# embedded broker beside the first (e.g. a CI run on a developer machine).
EMBEDDED_BROKER_PORT = int(os.environ.get(PORT_ENV) or 19092)
EMBEDDED_CONTROLLER_PORT = EMBEDDED_BROKER_PORT + 1
EMBEDDED_BOOTSTRAP = f"127.0.0.1:{EMBEDDED_BROKER_PORT}"
BOOTSTRAP_ENV = "FLYWHEEL_BOOTSTRAP_SERVERS"
PARTITIONS_ENV = "FLYWHEEL_TOPIC_PARTITIONS"
DEFAULT_TOPIC_PARTITIONS = 12
"""Partitions of every keyed catalogue topic (capture, quarantine, windows): the most
stream or replay workers of one group that can share the work (docs/operations.md)."""
HOME_ENV = "FLYWHEEL_HOME"
KAFKA_CONFIG_ENV = "FLYWHEEL_KAFKA_CONFIG"


def bootstrap_servers(cli_value: str | None = None) -> str:
    """The Kafka bootstrap list: the flag, else the environment, else the embedded broker."""
    if cli_value:
        return cli_value
    return os.environ.get(BOOTSTRAP_ENV) or EMBEDDED_BOOTSTRAP


def topic_partitions() -> int:
    """Partitions of the keyed catalogue topics: ``$FLYWHEEL_TOPIC_PARTITIONS`` or 12. Read
    when topics are created; existing topics keep theirs (a mismatch is refused)."""
    raw = os.environ.get(PARTITIONS_ENV) or str(DEFAULT_TOPIC_PARTITIONS)
    if not raw.isdigit() or not 1 <= int(raw) <= 1024:
        raise ConfigError(f"{PARTITIONS_ENV} must be an integer in 1..1024, got {raw!r}")
    return int(raw)


def flywheel_home() -> Path:
    """Local state root (broker, teachers, datasets): ``$FLYWHEEL_HOME`` or ``./.flywheel``."""
    return Path(os.environ.get(HOME_ENV) or Path.cwd() / ".flywheel").resolve()


def read_kafka_properties(path: str | Path) -> dict[str, str]:
    """``key=value`` lines of a Kafka client properties file (``#`` comments, blank lines)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"kafka_config: cannot read {path}: {exc.strerror or exc}; pass an "
                          f"existing file to --kafka-config or ${KAFKA_CONFIG_ENV}") from exc
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"kafka_config: {path}:{number} is not a key=value line: {raw!r}")
        if key.strip() in out:
            raise ConfigError(f"kafka_config: {path}:{number} sets {key.strip()} a second time")
        out[key.strip()] = value.strip()
    return out


def kafka_properties(cli_value: str | Path | None = None) -> dict[str, str]:
    """Client properties from the ``--kafka-config`` file, else ``$FLYWHEEL_KAFKA_CONFIG``."""
    path = cli_value or os.environ.get(KAFKA_CONFIG_ENV)
    return read_kafka_properties(path) if path else {}
