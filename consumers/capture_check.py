"""``flywheel rebuild --from-capture``: regenerate the snapshot's windows from the capture topics.

An additive check on top of :mod:`consumers.rebuild`, driven by what the seal recorded in
the manifest's ``source.capture``:

* ``end``: the capture topics' end offsets, read right after the window topics' ends;
  only capture records below them are read, so later capture never changes a rebuild;
* ``streams_runs``: every streams worker start (:mod:`streams.processors.runs`) with its
  full processor configuration and the capture offsets it started from. They cut the
  capture topics into segments, and each segment runs through the stream processors'
  in-memory chain (:class:`streams.processors.pipeline.LocalPipeline`) with its own
  configuration, the state carried over, as the restarted worker carried its tables.

Completed threads reach the split and dedup stage in the order the worker's dedup agent
decided them, replayed from its threads topic (``<app id>-threads-v1``, kept forever:
the summaries and the capture partitions' marks, in the order the agent read them):
near-duplicate decisions are first-come, and a generation decided on arrival, not in
event-time order, followed timing. Workers that ran the band-partitioned dedup
(``--dedup-bands``) decided in event-time order at their home partitions: the chain
repeats that order from the capture partitions' marks (:func:`decision_order`).
Everything else is computed afresh.
Then every record of the snapshot's window topics (offset 0 up to
the manifest's end offsets) must be regenerated with the same ``window_id`` and
``content_digest``, and the replay uses those fresh windows in the recorded window-topic
offset order: at-least-once delivery may repeat a window on the topic, so which offset
holds which window is taken from the topic, never recomputed.

Capture records are read identities first, then transcripts and observations in
partition-interleaved order (the order within a partition is the topic's), with the
records' own timestamps as processing time, and a last idle tick past the idle timeout
completes the threads the worker completed on idle.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hebrus_flywheel.consumers.exceptions import RebuildError
from hebrus_flywheel.consumers.intake import WINDOW_SCHEMA
from hebrus_flywheel.consumers.kafka_io import end_offsets, read_ranges
from hebrus_flywheel.core.privacy import OwnerKeyDestroyedError
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.exceptions import SchemaError
from hebrus_flywheel.streams.processors.decision_order import decision_sequence
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline
from hebrus_flywheel.streams.processors.runs import StreamsRun, StreamsRunError
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.processors.window_seal import (
    OwnerSealer,
    default_sealer,
    encode_window,
)

_SHOWN = 10
Ranges = dict[tuple[str, int], tuple[int, int]]


@dataclass
class FreshWindows:
    """Windows regenerated from the capture topics, by window id, with their encodings."""

    capture_end_offsets: dict[str, dict[int, int]]
    config_digests: set[str]
    segments: int = 0
    windows: dict[str, dict[str, Any]] = field(default_factory=dict)
    encoded: dict[str, bytes] = field(default_factory=dict)
    conflicting: list[str] = field(default_factory=list)

    sealer: OwnerSealer = field(default_factory=default_sealer)
    erased: int = 0
    """Regenerated windows of owners erased since: they cannot be sealed again."""

    def add(self, window: Mapping[str, Any]) -> None:
        """One plaintext window of the in-memory chain, sealed as the worker seals it."""
        try:
            value, record = encode_window(window, self.sealer)
        except OwnerKeyDestroyedError:
            self.erased += 1
            return
        wid = record["window_id"]
        known = self.windows.get(wid)
        if known is not None:
            if known["content_digest"] != record["content_digest"]:
                self.conflicting.append(wid)
            return
        self.windows[wid] = record
        self.encoded[wid] = value


@dataclass(frozen=True)
class Segment:
    """Capture offsets ``ranges`` processed by one streams configuration."""

    run: StreamsRun
    ranges: Ranges


def recorded_runs(capture: Mapping[str, Any]) -> list[StreamsRun]:
    """The manifest's streams runs, all of one app id (RebuildError otherwise)."""
    try:
        runs = [StreamsRun.from_json(r) for r in capture.get("streams_runs", [])]
    except StreamsRunError as exc:
        raise RebuildError(f"the manifest's streams runs are unreadable: {exc}") from exc
    apps = sorted({r.app_id for r in runs})
    if len(apps) != 1:
        raise RebuildError(
            "--from-capture needs the streams runs of exactly one worker group, the manifest "
            f"records {apps or 'none'}; windows of several groups (or of workers older than "
            "run records) cannot be regenerated — rebuild without --from-capture"
        )
    return runs


