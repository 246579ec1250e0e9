"""Canonical JSON: the one byte form every digest in the project is computed over.

Keys sorted, no whitespace, UTF-8 without escaping. Identity ids, config ids, window
digests and the snapshot id are SHA-256 digests of these bytes, so two writers that hold
the same value always produce the same digest.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> bytes:
    """``value`` as canonical JSON bytes (sorted keys, compact separators, UTF-8)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def canonical_digest(value: Any) -> str:
    """Hex SHA-256 of :func:`canonical_json` of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def pretty_json(value: Any) -> str:
    """Indented, key-sorted JSON text with a trailing newline, for files people read."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
