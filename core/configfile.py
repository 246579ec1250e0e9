"""Reading TOML configuration files with errors that say which file and what to do."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.errors import ConfigError


def read_toml(path: Path) -> dict[str, Any]:
    """The parsed file; :class:`ConfigError` naming the file when it is missing or invalid."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