def segments(runs: Sequence[StreamsRun], end: Mapping[str, Mapping[int, int]]) -> list[Segment]:
    """Cut ``[0, end)`` of every capture partition into one segment per configuration.

    Consecutive runs with the same configuration form one segment, which starts where
    its first run started (the first segment at 0: a group's first run starts where
    nothing was committed); a run that started past ``end`` gets an empty segment."""
    merged = [r for i, r in enumerate(runs) if i == 0 or r.config_id != runs[i - 1].config_id]
    starts = [{(t, int(p)): 0 if i == 0 else _start(run, t, p)
               for t, parts in end.items() for p in parts} for i, run in enumerate(merged)]
    _check_no_reset(runs, list(starts[0]))
    out = []
    for i, run in enumerate(merged):
        ranges: Ranges = {}
        for (topic, p), first in starts[i].items():
            stop = int(end[topic][p])
            last = stop if i + 1 == len(merged) else min(stop, starts[i + 1][(topic, p)])
            ranges[(topic, p)] = (min(first, stop), last)
        out.append(Segment(run=run, ranges=ranges))
    return out


def _check_no_reset(runs: Sequence[StreamsRun], partitions: Sequence[tuple[str, int]]) -> None:
    """A configuration change must start at or after everything any earlier run started
    from; else the group's offsets were reset and the owner of those records is unknown."""
    reached = {tp: 0 for tp in partitions}
    for i, run in enumerate(runs):
        if i and run.config_id != runs[i - 1].config_id:
            back = [tp for tp in partitions if _start(run, *tp) < reached[tp]]
            if back:
                (topic, p) = back[0]
                raise RebuildError(
                    f"streams run {run.run_id} starts {topic}[{p}] at {_start(run, topic, p)}, "
                    f"before an earlier run of another configuration (at {reached[back[0]]}): "
                    "the group's offsets were reset between configurations, so which one "
                    "processed those records is unknown; rebuild without --from-capture"
                )
        for tp in partitions:
            reached[tp] = max(reached[tp], _start(run, *tp))


def _start(run: StreamsRun, topic: str, partition: int) -> int:
    return int(run.capture_start.get(topic, {}).get(int(partition), 0))


def release_order(bootstrap: str, app_id: str, prefix: str) -> list[str]:
    """Thread generation ids in the order the worker group's dedup agent decided them:
    replayed from its threads topic (summaries and the capture partitions' marks,
    :func:`streams.processors.decision_order.decision_sequence`); a topic without marks
    (workers before event-time order) was decided in the order it was read."""
    topics = _streams_topics(app_id, prefix)
    records = []
    for msg in read_topic(bootstrap, topics.threads):
        try:
            record = json.loads(msg.value() or b"")
            str(record["mark"] if "mark" in record else record["iid"])
        except (ValueError, KeyError, TypeError) as exc:
            raise RebuildError(f"{topics.threads}@{msg.offset()} is no thread summary nor mark "
                               f"({exc}); the streams internal topic is corrupt") from exc
        records.append(record)
    if not any("mark" in r for r in records):
        return [str(r["iid"]) for r in records]
    return decision_sequence(records, _capture_partitions(bootstrap, topics))


def _streams_topics(app_id: str, prefix: str) -> StreamTopics:
    if not app_id.startswith(prefix):
        raise RebuildError(f"streams app {app_id} does not use the topic prefix {prefix!r}")
    return StreamTopics.from_prefix(prefix, app_id[len(prefix):])


def _capture_partitions(bootstrap: str, topics: StreamTopics) -> int:
    # the partition count from the end offsets: the rebuild role reads the capture
    # topics but may not describe their configs
    partitions = end_offsets(bootstrap, [topics.transcripts], error=RebuildError)
    return len(partitions[topics.transcripts])


def decision_order(bootstrap: str, runs: Sequence[StreamsRun], prefix: str) -> dict[str, Any]:
    """How the in-memory chain orders its dedup decisions, as the worker group did.

    One-partition dedup: the recorded order (:func:`release_order`). Band-partitioned
    dedup (``streams worker --dedup-bands``): its homes decide in event-time order, which
    the chain repeats from the capture partitions' marks (``event_order``); a summary the
    homes decided late (``dedup/late_summaries`` in the worker's counters) may have been
    decided otherwise, and then its windows are reported as not regenerated."""
    layouts = {run.processor_config().dedup.band_partitioned for run in runs}
    if len(layouts) > 1:
        raise RebuildError(
            "the snapshot's streams runs mix the one-partition and the band-partitioned "
            "dedup (streams worker --dedup-bands): their decision orders cannot be replayed "
            "as one; rebuild without --from-capture")
    if layouts == {True}:
        topics = _streams_topics(runs[0].app_id, prefix)
        return {"event_order": _capture_partitions(bootstrap, topics)}
    return {"release_order": release_order(bootstrap, runs[0].app_id, prefix)}


def _messages(bootstrap: str, topics: Mapping[str, str], ranges: Ranges,
              timeout_s: float) -> Iterator[tuple[str, Any]]:
    by_name = {name: kind for kind, name in topics.items()}
    for group in (("identities",), ("transcripts", "observations")):
        names = {topics[k] for k in group}
        part = {tp: r for tp, r in ranges.items() if tp[0] in names}
        for msg in read_ranges(bootstrap, part, timeout_s=timeout_s, error=RebuildError):
            yield by_name[msg.topic()], msg


