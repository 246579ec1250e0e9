"""Which shard (block) each source offset belongs to: a pure function of offsets.

Design. Offsets of one (topic, partition) are cut into *blocks*:

* epoch ``N`` covers ``[start_N[p], end_N[p])`` where ``end_N`` are the partition end
  offsets that ``flywheel seal --epoch N`` recorded on the control topic and
  ``start_N = end_{N-1}`` (0 for epoch 0); offsets at or after the last recorded end
  belong to the *open* epoch;
* inside an epoch, block ``b`` covers ``[b*S, (b+1)*S)`` clipped to the epoch, where
  ``S`` is ``ShardConfig.offsets_per_shard``.

So a block, and the shard written from it, depends only on the offsets, ``S`` and the
recorded boundaries, never on poll timing, batch arrival or worker restarts. A rebuild
that knows ``start_N``/``end_N`` (both are in the manifest) recomputes the same blocks.

A block of the open epoch is *tentative*: a later seal may cut it. Workers close such a
block only after re-reading the control topic and finding no pending seal intent
(:mod:`consumers.control` explains why that makes the cut race-free).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hebrus_flywheel.consumers.exceptions import ControlError

Offsets = Mapping[str, Mapping[int, int]]
"""topic -> partition -> offset."""


def freeze_offsets(offsets: Mapping[str, Mapping[Any, int]]) -> Offsets:
    """A read-only copy with integer partitions (JSON gives string keys)."""
    return MappingProxyType({
        str(t): MappingProxyType({int(p): int(o) for p, o in parts.items()})
        for t, parts in offsets.items()
    })


def offsets_json(offsets: Offsets) -> dict[str, dict[str, int]]:
    """JSON-ready copy: sorted topics, partitions as decimal strings in numeric order."""
    return {t: {str(p): offsets[t][p] for p in sorted(offsets[t])} for t in sorted(offsets)}


@dataclass(frozen=True, kw_only=True)
class EpochBoundary:
    """The offset range of one sealed epoch, per window topic partition.

    ``capture_end`` holds the capture topics' end offsets, read right after ``end``:
    every window below ``end`` was cut from capture records below ``capture_end``
    (``flywheel rebuild --from-capture`` regenerates the windows from them). Empty for
    boundaries recorded before it existed.
    """

    epoch: int
    start: Offsets = field(hash=False)
    end: Offsets = field(hash=False)
    capture_end: Offsets = field(hash=False, default_factory=lambda: MappingProxyType({}))

    def start_of(self, topic: str, partition: int) -> int:
        return self.start.get(topic, {}).get(partition, 0)

    def end_of(self, topic: str, partition: int) -> int:
        """End offset (exclusive); a partition the seal did not list ends where it starts."""
        return self.end.get(topic, {}).get(partition, self.start_of(topic, partition))


@dataclass(frozen=True, kw_only=True)
class Block:
    """Source offsets ``[first, end)`` of one (topic, partition) that form one shard.

    ``final`` is False for a block of the open epoch (a later seal may still cut it).
    """

    topic: str
    partition: int
    epoch: int
    first: int
    end: int
    final: bool

    @property
    def last(self) -> int:
        return self.end - 1


class EpochPlan:
    """Block arithmetic over the boundaries known so far (epochs ``0..M`` in order)."""

    def __init__(self, offsets_per_shard: int, boundaries: Sequence[EpochBoundary] = ()) -> None:
        if offsets_per_shard < 1:
            raise ControlError(f"offsets_per_shard must be >= 1, got {offsets_per_shard}")
        self.size = offsets_per_shard
        self.boundaries = tuple(boundaries)
        for i, b in enumerate(self.boundaries):
            if b.epoch != self.boundaries[0].epoch + i:
                raise ControlError(
                    f"epoch boundaries must be consecutive; got {[x.epoch for x in boundaries]}"
                )

    @property
    def open_epoch(self) -> int:
        return self.boundaries[-1].epoch + 1 if self.boundaries else 0

    def open_start(self, topic: str, partition: int) -> int:
        return self.boundaries[-1].end_of(topic, partition) if self.boundaries else 0

    def block(self, topic: str, partition: int, offset: int) -> Block:
        """The block holding ``offset``; ControlError for an offset before the first epoch."""
        for b in self.boundaries:
            start, end = b.start_of(topic, partition), b.end_of(topic, partition)
            if offset < start:
                raise ControlError(
                    f"offset {offset} of {topic}[{partition}] precedes epoch {b.epoch} "
                    f"(starts at {start}); it belongs to an epoch this plan does not hold"
                )
            if offset < end:
                first = max(start, offset - offset % self.size)
                return Block(topic=topic, partition=partition, epoch=b.epoch, first=first,
                             end=min(end, first - first % self.size + self.size), final=True)
        start = self.open_start(topic, partition)
        if offset < start:
            raise ControlError(f"offset {offset} of {topic}[{partition}] precedes the plan")
        first = max(start, offset - offset % self.size)
        return Block(topic=topic, partition=partition, epoch=self.open_epoch, first=first,
                     end=first - first % self.size + self.size, final=False)
