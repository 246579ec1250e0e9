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



M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
LARGE_ALLOCATION_BYTES = 4 * 1024 * 1024
"""Allocations of at least this many bytes get their own mapping (:func:`bound_malloc`)."""
KEPT_FREE_TOP_BYTES = 8 * 1024 * 1024
"""Free memory at the top of a heap beyond this is returned to the system."""


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``): in
    every arena and inside the heaps, not only at their tops, so memory freed between
    live blocks (fragmentation) stops counting as resident. A long-running worker calls
    it on a timer (:func:`bound_malloc` bounds the rest). True when memory was
    released; False when none was, or where the C library has no ``malloc_trim``."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))


def bound_malloc(arenas: int = 2) -> dict[str, int]:
    """Keep a long-running worker's C heap from holding freed memory (glibc ``mallopt``;
    nothing elsewhere): at most ``arenas`` malloc arenas, a fixed mmap threshold (every
    allocation of ``mmap_threshold`` bytes or more is its own mapping that ``free``
    returns to the system) and a fixed trim threshold (free memory above
    ``trim_threshold`` at the top of a heap goes back too). glibc's default raises
    both each time a mapped block is freed (the mmap threshold up to 32 MiB), after
    which large short-lived buffers come from the arenas and their free lists stay
    resident; with 8 arenas per core, each thread (RocksDB's, librdkafka's) keeps its
    own.

    Why the thresholds are MiBs and not glibc's initial 128 KiB: a fixed threshold
    also stops glibc from raising the trim threshold, and a worker's everyday buffers
    (a chunk's packed routes, ~370 KB, copied a few times per record; a fetch
    response) would each be mapped, or grow and trim the heap top, and be zero-filled
    page by page: measured, one 365 KB copy took 110 us instead of 2 us, and the worker
    used 10 to 25 % more CPU per observation (``bench/streams.py``, alternated). The
    thresholds are :data:`LARGE_ALLOCATION_BYTES` and :data:`KEPT_FREE_TOP_BYTES`.
    Call before the worker starts its
    threads. Returns the settings applied (empty where the C library has no
    ``mallopt``)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = {}
    for name, option, value in (
            ("arena_max", M_ARENA_MAX, arenas),
            ("mmap_threshold_bytes", M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES),
            ("trim_threshold_bytes", M_TRIM_THRESHOLD, KEPT_FREE_TOP_BYTES)):
        if mallopt(option, value) == 1:
            applied[name] = value
    return applied