def regenerate(bootstrap: str, prefix: str, capture: Mapping[str, Any], *,
               timeout_s: float = 120.0) -> FreshWindows:
    """Run the recorded capture offsets through the in-memory stream chain (module doc)."""
    runs = recorded_runs(capture)
    end = {str(t): {int(p): int(o) for p, o in parts.items()}
           for t, parts in capture.get("end", {}).items()}
    cuts = segments(runs, end)
    pipeline = LocalPipeline(prefix=prefix, **decision_order(bootstrap, runs, prefix))
    unknown = set(end) - set(pipeline.topics.values())
    if unknown:
        raise RebuildError(f"the manifest's capture offsets name {sorted(unknown)}, not the "
                           f"capture topics of prefix {prefix!r}")
    configs = [cut.run.processor_config() for cut in cuts]
    last_ms, partitions = 0, set()
    for cut, config in zip(cuts, configs, strict=True):
        pipeline.reconfigure(config)
        for kind, msg in _messages(bootstrap, pipeline.topics, cut.ranges, timeout_s):
            now_ms = max(0, int(msg.timestamp()[1]))
            last_ms = max(last_ms, now_ms)
            partitions.add(int(msg.partition()))
            pipeline.feed(kind, int(msg.partition()), int(msg.offset()), msg.key(), msg.value(),
                          list(msg.headers() or []), now_ms=now_ms)
    idle_ms = pipeline.config.assemble.idle_timeout_ms
    for partition in sorted(partitions):
        pipeline.tick(partition, last_ms + idle_ms + 1)
    pipeline.flush()
    fresh = FreshWindows(capture_end_offsets=end, segments=len(cuts),
                         config_digests={c.window.digest() for c in configs})
    for window in pipeline.windows:
        fresh.add(window)
    return fresh


def _decode_window(value: bytes | None) -> dict[str, Any] | None:
    try:
        schema, record = codec.decode(value or b"")
    except SchemaError:
        return None
    if schema.name != WINDOW_SCHEMA or not isinstance(record, dict) or "window_id" not in record:
        return None
    return record


@dataclass
class CaptureCheck:
    """The outcome of comparing the snapshot's window records with the fresh windows."""

    fresh: FreshWindows
    regenerated: int = 0
    bytes_identical: int = 0
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    other_config: set[str] = field(default_factory=set)

    def observe(self, coords: str, value: bytes | None) -> None:
        """One window-topic record of the snapshot (``coords``: topic/partition@offset)."""
        window = _decode_window(value)
        if window is None:
            self.missing.append(f"{coords} (not a decodable Window record)")
            return
        wid = window["window_id"]
        fresh = self.fresh.windows.get(wid)
        if window.get("config_digest") not in self.fresh.config_digests:
            self.other_config.add(str(window.get("config_digest")))
        if fresh is None:
            self.missing.append(wid)
        elif fresh["content_digest"] != window["content_digest"]:
            self.mismatched.append(wid)
        else:
            self.regenerated += 1
            self.bytes_identical += int(self.fresh.encoded[wid] == value)

    def report(self) -> dict[str, Any]:
        return {
            "capture_end_offsets": {t: {str(p): o for p, o in v.items()}
                                    for t, v in self.fresh.capture_end_offsets.items()},
            "capture_window_config_digests": sorted(self.fresh.config_digests),
            "capture_segments": self.fresh.segments,
            "capture_windows_fresh": len(self.fresh.windows),
            "capture_windows_regenerated": self.regenerated,
            "capture_windows_bytes_identical": self.bytes_identical,
            "capture_windows_missing": sorted(set(self.missing)),
            "capture_windows_digest_mismatch": sorted(set(self.mismatched)),
        }

    def raise_on_failure(self, snapshot_id: str) -> None:
        missing, bad = sorted(set(self.missing)), sorted(set(self.mismatched))
        if not missing and not bad:
            return
        hint = ""
        if self.other_config:
            hint = (" The snapshot's windows carry window config digests "
                    f"{sorted(self.other_config)} that no recorded streams run has "
                    f"({sorted(self.fresh.config_digests)}): a worker ran without a run "
                    "record.")
        raise RebuildError(
            f"--from-capture: {len(missing)} window(s) of snapshot {snapshot_id} are not "
            f"regenerated from the capture topics (first: {missing[:_SHOWN]}) and "
            f"{len(bad)} are regenerated with a different content digest (first: "
            f"{bad[:_SHOWN]}).{hint} Capture data may have been truncated, or the stream "
            "worker ran another code version; no shards were written"
        )


def check_windows(bootstrap: str, ranges: Mapping[tuple[str, int], tuple[int, int]],
                  fresh: FreshWindows, *, timeout_s: float) -> CaptureCheck:
    """Compare every snapshot window record in ``ranges`` with the fresh windows."""
    check = CaptureCheck(fresh=fresh)
    for msg in read_ranges(bootstrap, ranges, timeout_s=timeout_s, error=RebuildError):
        check.observe(f"{msg.topic()}/{msg.partition()}@{msg.offset()}", msg.value())
    return check
