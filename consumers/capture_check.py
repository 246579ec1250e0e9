"""``flywheel rebuild --from-capture``: regenerate the snapshot's windows from the capture topics.

An optional, additive check on top of :mod:`consumers.rebuild`. It reads the three
capture topics (identities, transcripts, observations, with the dataset's topic prefix)
from offset 0 up to their CURRENT end offsets, runs them through the stream processors'
in-memory chain (:class:`streams.processors.pipeline.LocalPipeline`, with the stream
worker's default configuration), and requires every record of the snapshot's window
topics (offset 0 up to the manifest's end offsets) to be regenerated with the same
``window_id`` and ``content_digest``. The rebuild then replays the fresh windows in the
recorded window-topic offset order, so the shards come from fresh stream output.

Only ids and digests are compared, never window-topic ORDER: that order follows thread
completion and the dedup agent's input order in the faust worker (see the rebuild
module's docstring). The in-memory chain sees identities first, then transcripts and
observations in partition-interleaved read order, and finally an idle tick past the idle
timeout, so threads the worker completed on idle are completed here too. Near-duplicate
decisions are first-come: if two snapshot threads are near-duplicates and the worker saw
them in the other order, the kept one differs and the check reports a missing window.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from consumers.exceptions import RebuildError
from consumers.intake import WINDOW_SCHEMA
from consumers.kafka_io import end_offsets, read_ranges
from schemas import codec
from schemas.exceptions import SchemaError
from streams.processors.cli import processor_config
from streams.processors.pipeline import LocalPipeline, ProcessorConfig

# The stream worker's command-line defaults (``flywheel streams worker``).
WORKER_DEFAULTS: dict[str, Any] = {
    "salt": "hebrus-flywheel-split-v1", "validation_fraction": 0.1, "temporal_cut_ms": None,
    "stress_rate": 0.5, "runtime_holdout_fraction": 0.05, "near_threshold": 0.8,
    "idle_timeout_s": 300.0, "context_length": 2048, "route_context_length": 8192,
}
_SHOWN = 10


def default_processor_config() -> ProcessorConfig:
    """The configuration a ``flywheel streams worker`` without flags runs with."""
    return processor_config(**WORKER_DEFAULTS)


@dataclass
class FreshWindows:
    """Windows regenerated from the capture topics, by window id, with their encodings."""

    capture_end_offsets: dict[str, dict[int, int]]
    config_digest: str
    windows: dict[str, dict[str, Any]] = field(default_factory=dict)
    encoded: dict[str, bytes] = field(default_factory=dict)
    conflicting: list[str] = field(default_factory=list)

    def add(self, window: Mapping[str, Any]) -> None:
        wid = window["window_id"]
        known = self.windows.get(wid)
        if known is not None:
            if known["content_digest"] != window["content_digest"]:
                self.conflicting.append(wid)
            return
        self.windows[wid] = dict(window)
        self.encoded[wid] = codec.encode_entry(codec.default_registry().get("Window"), window)


def _capture_messages(bootstrap: str, topics: Mapping[str, str],
                      ends: Mapping[str, Mapping[int, int]], timeout_s: float) -> Iterator[Any]:
    by_name = {name: kind for kind, name in topics.items()}
    for group in (("identities",), ("transcripts", "observations")):
        ranges = {(topics[k], p): (0, end) for k in group for p, end in ends[topics[k]].items()}
        for msg in read_ranges(bootstrap, ranges, timeout_s=timeout_s, error=RebuildError):
            yield by_name[msg.topic()], msg


def regenerate(bootstrap: str, prefix: str, *, timeout_s: float = 120.0,
               config: ProcessorConfig | None = None) -> FreshWindows:
    """Run the capture topics (0 .. current end) through the in-memory stream chain."""
    pipeline = LocalPipeline(config or default_processor_config(), prefix=prefix)
    ends = end_offsets(bootstrap, pipeline.topics.values(), error=RebuildError)
    last_ms, partitions = 0, set()
    for kind, msg in _capture_messages(bootstrap, pipeline.topics, ends, timeout_s):
        now_ms = max(0, int(msg.timestamp()[1]))
        last_ms = max(last_ms, now_ms)
        partitions.add(int(msg.partition()))
        pipeline.feed(kind, int(msg.partition()), int(msg.offset()), msg.key(), msg.value(),
                      list(msg.headers() or []), now_ms=now_ms)
    idle_ms = pipeline.config.assemble.idle_timeout_ms
    for partition in sorted(partitions):
        pipeline.tick(partition, last_ms + idle_ms + 1)
    fresh = FreshWindows(capture_end_offsets={t: dict(v) for t, v in ends.items()},
                         config_digest=pipeline.config.window.digest())
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
        if window.get("config_digest") != self.fresh.config_digest:
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
            "capture_config_digest": self.fresh.config_digest,
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
                    f"{sorted(self.other_config)}, the default stream worker's is "
                    f"{self.fresh.config_digest}: they were produced with non-default "
                    "windowing flags.")
        raise RebuildError(
            f"--from-capture: {len(missing)} window(s) of snapshot {snapshot_id} are not "
            f"regenerated from the capture topics (first: {missing[:_SHOWN]}) and "
            f"{len(bad)} are regenerated with a different content digest (first: "
            f"{bad[:_SHOWN]}).{hint} Capture data may have been truncated, the stream "
            "worker may have run another config or code version, or near-duplicate "
            "decisions may depend on arrival order; no shards were written"
        )


def check_windows(bootstrap: str, ranges: Mapping[tuple[str, int], tuple[int, int]],
                  fresh: FreshWindows, *, timeout_s: float) -> CaptureCheck:
    """Compare every snapshot window record in ``ranges`` with the fresh windows."""
    check = CaptureCheck(fresh=fresh)
    for msg in read_ranges(bootstrap, ranges, timeout_s=timeout_s, error=RebuildError):
        check.observe(f"{msg.topic()}/{msg.partition()}@{msg.offset()}", msg.value())
    return check
