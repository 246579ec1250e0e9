"""Topic names the stream processors read and write, and their creation.

Capture, quarantine and window topics come from the catalogue (``streams.topics``);
each worker group (app id) adds three internal topics of its own, named like faust's
changelog topics (``<prefix><app id>-<name>``):

The delete-policy internal topics (threads, decisions) keep records for the retention
policy's ``internal`` class (:mod:`streams.retention`, default 7 days):

* ``…-threads-v1`` (1 partition): summaries of completed thread generations, the input
  of the single split+dedup agent;
* ``…-decisions-v1`` (N partitions): split and dedup decisions, each sent to the
  partition its thread was read from; ``flywheel streams inspect`` reads dedup counts
  from it;
* ``…-ticks-v1`` (N partitions, 1 hour retention): idle-timeout ticks;
* ``…-homes-v1`` and ``…-bands-v1`` (N partitions each), only for workers that run the
  band-partitioned dedup (``--dedup-bands``, :mod:`streams.processors.band_agents`):
  what the home and band partitions read;
* ``…-crashes-v1`` (1 partition, compacted): the crash ledger, crashes per record
  (:mod:`streams.processors.poison`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hebrus_flywheel.streams.processors.exceptions import WorkerError
from hebrus_flywheel.streams.retention import RetentionPolicy, load_policy
from hebrus_flywheel.streams.topics import (
    CONSENT_TOPIC,
    IDENTITIES_TOPIC,
    OBSERVATIONS_TOPIC,
    QUARANTINE_TOPIC,
    SPLITS,
    STREAMS_RUNS_TOPIC,
    TRANSCRIPTS_TOPIC,
    TopicSpec,
    catalogue,
    create_topics,
    describe_topics,
    window_topic,
)

DEFAULT_APP_ID = "flywheel-streams"


@dataclass(frozen=True, kw_only=True)
class StreamTopics:
    """Every topic name one worker uses (all with the same prefix)."""

    prefix: str
    transcripts: str
    observations: str
    identities: str
    quarantine: str
    runs: str
    windows: dict[str, str]
    threads: str
    decisions: str
    ticks: str
    crashes: str
    consent: str = ""
    homes: str = ""
    bands: str = ""

    @classmethod
    def from_prefix(cls, prefix: str = "", app_id: str = DEFAULT_APP_ID) -> StreamTopics:
        app = prefix + app_id
        return cls(
            prefix=prefix,
            transcripts=prefix + TRANSCRIPTS_TOPIC,
            observations=prefix + OBSERVATIONS_TOPIC,
            identities=prefix + IDENTITIES_TOPIC,
            quarantine=prefix + QUARANTINE_TOPIC,
            runs=prefix + STREAMS_RUNS_TOPIC,
            windows={s: prefix + window_topic(s) for s in SPLITS},
            threads=f"{app}-threads-v1",
            decisions=f"{app}-decisions-v1",
            ticks=f"{app}-ticks-v1",
            crashes=f"{app}-crashes-v1",
            consent=prefix + CONSENT_TOPIC,
            homes=f"{app}-homes-v1",
            bands=f"{app}-bands-v1",
        )

    def capture_kinds(self) -> dict[str, str]:
        return {
            "transcripts": self.transcripts,
            "observations": self.observations,
            "identities": self.identities,
        }

    def catalogue_names(self) -> list[str]:
        return [
            self.transcripts,
            self.observations,
            self.identities,
            self.quarantine,
            self.runs,
            *self.windows.values(),
        ]


def internal_specs(topics: StreamTopics, partitions: int,
                   policy: RetentionPolicy | None = None, *,
                   dedup_bands: bool = False) -> list[TopicSpec]:
    internal_ms = (policy or load_policy()).internal_ms
    bands = [
        TopicSpec(name=topics.homes, partitions=partitions, retention_ms=internal_ms,
                  doc="Band-partitioned dedup: summaries, marks, pairs and notices by home."),
        TopicSpec(name=topics.bands, partitions=partitions, retention_ms=internal_ms,
                  doc="Band-partitioned dedup: summaries and marks by band partition."),
    ] if dedup_bands else []
    return [
        *bands,
        TopicSpec(
            name=topics.threads,
            partitions=1,
            retention_ms=internal_ms,
            doc="Completed thread generations awaiting split and dedup.",
        ),
        TopicSpec(
            name=topics.decisions,
            partitions=partitions,
            retention_ms=internal_ms,
            doc="Split and dedup decision of every completed thread generation.",
        ),
        TopicSpec(
            name=topics.ticks,
            partitions=partitions,
            retention_ms=3_600_000,
            doc="Idle-timeout ticks of the streams worker.",
        ),
        TopicSpec(
            name=topics.crashes,
            partitions=1,
            cleanup_policy="compact",
            doc="Crash ledger: crashes of the streams worker per record (poison records).",
        ),
    ]


def changelog_specs(app_id: str, tables: dict[str, int]) -> list[TopicSpec]:
    """faust's changelog topics (``<app id>-<table>-changelog``), compacted, created up front
    so that every worker sees their partition counts from its first metadata refresh."""
    return [
        TopicSpec(
            name=f"{app_id}-{table}-changelog",
            partitions=n,
            cleanup_policy="compact",
            doc=f"Changelog of the streams table {table}.",
        )
        for table, n in tables.items()
    ]


def ensure_topics(
    bootstrap: str,
    topics: StreamTopics,
    *,
    app_id: str | None = None,
    tables: dict[str, int | None] | None = None,
    dedup_bands: bool = False,
) -> int:
    """Create the catalogue topics the worker uses, its internal topics and the changelog
    topics of ``tables`` (``None`` partitions means N); returns N. Missing topics get the
    retention policy of ``$FLYWHEEL_RETENTION_CONFIG`` (or the defaults); existing ones
    keep the retention configured on the broker."""
    policy = load_policy()
    by_name = {s.name: s for s in catalogue(topics.prefix, policy)}
    specs = [by_name[name] for name in topics.catalogue_names()]
    create_topics(bootstrap, specs)
    info = describe_topics(bootstrap, [topics.transcripts, topics.observations])
    counts = {name: i.partitions for name, i in info.items()}
    if len(set(counts.values())) != 1 or len(counts) != 2:
        raise WorkerError(
            f"capture topics must exist with equal partition counts, found {counts}; "
            "recreate them from the catalogue (`flywheel topics create`)"
        )
    partitions = next(iter(counts.values()))
    specs = internal_specs(topics, partitions, policy, dedup_bands=dedup_bands)
    if app_id is not None and tables:
        specs += changelog_specs(app_id, {t: n or partitions for t, n in tables.items()})
    create_topics(bootstrap, specs)
    return partitions
