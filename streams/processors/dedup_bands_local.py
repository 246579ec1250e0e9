"""The band-partitioned dedup stage in one process (:mod:`streams.processors.dedup_bands`).

Every band and home partition runs here, joined by first-in-first-out channels like one
producer's records on one Kafka partition; :meth:`InProcessBands.run` delivers them in
the order a random generator draws (round-robin without one), so tests can try many
interleavings against the one-partition stage, and a bench can weigh each partition's
share of the work.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from hebrus_flywheel.streams.processors.dedup import DedupConfig
from hebrus_flywheel.streams.processors.dedup_bands import (
    BandPartition,
    BandRouter,
    HomePartition,
    Mark,
    home_of,
)
from hebrus_flywheel.streams.processors.split import SplitConfig

Node = tuple[str, int]  # ("capture" | "band" | "home", partition)


class InProcessBands:
    """Every partition of the stage in one process. ``stores``: one mapping per role
    (``"band"``, ``"home"``) shared by its partitions, like a worker's tables; pass the
    same ones to a new instance to resume where this one stopped."""

    def __init__(self, *, split_config: SplitConfig, dedup_config: DedupConfig,
                 capture_partitions: int, band_partitions: int, home_partitions: int,
                 rng: np.random.Generator | None = None,
                 stores: Mapping[str, MutableMapping[str, Any]] | None = None,
                 home_capture_marks: bool = True) -> None:
        stores = stores or {"band": {}, "home": {}}
        self.router = BandRouter(dedup_config, band_partitions=band_partitions,
                                 home_partitions=home_partitions)
        self.bands = [BandPartition(dedup_config, band=b, capture_partitions=capture_partitions,
                                    store=stores["band"]) for b in range(band_partitions)]
        self.homes = [HomePartition(home=h, split_config=split_config,
                                    dedup_config=dedup_config,
                                    capture_partitions=capture_partitions
                                    if home_capture_marks else 0,
                                    band_partitions=band_partitions, store=stores["home"])
                      for h in range(home_partitions)]
        self.rng = rng
        self.home_capture_marks = home_capture_marks
        self._channels: dict[tuple[Node, Node], list[tuple[str, Any]]] = {}
        self._band_sent: dict[int, float] = {}
        self.decisions: list[dict[str, Any]] = []

    def _send(self, src: Node, dst: Node, kind: str, payload: Any) -> None:
        self._channels.setdefault((src, dst), []).append((kind, payload))

    def summary(self, capture_partition: int, summary: Mapping[str, Any]) -> None:
        """What a capture partition sends when it completes a generation."""
        src = ("capture", capture_partition)
        self._send(src, ("home", home_of(summary, len(self.homes))), "summary", summary)
        for band, probe in self.router.probes(summary).items():
            self._send(src, ("band", band), "probe", probe)

    def mark(self, capture_partition: int, at: Mark) -> None:
        """A capture partition's mark, to every band and home partition; without
        ``home_capture_marks``, to the band partitions only, once the homes have the
        partition's summaries (as the worker waits for their delivery)."""
        src = ("capture", capture_partition)
        homes = [("home", h) for h in range(len(self.homes))]
        if not self.home_capture_marks:
            for home in homes:
                for kind, payload in self._channels.pop((src, home), []):
                    self._at_home(home[1], kind, payload)
            homes = []
        for dst in [("band", b) for b in range(len(self.bands))] + homes:
            self._send(src, dst, "mark", (capture_partition, at))

    def run(self) -> list[dict[str, Any]]:
        """Deliver every record; the decisions made, in the order made."""
        turn = 0
        while live := [c for c, queue in self._channels.items() if queue]:
            channel = live[int(self.rng.integers(len(live))) if self.rng else turn % len(live)]
            turn += 1
            kind, payload = self._channels[channel].pop(0)
            (_, _), (role, index) = channel
            if role == "band":
                self._at_band(index, kind, payload)
            else:
                self._at_home(index, kind, payload)
        return self.decisions

    def _at_band(self, index: int, kind: str, payload: Any) -> None:
        band, src = self.bands[index], ("band", index)
        if kind == "probe":
            for pair in band.probe(payload):
                for home in {pair.earlier_home, pair.later_home}:
                    self._send(src, ("home", home), "pair", pair)
            return
        band.mark(*payload)
        watermark = band.watermark()
        if self._band_sent.get(index) != watermark:
            self._band_sent[index] = watermark
            for home in range(len(self.homes)):
                self._send(src, ("home", home), "band_mark", (index, watermark))

    def _at_home(self, index: int, kind: str, payload: Any) -> None:
        home = self.homes[index]
        if kind == "summary":
            home.summary(payload)
        elif kind == "pair":
            home.pair(payload)
        elif kind == "notice":
            home.notice(payload)
        elif kind == "mark":
            home.capture_mark(*payload)
        else:
            home.band_mark(*payload)
        decisions, notices = home.step()
        self.decisions.extend(decisions)
        for notice in notices:
            self._send(("home", index), ("home", notice.home), "notice", notice)
