"""The capture publisher a decode runtime embeds (:class:`RuntimePublisher`).

Modules: :mod:`.config` (configuration, counters' snapshot), :mod:`.runtime` (the
caller side: validate, consent, pseudonymize, seal, chunk, encode, enqueue),
:mod:`.batching` (open chunks per thread), :mod:`.delivery` (drain thread, delivery
reports, counters).
"""

from hebrus_flywheel.streams.publisher.config import (
    CHUNK_SCHEMA,
    COMPRESSIONS,
    FULL_POLICIES,
    IDENTITY_SCHEMA,
    OBSERVATION_SCHEMA,
    TURN_SCHEMA,
    PublisherConfig,
    PublisherStats,
    default_producer_id,
)
from hebrus_flywheel.streams.publisher.runtime import RuntimePublisher

__all__ = [
    "CHUNK_SCHEMA", "COMPRESSIONS", "FULL_POLICIES", "IDENTITY_SCHEMA", "OBSERVATION_SCHEMA",
    "TURN_SCHEMA", "PublisherConfig", "PublisherStats", "RuntimePublisher",
    "default_producer_id",
]
