"""Per-stage counters and timers in the datatrove style: ``stage/name -> count``.

Every stage of every worker counts with this one type, so the CLI, the benches and the
tests read the same names (``validate/quarantined``, ``intake/accepted``, ...).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class Counters:
    """Event counts and accumulated wall seconds per stage."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def inc(self, stage: str, name: str, amount: int = 1) -> None:
        self.counts[f"{stage}/{name}"] += amount

    def get(self, stage: str, name: str) -> int:
        return self.counts.get(f"{stage}/{name}", 0)

    def stage(self, stage: str) -> dict[str, int]:
        """The counts of one stage, without the stage prefix."""
        prefix = f"{stage}/"
        return {k[len(prefix):]: v for k, v in sorted(self.counts.items())
                if k.startswith(prefix)}

    def merge(self, other: Mapping[str, int]) -> None:
        self.counts.update(other)

    @contextmanager
    def timer(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def as_dict(self) -> dict[str, int]:
        """Counts only, sorted by name."""
        return dict(sorted(self.counts.items()))

    def report(self) -> dict[str, object]:
        """Counts and seconds, for logs and JSON summaries."""
        return {"counts": self.as_dict(),
                "seconds": {k: round(v, 3) for k, v in sorted(self.seconds.items())}}
