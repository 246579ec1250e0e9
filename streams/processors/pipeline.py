"""The processor chain in one process, over dicts: validate → assemble → split → dedup → window.

The faust worker runs the same stage objects, connected through Kafka topics. This
in-process chain is what the unit tests and ``bench/streams.py`` drive: feed it
capture messages in any interleaving and read back windows, decisions, quarantine
records and counters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.errors import ConfigError
from streams.processors.assemble import AssembleConfig
from streams.processors.capture import QUARANTINE, SUMMARY, CaptureStage, Emit
from streams.processors.common import StageCounters
from streams.processors.dedup import DedupConfig, DedupStage
from streams.processors.split import SplitConfig
from streams.processors.validate import ValidateConfig
from streams.processors.window import WindowConfig, WindowStage
from streams.topics import IDENTITIES_TOPIC, OBSERVATIONS_TOPIC, TRANSCRIPTS_TOPIC
from streams.validation import RouteGeometry


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
        expected = {
            "validate": ValidateConfig,
            "assemble": AssembleConfig,
            "split": SplitConfig,
            "dedup": DedupConfig,
            "window": WindowConfig,
        }
        for name, cls in expected.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"ProcessorConfig.{name} must be a {cls.__name__}")


def capture_topics(prefix: str = "") -> dict[str, str]:
    """Capture topic kind → topic name (with an optional test prefix)."""
    return {
        "transcripts": prefix + TRANSCRIPTS_TOPIC,
        "observations": prefix + OBSERVATIONS_TOPIC,
        "identities": prefix + IDENTITIES_TOPIC,
    }


class LocalPipeline:
    """All stages chained in memory; outputs accumulate in lists."""

    def __init__(self, config: ProcessorConfig | None = None, *, prefix: str = "") -> None:
        self.config = config or ProcessorConfig()
        self.topics = capture_topics(prefix)
        self.counters = StageCounters()
        self.capture_store: dict[str, Any] = {}
        self.dedup_store: dict[str, Any] = {}
        self.identities: dict[str, RouteGeometry | None] = {}
        self.capture = CaptureStage(
            topics=self.topics,
            store=self.capture_store,
            identities=self.identities,
            validate_config=self.config.validate,
            assemble_config=self.config.assemble,
            dedup_config=self.config.dedup,
            counters=self.counters,
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
        self.windows: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []
        self.quarantined: list[dict[str, Any]] = []

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
                decision = self.dedup.process(emit.value)
                self.decisions.append(decision)
                self.windows.extend(self.window.windows_for(decision))
                self.window.finish(decision)

    def windows_by_split(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for window in self.windows:
            out.setdefault(window["split"], []).append(window)
        return out
