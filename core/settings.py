"""Where the flywheel keeps local state and which Kafka cluster it talks to.

Every command takes ``--bootstrap-servers``; without it, ``FLYWHEEL_BOOTSTRAP_SERVERS``
is read, and without that the embedded broker's address is used.
"""

from __future__ import annotations

import os
from pathlib import Path

PORT_ENV = "FLYWHEEL_BROKER_PORT"
# The controller listens on the next port up. Override the pair to run a second
# embedded broker beside the first (e.g. a CI run on a developer machine).
EMBEDDED_BROKER_PORT = int(os.environ.get(PORT_ENV) or 19092)
EMBEDDED_CONTROLLER_PORT = EMBEDDED_BROKER_PORT + 1
EMBEDDED_BOOTSTRAP = f"127.0.0.1:{EMBEDDED_BROKER_PORT}"
BOOTSTRAP_ENV = "FLYWHEEL_BOOTSTRAP_SERVERS"
HOME_ENV = "FLYWHEEL_HOME"


def bootstrap_servers(cli_value: str | None = None) -> str:
    """The Kafka bootstrap list: the flag, else the environment, else the embedded broker."""
    if cli_value:
        return cli_value
    return os.environ.get(BOOTSTRAP_ENV) or EMBEDDED_BOOTSTRAP


def flywheel_home() -> Path:
    """Local state root (broker, teachers, datasets): ``$FLYWHEEL_HOME`` or ``./.flywheel``."""
    return Path(os.environ.get(HOME_ENV) or Path.cwd() / ".flywheel").resolve()
