"""The worker's band-partitioned dedup (``--dedup-bands``): agents around
:mod:`streams.processors.dedup_bands`.

Topology (``N`` partitions each, like the capture topics)::

    capture agent ──▶ homes (each summary, to its thread's home; per batch, its marks
                             to every home)
                 └──▶ bands (per batch, one record per band partition: the summaries
                             one of whose bucket keys it holds, and the batch's marks)
    band agent (table ``dedup-bands``) ──▶ homes (per batch, one record per home: the
                                                  pairs either member of which lives
                                                  there, and the watermarks that moved)
    home agent (table ``dedup-homes``) ──▶ decisions (as the one-partition agent)
                                      └──▶ homes (notices, to subscribers' homes)

Every record a partition depends on comes from one producer per source partition and
batch, in order: a capture batch sends its summaries, then its probes and marks; a band
batch sends its pairs before the watermarks that cover them. A home decides a generation
once both the capture marks it got and the band watermarks are past its end, so it has
the generation's summary and every pair of it by then; a mark that must hold again
reaches the homes before the batch's summaries do. A summary on
either topic is the same sealed record (its digest and signature sealed under the
owner's key); pairs and notices name generations by id and carry no content.

All workers of one app id must use the same dedup layout.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.streams.owner_seal import Erased, OwnerSealer, open_fields
from hebrus_flywheel.streams.processors.batches import handling, run_batches
from hebrus_flywheel.streams.processors.decision_order import HOLD_MS
from hebrus_flywheel.streams.processors.dedup import DedupConfig
from hebrus_flywheel.streams.processors.dedup_bands import (
    BandPartition,
    BandRouter,
    HomePartition,
    Notice,
    Pair,
    Probe,
    home_of,
)
from hebrus_flywheel.streams.processors.exceptions import WorkerError
from hebrus_flywheel.streams.processors.split import SplitConfig
from hebrus_flywheel.streams.processors.write_cache import WriteCache

BAND_TABLE = "dedup-bands"
HOME_TABLE = "dedup-homes"
MAX_PROBES_PER_RECORD = 128
"""Most summaries in one bands-topic record (~1.5 KB each, sealed)."""
PROBE_CACHE = 1024
"""Summaries whose probes a worker's band agent keeps (a few KB each)."""

SendDecisions = Callable[[list[dict[str, Any]]], Awaitable[list[Any]]]
Skipped = Callable[[Any], Awaitable[bool]]


def _at(watermark: float) -> int | None:
    """A band watermark on the wire: None passes everything, HOLD_MS holds everything."""
    if watermark == float("inf"):
        return None
    return HOLD_MS if watermark == float("-inf") else int(watermark)


