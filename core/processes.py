"""Processes: whether a process id names a live process (one answer for pid files,
staging owners and worker health files), and one way to run an external tool (Maven,
the Kafka storage tool, the Go toolchain) whose failure becomes the caller's error."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rpartition(")")[2].split()[0] != "Z"
    return True


def run_tool(cmd: list[str], *, what: str, hint: str, timeout_s: float,
             error: type[Exception], cwd: Path | None = None,
             env: Mapping[str, str] | None = None) -> str:
    """Run ``cmd`` and return its standard output; ``error`` (the caller's exception type)
    when it times out or exits non-zero, naming ``what`` failed, the output's last 20
    lines and ``hint`` (what to do about it)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              cwd=cwd, env=None if env is None else dict(env), check=False)
    except subprocess.TimeoutExpired as exc:
        raise error(f"{what} did not finish within {timeout_s:.0f} s; {hint}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise error(f"{what} failed (exit {done.returncode}):\n{tail}\n{hint}")
    return done.stdout


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread, so ``finally`` blocks
    run: a benchmark stopped with ``kill`` (or ``timeout``) stops the workers it started
    instead of leaving them consuming from the broker."""
    import signal

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_gauges() -> dict[str, int]:
    """The C heap of this process as glibc's ``mallinfo2`` sees it, in bytes: what is
    allocated (small chunks plus mmapped blocks) and what is free but kept in the arenas
    (fragmentation: resident, not in use). Empty where the C library has no mallinfo2."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"malloc_in_use_bytes": int(info.uordblks + info.hblkhd),
            "malloc_free_bytes": int(info.fordblks)}



M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
LARGE_ALLOCATION_BYTES = 128 * 1024
"""Allocations of at least this many bytes get their own mapping (:func:`bound_malloc`)."""


def bound_malloc(arenas: int = 2) -> dict[str, int]:
    """Keep a long-running worker's C heap from holding freed memory (glibc ``mallopt``;
    nothing elsewhere): at most ``arenas`` malloc arenas, and a fixed mmap threshold, so
    every allocation of :data:`LARGE_ALLOCATION_BYTES` or more is its own mapping that
    ``free`` returns to the system. glibc's default raises the threshold each time such a
    block is freed (up to 32 MiB), after which large short-lived buffers (a chunk's
    packed routes, a changelog batch) come from the arenas and their free lists stay
    resident; with 8 arenas per core, each thread (RocksDB's, librdkafka's) keeps its
    own. Call before the worker starts its threads. Returns the settings applied (empty
    where the C library has no ``mallopt``)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = {}
    for name, option, value in (("arena_max", M_ARENA_MAX, arenas),
                                ("mmap_threshold_bytes", M_MMAP_THRESHOLD,
                                 LARGE_ALLOCATION_BYTES)):
        if mallopt(option, value) == 1:
            applied[name] = value
    return applied
