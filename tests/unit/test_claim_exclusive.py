"""core.files.claim_exclusive: one holder of a directory at a time, released on exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hebrus_flywheel.core.files import claim_exclusive


def test_a_second_claim_is_refused_until_the_first_is_released(tmp_path: Path) -> None:
    lock = tmp_path / "data" / "worker.lock"
    first = claim_exclusive(lock)
    assert first is not None
    assert claim_exclusive(lock) is None  # another open file: refused, even in-process
    first.close()
    again = claim_exclusive(lock)
    assert again is not None
    again.close()


def test_a_killed_holder_releases_the_claim(tmp_path: Path) -> None:
    lock = tmp_path / "worker.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path;"
         "from hebrus_flywheel.core.files import claim_exclusive;"
         f"fh = claim_exclusive(Path({str(lock)!r})); print(fh is not None, flush=True);"
         "time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        assert claim_exclusive(lock) is None
    finally:
        holder.kill()
        holder.wait()
    claimed = claim_exclusive(lock)
    assert claimed is not None
    claimed.close()
