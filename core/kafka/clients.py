"""Builders of every confluent-kafka client, each from one :class:`KafkaClientConfig`."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka.config import KafkaClientConfig

LIBRDKAFKA_LOG = "hebrus_flywheel.librdkafka"
_C = TypeVar("_C")


def _build(kind: str, factory: Callable[[dict[str, Any]], _C], config: KafkaClientConfig,
           settings: Mapping[str, Any], log_name: str) -> _C:
    conf = config.librdkafka({**settings, "logger": logging.getLogger(log_name)})
    try:
        return factory(conf)
    except (KafkaException, ValueError, TypeError) as exc:
        raise ConfigError(
            f"KafkaClientConfig.properties: librdkafka refused the {kind} configuration "
            f"({exc}); fix the property in the --kafka-config file / $FLYWHEEL_KAFKA_CONFIG"
        ) from exc


def make_producer(config: KafkaClientConfig, *, settings: Mapping[str, Any] | None = None,
                  log_name: str = LIBRDKAFKA_LOG) -> Producer:
    """An idempotent ``acks=all`` producer; ``settings`` add or replace project settings
    (e.g. ``linger.ms``, ``error_cb``)."""
    base = {"acks": "all", "enable.idempotence": True, **(settings or {})}
    return _build("producer", Producer, config, base, log_name)


def make_consumer(config: KafkaClientConfig, *, group_id: str | None = None,
                  settings: Mapping[str, Any] | None = None,
                  log_name: str = LIBRDKAFKA_LOG) -> Consumer:
    """A consumer with manual commits; without ``group_id`` a private throw-away group
    that reads from the earliest offset and reports partition ends (a reader)."""
    base: dict[str, Any] = {"enable.auto.commit": False, "enable.auto.offset.store": False}
    if group_id is None:
        base.update({"group.id": f"flywheel-reader-{uuid.uuid4().hex}",
                     "auto.offset.reset": "earliest", "enable.partition.eof": True})
    else:
        base["group.id"] = group_id
    return _build("consumer", Consumer, config, {**base, **(settings or {})}, log_name)


def make_admin(config: KafkaClientConfig, *, settings: Mapping[str, Any] | None = None,
               log_name: str = LIBRDKAFKA_LOG) -> AdminClient:
    """An AdminClient whose librdkafka logs go to stdlib logging instead of stderr."""
    return _build("admin client", AdminClient, config, dict(settings or {}), log_name)


def probe(config: KafkaClientConfig, timeout_s: float = 5.0) -> bool:
    """True when one metadata request succeeds and lists at least one broker (no retry:
    callers poll this while a broker starts)."""
    try:
        metadata = make_admin(config, settings={"log_level": 0}).list_topics(timeout=timeout_s)
    except KafkaException:
        return False
    return bool(metadata.brokers)
