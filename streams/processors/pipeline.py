"""The processor chain in one process, over dicts: validate → assemble → split → dedup → window.

The faust worker runs the same stage objects, connected through Kafka topics. This
in-process chain is what the unit tests, ``bench/streams.py`` and ``flywheel rebuild
--from-capture`` drive: feed it capture messages in any interleaving and read back
windows, decisions, quarantine records and counters.

Two things let it repeat what a worker group did, for rebuilds:

* :meth:`LocalPipeline.reconfigure` swaps every stage's configuration while keeping the
  state, as a worker restarted with other flags does (its tables are restored);
* ``release_order`` (thread generation ids, ``iid``) makes completed threads reach the
  split and dedup stage in that order, the order the worker's single dedup agent decided
  them (:func:`streams.processors.decision_order.decision_sequence` replays it from the
  threads topic). Near-duplicate decisions are first-come; given the recorded order the
  chain takes the same decisions, those the worker took on arrival included. A
  generation that completes before its turn waits; :meth:`LocalPipeline.flush` releases
  what is left (recorded order first, then completion order).

``event_order`` (the capture partitions' count) decides generations in event-time order
instead, as the worker does (:mod:`streams.processors.decision_order`): after each
record the capture partition's mark goes to the dedup stage, and :meth:`LocalPipeline.
flush` marks every partition caught up, so it decides what still waits. Then the chain
takes the decisions a worker group takes on the same backlog of records, whatever their
interleaving across partitions (the worker's marks differ only while it is caught up
with live traffic).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.jsonio import canonical_json
from hebrus_flywheel.core.privacy import OwnerKeyStore
from hebrus_flywheel.streams.processors.assemble import AssembleConfig
from hebrus_flywheel.streams.processors.capture import QUARANTINE, SUMMARY, CaptureStage, Emit
from hebrus_flywheel.streams.processors.common import sha256_hex
from hebrus_flywheel.streams.processors.decision_order import DecisionOrder
from hebrus_flywheel.streams.processors.dedup import DedupConfig, DedupStage
from hebrus_flywheel.streams.processors.split import SplitConfig
from hebrus_flywheel.streams.processors.validate import ValidateConfig
from hebrus_flywheel.streams.processors.window import WindowConfig, WindowStage
from hebrus_flywheel.streams.rules import IdentityRules
from hebrus_flywheel.streams.topics import IDENTITIES_TOPIC, OBSERVATIONS_TOPIC, TRANSCRIPTS_TOPIC

_STAGE_TYPES: dict[str, type] = {
    "validate": ValidateConfig, "assemble": AssembleConfig, "split": SplitConfig,
    "dedup": DedupConfig, "window": WindowConfig,
}


@dataclass(frozen=True, kw_only=True)
class ProcessorConfig:
    """Every stage's configuration.

    Fields:
        validate: decoding limits (:class:`ValidateConfig`).
        assemble: completion rules (:class:`AssembleConfig`).
        split: split rules (:class:`SplitConfig`).
        dedup: near-duplicate parameters (:class:`DedupConfig`).
        window: windowing parameters (:class:`WindowConfig`).
    """

    validate: ValidateConfig = field(default_factory=ValidateConfig)
    assemble: AssembleConfig = field(default_factory=AssembleConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    window: WindowConfig = field(default_factory=WindowConfig)

    def __post_init__(self) -> None:
        for name, cls in _STAGE_TYPES.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"ProcessorConfig.{name} must be a {cls.__name__}")


def config_to_json(config: ProcessorConfig) -> dict[str, Any]:
    """A JSON-ready copy of every stage's configuration (tuples become lists)."""
    data: dict[str, Any] = json.loads(canonical_json(dataclasses.asdict(config)))
    return data


def config_from_json(data: Mapping[str, Any]) -> ProcessorConfig:
    """The inverse of :func:`config_to_json`; ConfigError names an unknown or bad field."""
    if not isinstance(data, Mapping) or set(data) - set(_STAGE_TYPES):
        raise ConfigError(
            f"a processor config has the stages {sorted(_STAGE_TYPES)}, got "
            f"{sorted(data) if isinstance(data, Mapping) else type(data).__name__}"
        )
    stages: dict[str, Any] = {}
    for name, stage in data.items():
        cls = _STAGE_TYPES[name]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(stage) - set(fields) if isinstance(stage, Mapping) else {"<not a mapping>"}
        if unknown:
            raise ConfigError(f"ProcessorConfig.{name} has unknown fields {sorted(unknown)}; "
                              "it was written by another code version")
        stages[name] = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in stage.items()})
    return ProcessorConfig(**stages)


def config_id(config: ProcessorConfig) -> str:
    """SHA-256 of the canonical JSON of :func:`config_to_json`: names one configuration."""
    return sha256_hex(canonical_json(config_to_json(config)))


def capture_topics(prefix: str = "") -> dict[str, str]:
    """Capture topic kind → topic name (with an optional test prefix)."""
    return {
        "transcripts": prefix + TRANSCRIPTS_TOPIC,
        "observations": prefix + OBSERVATIONS_TOPIC,
        "identities": prefix + IDENTITIES_TOPIC,
    }


@dataclass(frozen=True)
class _Stages:
    """The dedup and window stages (hence configs) in force when a generation completed."""

    dedup: DedupStage
    window: WindowStage