class BandDedup:
    """One worker's share of the band-partitioned dedup stage."""

    def __init__(self, *, app: Any, homes_topic: Any, bands_topic: Any, partitions: int,
                 split_config: SplitConfig, dedup_config: DedupConfig, sealer: OwnerSealer,
                 counters: Counters, band_table: WriteCache, home_table: WriteCache,
                 send_decisions: SendDecisions, skipped_poison: Skipped) -> None:
        self.app, self.partitions, self.counters = app, partitions, counters
        self.homes_topic, self.bands_topic = homes_topic, bands_topic
        self.split_config, self.dedup_config, self.sealer = split_config, dedup_config, sealer
        self.band_table, self.home_table = band_table, home_table
        self.send_decisions, self.skipped_poison = send_decisions, skipped_poison
        self.router = BandRouter(dedup_config, band_partitions=partitions,
                                 home_partitions=partitions)
        self._bands: dict[int, BandPartition] = {}
        self._homes: dict[int, HomePartition] = {}
        self._probes: dict[int, list[bytes]] = {}  # this capture batch's, by band partition
        self._band_sent: dict[int, int | None] = {}
        self._marks_out: dict[int, int | None] = {}  # and its marks
        self._in_batch = False
        self._opened: dict[str, dict[int, Probe]] = {}  # recent summaries' probes

    # -- the capture agent's side -------------------------------------------------

    async def send_summary(self, summary: Mapping[str, Any], sealed: bytes, key: bytes) -> Any:
        """Send a completed generation to its home; hold its probes for the batch's end."""
        hashvalues = np.asarray(summary["minhash"], dtype=np.uint32)
        for band in self.router.keys_by_partition(summary, hashvalues):  # no probes yet
            self._probes.setdefault(band, []).append(sealed)
        return await self.homes_topic.send(key=key, value=sealed,
                                           partition=home_of(summary, self.partitions))

    def batch_started(self) -> None:
        """From here to :meth:`flush_batch`, marks wait to go out with the probes."""
        self._in_batch = True

    async def flush_batch(self) -> list[Any]:
        """A capture batch's probes and marks, one record per band partition, and its
        marks, one record per home (after the batch's summaries on that home)."""
        self._in_batch = False
        probes, self._probes = self._probes, {}
        marks, self._marks_out = self._marks_out, {}
        deliveries = []
        for band in range(self.partitions):
            items = probes.get(band, [])
            chunks = [items[i:i + MAX_PROBES_PER_RECORD]
                      for i in range(0, len(items), MAX_PROBES_PER_RECORD)] or [[]]
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                if not chunk and not (last and marks):
                    continue
                tail = json.dumps(sorted(marks.items()) if last else []).encode()
                value = b'{"summaries":[' + b",".join(chunk) + b'],"marks":' + tail + b"}"
                deliveries.append(await self.bands_topic.send(key=b"probes", value=value,
                                                              partition=band))
        if marks:
            value = json.dumps({"marks": sorted(marks.items())}).encode()
            deliveries += [await self.homes_topic.send(key=b"marks", value=value, partition=h)
                           for h in range(self.partitions)]
        return deliveries

    async def send_mark(self, capture_partition: int, at: int | None) -> list[Any]:
        """A capture partition's mark, to every band and home partition: with the batch's
        probes, or at once (a mark that must hold again before the batch's summaries go
        out: a home that had passed everything would decide them before their pairs)."""
        if self._in_batch:
            self._marks_out[capture_partition] = at
            return []
        marks = [[capture_partition, at]]
        to_bands = json.dumps({"summaries": [], "marks": marks}).encode()
        to_homes = json.dumps({"marks": marks}).encode()
        return [await topic.send(key=b"mark", value=value, partition=p)
                for topic, value in ((self.bands_topic, to_bands), (self.homes_topic, to_homes))
                for p in range(self.partitions)]

    # -- the band agent -----------------------------------------------------------

    async def band_agent(self, stream: Any, on_cpu: Callable[[int], None]) -> None:
        await run_batches(stream, self._band_batch, on_cpu)

    async def _band_batch(self, events: list[Any]) -> list[Any]:
        """A batch of probes and marks, then one record per home: the batch's pairs with
        either member there, then the band watermarks that moved."""
        by_home: dict[int, list[list[Any]]] = {}
        touched: set[int] = set()
        for event in events:
            with handling(event):
                if not await self.skipped_poison(event.message):
                    touched.add(self._band_one(event.message, by_home))
        self.band_table.flush()
        moved = []
        for partition in sorted(touched):
            at = _at(self._band(partition).watermark())
            if self._band_sent.get(partition, HOLD_MS - 1) != at:
                self._band_sent[partition] = at
                moved.append([partition, at])
        return [await self.homes_topic.send(
                    key=b"bands", value=json.dumps({"pairs": by_home.get(home, []),
                                                    "bands": moved}).encode(), partition=home)
                for home in range(self.partitions) if moved or by_home.get(home)]

    def _band(self, partition: int) -> BandPartition:
        band = self._bands.get(partition)
        if band is None:
            band = self._bands[partition] = BandPartition(
                self.dedup_config, band=partition, capture_partitions=self.partitions,
                store=self.band_table)
        return band

    def _band_one(self, msg: Any, by_home: dict[int, list[list[Any]]]) -> int:
        wire = json.loads(msg.value)
        band = self._band(int(msg.partition))
        for sealed in wire["summaries"]:
            probes = self._probes_of(sealed)
            if probes is None:
                self.counters.inc("sealing", "erased_summaries")
                continue
            probe = probes.get(band.band)
            if probe is None:
                raise WorkerError(f"a summary of {sealed['iid']!r} reached band partition "
                                  f"{band.band}, which none of its bucket keys maps to")
            for pair in band.probe(probe):
                for home in {pair.earlier_home, pair.later_home}:
                    by_home.setdefault(home, []).append(_pair_wire(pair))
        for capture_partition, at in wire["marks"]:
            band.mark(int(capture_partition), at)
        return band.band

    def _probes_of(self, sealed: Mapping[str, Any]) -> dict[int, Probe] | None:
        """A summary's probes by band partition (None: its owner was erased). One worker
        often holds several of a summary's band partitions and reads it once for each, in
        records close together: the last ``PROBE_CACHE`` summaries are opened once."""
        iid = str(sealed["iid"])
        probes = self._opened.get(iid)
        if probes is None:
            summary = open_fields(sealed, self.sealer, context=iid)
            if isinstance(summary, Erased):
                return None
            probes = self._opened[iid] = self.router.probes(summary)
            if len(self._opened) > PROBE_CACHE:
                del self._opened[next(iter(self._opened))]
        return probes

    # -- the home agent -----------------------------------------------------------

    async def home_agent(self, stream: Any, on_cpu: Callable[[int], None]) -> None:
        await run_batches(stream, self._home_batch, on_cpu)

    async def _home_batch(self, events: list[Any]) -> list[Any]:
        """A batch of home records, then each touched home decides what it can (as its
        last record: faust writes a table in the current event's partition)."""
        last: dict[int, Any] = {}
        for event in events:
            with handling(event):
                if not await self.skipped_poison(event.message):
                    self._home_one(event.message)
                    last[int(event.message.partition)] = event
        deliveries: list[Any] = []
        notices: dict[int, list[list[Any]]] = {}
        for partition, event in sorted(last.items()):
            with handling(event):
                decisions, told = self._home(partition).step()
            deliveries += await self.send_decisions(decisions)
            for n in told:
                notices.setdefault(n.home, []).append([n.iid, n.start, n.keep, n.split])
        self.home_table.flush()
        for target, items in sorted(notices.items()):
            deliveries.append(await self.homes_topic.send(
                key=b"notices", value=json.dumps({"notices": items}).encode(), partition=target))
        return deliveries

    def _home(self, partition: int) -> HomePartition:
        home = self._homes.get(partition)
        if home is None:
            home = self._homes[partition] = HomePartition(
                home=partition, split_config=self.split_config, dedup_config=self.dedup_config,
                capture_partitions=self.partitions, band_partitions=self.partitions,
                store=self.home_table, counters=self.counters)
        return home

    def _home_one(self, msg: Any) -> None:
        wire = json.loads(msg.value)
        home = self._home(int(msg.partition))
        if "iid" in wire:
            summary = open_fields(wire, self.sealer, context=str(wire["iid"]))
            if isinstance(summary, Erased):
                self.counters.inc("sealing", "erased_summaries")  # no decision: erased
                return
            home.summary(summary)
        elif "pairs" in wire:
            for item in wire["pairs"]:
                home.pair(_pair_of(item))
            for band, at in wire["bands"]:
                home.band_mark(int(band), float("inf") if at is None else float(at))
        elif "marks" in wire:
            for capture_partition, at in wire["marks"]:
                home.capture_mark(int(capture_partition), at)
        elif "notices" in wire:
            for iid, start, keep, split in wire["notices"]:
                home.notice(Notice(home=home.home, iid=iid, start=start, keep=keep, split=split))
        else:
            raise WorkerError(f"{msg.topic}[{msg.partition}]@{msg.offset} is no summary, "
                              "marks, pairs and band marks, or notices")

    # -- rebalances ---------------------------------------------------------------

    def reset(self, assignment: Any) -> None:
        """After a rebalance: what is in memory is read from the tables again, now for the
        home partitions assigned here (the drain waits for what they hold)."""
        self._bands.clear()
        self._homes.clear()
        self._band_sent.clear()
        self._probes.clear()
        self._marks_out.clear()
        self._in_batch = False
        for tp in assignment:
            if tp.topic == self.homes_topic.get_topic_name():
                self._home(int(tp.partition)).watermark()  # loads it

    @property
    def held(self) -> int:
        """Generations waiting in this worker's homes."""
        return sum(home.held for home in self._homes.values())


def _pair_wire(pair: Pair) -> list[Any]:
    return [pair.earlier, pair.earlier_home, list(pair.earlier_order), pair.earlier_start,
            pair.later, pair.later_home, pair.exact, pair.near]


def _pair_of(item: list[Any]) -> Pair:
    earlier, earlier_home, (end, iid), start, later, later_home, exact, near = item
    return Pair(earlier=earlier, earlier_home=int(earlier_home), earlier_order=(int(end), iid),
                earlier_start=int(start), later=later, later_home=int(later_home),
                exact=bool(exact), near=bool(near))
