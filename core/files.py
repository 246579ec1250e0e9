"""Atomic, durable file writes: the one way this project replaces a file.

A write goes to a temporary file in the destination's directory (or a staging
directory on the same filesystem), is fsynced, renamed over the destination and the
directory is fsynced. A crash at any point leaves the old file or the whole new one,
never a torn one, and a completed write survives power loss.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from hebrus_flywheel.core.jsonio import pretty_json


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], Any], *,
                 tmp_dir: Path | None = None) -> None:
    """Replace ``path`` with what ``write`` puts into a binary handle, atomically and durably.

    ``tmp_dir`` (same filesystem as ``path``) holds the temporary file; by default it is
    ``path``'s own directory.
    """
    path = Path(path)
    tmp = Path(tmp_dir or path.parent) / f".{path.name}.{os.getpid()}.tmp"
    try:
        with tmp.open("wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes, *, tmp_dir: Path | None = None) -> None:
    atomic_write(path, lambda handle: handle.write(data), tmp_dir=tmp_dir)


def atomic_write_text(path: Path, text: str, *, tmp_dir: Path | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), tmp_dir=tmp_dir)


def atomic_write_json(path: Path, value: Any, *, tmp_dir: Path | None = None) -> None:
    """``value`` as indented, key-sorted JSON (:func:`~hebrus_flywheel.core.jsonio.pretty_json`)."""
    atomic_write_text(path, pretty_json(value), tmp_dir=tmp_dir)


def atomic_replace_dir(staging: Path, target: Path) -> None:
    """Move a fully written directory ``staging`` to ``target`` (which must not exist)."""
    for root, _dirs, names in os.walk(staging):
        for name in names:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))
    os.replace(staging, target)
    fsync_path(Path(target).parent)
