"""Atomic, durable file writes: the one way this project replaces a file.

A write goes to a temporary file in the destination's directory (or a staging
directory on the same filesystem), is fsynced, renamed over the destination and the
directory is fsynced. A crash at any point leaves the old file or the whole new one,
never a torn one, and a completed write survives power loss.

File modes are explicit, never left to the process umask: every file written here is
created :data:`FILE_MODE` (0640) and every directory made with :func:`make_dirs`
:data:`DIR_MODE` (0750), under any umask (0000 and 0002 included): data, checkpoints and
reports are readable by their owner and group, never by other users. A sealed snapshot
is made read-only with :func:`set_tree_modes` (files :data:`SEALED_FILE_MODE` 0440,
directories :data:`SEALED_DIR_MODE` 0550).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

from hebrus_flywheel.core.jsonio import pretty_json

FILE_MODE = 0o640
"""Mode of every file this project writes: owner read/write, group read, others nothing."""
DIR_MODE = 0o750
"""Mode of every directory this project makes."""
SEALED_FILE_MODE = 0o440
"""Mode of a sealed (read-only) file."""
SEALED_DIR_MODE = 0o550
"""Mode of a sealed (read-only) directory."""


def make_dirs(path: Path, mode: int = DIR_MODE) -> Path:
    """``mkdir -p path``; each directory it creates gets ``mode`` whatever the umask
    (existing ones are left as they are). Returns ``path``."""
    path = Path(path)
    missing: list[Path] = []
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            break
        missing.append(candidate)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            if not directory.is_dir():
                raise
            continue  # made by someone else meanwhile: theirs to set
        os.chmod(directory, mode)
    return path


def set_tree_modes(root: Path, *, file_mode: int = FILE_MODE, dir_mode: int = DIR_MODE) -> None:
    """chmod every file under ``root`` to ``file_mode`` and every directory (``root``
    included) to ``dir_mode``, deepest first (so read-only directories come last)."""
    for dirpath, _dirs, names in os.walk(root, topdown=False):
        for name in names:
            os.chmod(Path(dirpath) / name, file_mode)
        os.chmod(dirpath, dir_mode)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_file(path: Path, mode: int = FILE_MODE) -> BinaryIO:
    """Open a new binary file for writing (replacing any file there) with exactly ``mode``,
    whatever the umask."""
    path = Path(path)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def append_file(path: Path, mode: int = FILE_MODE) -> BinaryIO:
    """Open ``path`` for appending (created if missing) and set it to ``mode``."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        os.fchmod(fd, mode)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def atomic_write(path: Path, write: Callable[[BinaryIO], Any], *,
                 tmp_dir: Path | None = None, mode: int = FILE_MODE) -> None:
    """Replace ``path`` with what ``write`` puts into a binary handle, atomically and durably.

    ``tmp_dir`` (same filesystem as ``path``) holds the temporary file; by default it is
    ``path``'s own directory. The file is created with ``mode`` (0640), not by the umask.
    """
    path = Path(path)
    tmp = Path(tmp_dir or path.parent) / f".{path.name}.{os.getpid()}.tmp"
    try:
        with create_file(tmp, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes, *, tmp_dir: Path | None = None,
                       mode: int = FILE_MODE) -> None:
    atomic_write(path, lambda handle: handle.write(data), tmp_dir=tmp_dir, mode=mode)


def atomic_write_text(path: Path, text: str, *, tmp_dir: Path | None = None,
                      mode: int = FILE_MODE) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), tmp_dir=tmp_dir, mode=mode)


def atomic_write_json(path: Path, value: Any, *, tmp_dir: Path | None = None,
                      mode: int = FILE_MODE) -> None:
    """``value`` as indented, key-sorted JSON (:func:`~hebrus_flywheel.core.jsonio.pretty_json`)."""
    atomic_write_text(path, pretty_json(value), tmp_dir=tmp_dir, mode=mode)


def atomic_replace_dir(staging: Path, target: Path, *, file_mode: int = FILE_MODE,
                       dir_mode: int = DIR_MODE) -> None:
    """Move a fully written directory ``staging`` to ``target`` (which must not exist).

    Its files and directories get ``file_mode`` and ``dir_mode`` first, so files that
    other libraries wrote into it do not keep the modes the umask gave them."""
    set_tree_modes(staging, file_mode=file_mode, dir_mode=dir_mode)
    for root, _dirs, names in os.walk(staging):
        for name in names:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))
    os.replace(staging, target)
    fsync_path(Path(target).parent)


def fill_dir_once(target: Path, fill: Callable[[Path], Any], *, complete: str) -> Path:
    """``target``, filled by ``fill(partial)`` in a private directory beside it and renamed
    into place unless its file ``complete`` already exists. Readers that fetch at once
    (torchrun ranks, two CLI runs) each fill their own partial directory; the first rename
    wins and the others find ``target`` complete. A failed fill leaves no ``target``."""
    if (target / complete).is_file():
        return target
    make_dirs(target.parent)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name[:16]}.", dir=target.parent))
    os.chmod(partial, DIR_MODE)
    try:
        fill(partial)
        try:
            partial.rename(target)
        except OSError:
            if not (target / complete).is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created, with its directory) for the block:
    one process at a time starts or stops what the lock guards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def claim_exclusive(path: Path) -> IO[str] | None:
    """Take a non-blocking exclusive ``flock`` on ``path`` (created, with its directory)
    for as long as the returned file stays open, which the caller keeps for the life of
    the process (the kernel drops the lock when the process dies, even by kill -9).
    None when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = path.open("a")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        return None
    return fh
