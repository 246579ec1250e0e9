"""core.processes.bound_malloc: large buffers are their own mappings, returned on free;
everyday buffers (a chunk's packed routes) stay in the heap, not mapped and zero-filled
on every use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes
    from hebrus_flywheel.core.processes import _MallInfo2, bound_malloc
    if {bound}:
        assert bound_malloc() == {{"arena_max": 2, "mmap_threshold_bytes": 4 << 20,
                                  "trim_threshold_bytes": 8 << 20}}
    info = ctypes.CDLL(None).mallinfo2
    info.restype = _MallInfo2
    mapped = []
    for _ in range(3):
        before = info().hblkhd
        buffer = bytearray({size})  # freed at the next iteration
        mapped.append(info().hblkhd - before >= {size})
        del buffer
    print(mapped)
""")


def _mapped(bound: bool, size: int = 8 << 20) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(bound=bound, size=size)],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_every_large_buffer_is_mapped_with_the_bound_and_not_without() -> None:
    assert _mapped(True) == "[True, True, True]"
    # glibc's own dynamic threshold: after the first mapped block is freed it rises
    # above its size, and the same buffer comes from the heap from then on
    assert _mapped(False) == "[True, False, False]"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_a_buffer_under_the_threshold_comes_from_the_heap_with_the_bound() -> None:
    # a 128 KiB threshold mapped these (and zero-filled them page by page on each use)
    assert _mapped(True, size=1 << 20) == "[False, False, False]"
