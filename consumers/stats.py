"""Per-stage counters and timers in the datatrove style (``stage/name``)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class Stats:
    """Event counts and accumulated wall seconds per stage, e.g. ``intake/accepted``."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def inc(self, stage: str, name: str, amount: int = 1) -> None:
        self.counts[f"{stage}/{name}"] += amount

    def get(self, stage: str, name: str) -> int:
        return self.counts.get(f"{stage}/{name}", 0)

    @contextmanager
    def timer(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def as_dict(self) -> dict[str, object]:
        return {
            "counts": dict(sorted(self.counts.items())),
            "seconds": {k: round(v, 3) for k, v in sorted(self.seconds.items())},
        }