class LocalPipeline:
    """All stages chained in memory; outputs accumulate in lists."""

    def __init__(
        self, config: ProcessorConfig | None = None, *, prefix: str = "",
        release_order: Sequence[str] | None = None, keys: OwnerKeyStore | None = None,
        capture_consent: Callable[[str, int], bool] | None = None,
        event_order: int | None = None,
    ) -> None:
        if event_order is not None and release_order:
            raise ConfigError("LocalPipeline takes release_order or event_order, not both")
        self.event_order = event_order
        self.keys = keys  # opens sealed capture; None: LocalOwnerKeyStore() on first use
        self.topics = capture_topics(prefix)
        self.capture_consent = capture_consent
        self.counters = Counters()
        self.capture_store: dict[str, Any] = {}
        self.dedup_store: dict[str, Any] = {}
        self.identities: dict[str, IdentityRules | None] = {}
        self.windows: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []
        self.quarantined: list[dict[str, Any]] = []
        self._order_list = list(dict.fromkeys(release_order or ()))
        self._order = {iid: i for i, iid in enumerate(self._order_list)}
        self._next_release = 0
        self._waiting: dict[str, tuple[dict[str, Any], _Stages]] = {}
        self._last_dedup: DedupStage | None = None
        self.reconfigure(config or ProcessorConfig())

    def reconfigure(self, config: ProcessorConfig) -> None:
        """Run later records with ``config``, keeping all state (a restarted worker)."""
        self.config = config
        self.capture = CaptureStage(
            topics=self.topics,
            store=self.capture_store,
            identities=self.identities,
            validate_config=self.config.validate,
            assemble_config=self.config.assemble,
            dedup_config=self.config.dedup,
            counters=self.counters,
            keys=self.keys,
            capture_consent=self.capture_consent,
            split_config=self.config.split,
        )
        self.dedup = DedupStage(
            split_config=self.config.split,
            dedup_config=self.config.dedup,
            store=self.dedup_store,
            counters=self.counters,
        )
        self.window = WindowStage(
            config=self.config.window, store=self.capture_store, counters=self.counters
        )
        self._stages = _Stages(self.dedup, self.window)
        self.order = None if self.event_order is None else DecisionOrder(
            self.dedup, partitions=self.event_order)

    def feed(
        self,
        kind: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, Any]] | None = None,
        now_ms: int = 0,
    ) -> None:
        """One capture message of topic ``kind`` (transcripts | observations | identities)."""
        emits = self.capture.process(
            topic=self.topics[kind],
            partition=partition,
            offset=offset,
            key=key,
            value=value,
            headers=headers,
            now_ms=now_ms,
        )
        self._route(emits)
        if self.order is not None and kind != "identities":
            bound = self.capture.clocks.bound(partition, self.config.dedup.order_lateness_ms)
            if bound is not None:
                self._decided(self.order.mark(partition, bound), self._stages)

    def feed_all(
        self, messages: Iterable[tuple[str, int, int, bytes | None, bytes | None]]
    ) -> None:
        for kind, partition, offset, key, value in messages:
            self.feed(kind, partition, offset, key, value)

    def tick(self, partition: int, now_ms: int) -> None:
        self._route(self.capture.tick(partition, now_ms))

    def _route(self, emits: list[Emit]) -> None:
        for emit in emits:
            if emit.kind == QUARANTINE:
                self.quarantined.append(emit.value)
            elif emit.kind == SUMMARY:
                self._arrive(emit.value)

    def _arrive(self, summary: dict[str, Any]) -> None:
        if self.order is not None:
            self._decided(self.order.arrive(summary), self._stages)
            return
        if not self._order:
            self._decide(summary, self._stages)
            return
        self._waiting.setdefault(summary["iid"], (summary, self._stages))
        while (self._next_release < len(self._order_list)
               and self._order_list[self._next_release] in self._waiting):
            self._decide(*self._waiting.pop(self._order_list[self._next_release]))
            self._next_release += 1

    def flush(self) -> None:
        """Decide every completed generation still waiting for its turn (see the module doc)."""
        if self.order is not None:
            for partition in range(self.order.partitions):
                self._decided(self.order.mark(partition, None), self._stages)
            return
        rank = len(self._order)
        waiting = sorted(self._waiting.items(), key=lambda kv: self._order.get(kv[0], rank))
        self._waiting.clear()
        self._next_release = rank
        for _, (summary, stages) in waiting:
            self._decide(summary, stages)

    def _decide(self, summary: dict[str, Any], stages: _Stages) -> None:
        if stages.dedup is not self._last_dedup:
            # Another configuration's stage: its in-memory index misses the decisions
            # taken since it last ran; rebuild it from the shared store, as a worker
            # restarted with other flags does.
            stages.dedup.reset()
            self._last_dedup = stages.dedup
        self._decided([stages.dedup.process(summary)], stages)

    def _decided(self, decisions: list[dict[str, Any]], stages: _Stages) -> None:
        for decision in decisions:
            self.decisions.append(decision)
            self.windows.extend(stages.window.windows_for(decision))
            stages.window.finish(decision)

    def windows_by_split(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for window in self.windows:
            out.setdefault(window["split"], []).append(window)
        return out
