"""Kafka I/O of the whole project: the only module that builds Kafka clients.

Every confluent-kafka Producer, Consumer and AdminClient and every faust broker setting
comes from one :class:`KafkaClientConfig` (bootstrap list + the user's librdkafka
properties + a :class:`RetryPolicy`). Reads go to their end or raise, produces are
delivery-checked, and retriable errors (coordinator not ready, leader moves, transient
timeouts) are retried with exponential backoff, one log line per retry.

Split: ``config`` (the configuration), ``retry`` (the policy), ``clients`` (builders),
``io`` (reads, offsets, checked produce), ``aio`` (faust/aiokafka translation), ``errors``.
"""

from __future__ import annotations

from hebrus_flywheel.core.kafka.aio import faust_settings
from hebrus_flywheel.core.kafka.clients import make_admin, make_consumer, make_producer, probe
from hebrus_flywheel.core.kafka.config import (
    RESERVED_PROPERTIES,
    KafkaClientConfig,
    KafkaTarget,
    client_config,
)
from hebrus_flywheel.core.kafka.errors import (
    DeliveryError,
    KafkaIOError,
    KafkaRetryError,
    MissingTopicError,
    NotAuthorizedError,
    ReadIncompleteError,
)
from hebrus_flywheel.core.kafka.io import (
    CheckedProducer,
    MessageCheck,
    committed,
    committed_offsets,
    drain,
    end_watermarks,
    partitions_of,
    read_ranges,
    read_to_end,
    watermarks,
)
from hebrus_flywheel.core.kafka.lag import LagProbe
from hebrus_flywheel.core.kafka.retry import (
    RETRIABLE_CODES,
    RetryPolicy,
    describe,
    is_retriable,
    kafka_error,
)

__all__ = [
    "RESERVED_PROPERTIES", "RETRIABLE_CODES", "CheckedProducer", "DeliveryError",
    "KafkaClientConfig", "KafkaIOError", "KafkaRetryError", "KafkaTarget", "LagProbe",
    "MessageCheck",
    "MissingTopicError", "NotAuthorizedError", "ReadIncompleteError", "RetryPolicy",
    "client_config", "committed",
    "committed_offsets", "describe", "drain", "end_watermarks", "faust_settings",
    "is_retriable", "kafka_error", "make_admin", "make_consumer", "make_producer",
    "partitions_of", "probe", "read_ranges", "read_to_end", "watermarks",
]
