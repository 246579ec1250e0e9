"""The runtime publisher's configuration and its counters' snapshot."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.settings import bootstrap_servers
from hebrus_flywheel.streams.chunks import MAX_CHUNK_TOKENS
from hebrus_flywheel.streams.consent import CONSENT_TOPIC
from hebrus_flywheel.streams.sealing import OBSERVATION_CHUNK_V1, OBSERVATION_V3, TURN_V2
from hebrus_flywheel.streams.topics import IDENTITIES_TOPIC, OBSERVATIONS_TOPIC, TRANSCRIPTS_TOPIC

FULL_POLICIES = ("block_then_drop_newest", "block_then_raise")
COMPRESSIONS = ("lz4", "zstd")
IDENTITY_SCHEMA = "hebrus.flywheel.v1.RuntimeIdentity.v3"
TURN_SCHEMA = TURN_V2
OBSERVATION_SCHEMA = OBSERVATION_V3
CHUNK_SCHEMA = OBSERVATION_CHUNK_V1
_PROTECTED = frozenset({"bootstrap.servers", "enable.idempotence", "acks", "on_delivery",
                        "error_cb", "logger", "client.id"})


def default_producer_id() -> str:
    """``<host>-<pid>-<random>``: unique per process lifetime, since counters restart at 0."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """Configuration of :class:`RuntimePublisher`.

    Attributes:
        bootstrap_servers: Kafka bootstrap list (default: ``flywheel.settings``).
        identities_topic: topic of ``RuntimeIdentity`` records (keyed by identity id).
        transcripts_topic: topic of ``TranscriptTurn`` records (keyed ``owner/thread``).
        observations_topic: topic of ``RouteObservation`` records (keyed ``owner/thread``).
        producer_id: stamped into records that leave it unset; unique per process.
        queue_capacity: encoded records the in-process queue holds (~3.3 KB each for a
            48x10 observation) before ``publish_*`` waits.
        max_block_ms: longest a ``publish_*`` call waits for the lock and queue space, on
            top of its validate + encode CPU time.
        full_policy: after ``max_block_ms`` of a full queue, ``block_then_drop_newest``
            drops the record (``publish_*`` returns False); ``block_then_raise`` raises
            :class:`QueueFullError`. Both count ``dropped_queue_full``.
        linger_ms: librdkafka ``linger.ms`` (batching delay).
        compression: ``lz4`` or ``zstd``.
        delivery_timeout_ms: librdkafka ``delivery.timeout.ms``; undelivered after that
            counts as failed.
        vocab_size: when set, token ids are checked against ``[0, vocab_size)``.
        close_timeout_s: how long ``close()`` waits for outstanding deliveries.
        producer_overrides: extra librdkafka settings (cannot change idempotence, acks,
            bootstrap or callbacks).
        consent_topic: the consent ledger (:mod:`streams.consent`).
        chunk_max_tokens: observations of one thread are published as one
            ``RouteObservationChunk.v1`` of at most this many consecutive tokens
            (:mod:`streams.chunks`); 1 publishes one ``RouteObservation.v3`` per token.
        chunk_max_ms: a thread's open chunk is published at the latest this many
            milliseconds after its first token (also on a turn of the thread, a gap in
            its ordinals, ``end_thread``, ``flush`` and ``close``).
        consent_check: refuse (not publish, count ``refused_no_consent``) every turn and
            observation whose owner has no live ``capture`` grant at its
            ``wall_time_ms``. False is for tests and benchmarks only: the publisher
            then logs a warning at start and every stats snapshot says so
            (``consent_checked=False``).
    """

    bootstrap_servers: str = field(default_factory=lambda: bootstrap_servers(None))
    identities_topic: str = IDENTITIES_TOPIC
    transcripts_topic: str = TRANSCRIPTS_TOPIC
    observations_topic: str = OBSERVATIONS_TOPIC
    producer_id: str = field(default_factory=default_producer_id)
    queue_capacity: int = 10_000
    max_block_ms: float = 5.0
    full_policy: str = "block_then_drop_newest"
    linger_ms: int = 5
    compression: str = "lz4"
    delivery_timeout_ms: int = 120_000
    vocab_size: int | None = None
    close_timeout_s: float = 30.0
    producer_overrides: Mapping[str, Any] = field(default_factory=dict)
    consent_topic: str = CONSENT_TOPIC
    consent_check: bool = True
    chunk_max_tokens: int = 64
    chunk_max_ms: float = 50.0

    def __post_init__(self) -> None:
        for name in ("bootstrap_servers", "identities_topic", "transcripts_topic",
                     "observations_topic", "producer_id", "consent_topic"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"PublisherConfig.{name} must be a non-empty string")
        for name, low in (("queue_capacity", 1), ("max_block_ms", 0), ("linger_ms", 0),
                          ("delivery_timeout_ms", 1), ("close_timeout_s", 0),
                          ("chunk_max_tokens", 1), ("chunk_max_ms", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"PublisherConfig.{name} must be ≥ {low}, got "
                                  f"{getattr(self, name)}")
        if self.full_policy not in FULL_POLICIES:
            raise ConfigError(f"PublisherConfig.full_policy must be one of {FULL_POLICIES}, "
                              f"got {self.full_policy!r}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"PublisherConfig.compression must be one of {COMPRESSIONS}, "
                              f"got {self.compression!r}")
        if self.chunk_max_tokens > MAX_CHUNK_TOKENS:
            raise ConfigError(f"PublisherConfig.chunk_max_tokens must be ≤ {MAX_CHUNK_TOKENS}, "
                              f"got {self.chunk_max_tokens}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"PublisherConfig.vocab_size must be ≥ 1, got {self.vocab_size}")
        clash = sorted(_PROTECTED & set(self.producer_overrides))
        if clash:
            raise ConfigError(f"PublisherConfig.producer_overrides may not set {clash}; the "
                              "publisher fixes them (idempotent, acks=all, own callbacks)")
        object.__setattr__(self, "producer_overrides",
                           MappingProxyType(dict(self.producer_overrides)))

    def producer_settings(self) -> dict[str, Any]:
        """The librdkafka configuration (without callbacks)."""
        return {
            "bootstrap.servers": self.bootstrap_servers,
            "client.id": f"flywheel-publisher-{self.producer_id}",
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": self.linger_ms,
            "compression.type": self.compression,
            "delivery.timeout.ms": self.delivery_timeout_ms,
            **self.producer_overrides,
        }


@dataclass(frozen=True, kw_only=True)
class PublisherStats:
    """A snapshot of the publisher's counters.

    Attributes:
        enqueued: records accepted onto the in-process queue (a chunk is one record).
        delivered: records the broker acknowledged.
        failed: enqueued records that librdkafka refused or did not deliver
            (``first_error`` has the first reason).
        dropped_queue_full: records dropped (or refused) because the queue stayed full.
        dropped_on_close: queued records discarded because ``close()`` timed out.
        rejected_invalid: records refused by validation, by reason code.
        delivered_by_topic / failed_by_topic: the same counts per topic.
        bytes_on_wire: key + value + header bytes of delivered records per topic
            (before compression).
        queue_depth: records waiting in the in-process queue now.
        in_flight: records inside librdkafka awaiting delivery now.
        first_error: the first delivery / produce / fatal error, if any.
        refused_no_consent: turns and observations not published because their owner
            had no live ``capture`` grant (or the consent ledger could not be read).
        consent_checked: False when the publisher runs with ``consent_check=False``.
        chunks_enqueued: ``RouteObservationChunk`` records among ``enqueued``.
        chunk_tokens_enqueued: observations (tokens) those chunks carry.
        tokens_buffered: observations accepted but still in an open chunk now.
        chunk_tokens_dropped: observations of chunks dropped on a full queue.
    """

    enqueued: int
    delivered: int
    failed: int
    dropped_queue_full: int
    dropped_on_close: int
    rejected_invalid: Mapping[str, int]
    delivered_by_topic: Mapping[str, int]
    failed_by_topic: Mapping[str, int]
    bytes_on_wire: Mapping[str, int]
    queue_depth: int
    in_flight: int
    first_error: str | None
    refused_no_consent: int = 0
    consent_checked: bool = True
    chunks_enqueued: int = 0
    chunk_tokens_enqueued: int = 0
    tokens_buffered: int = 0
    chunk_tokens_dropped: int = 0
