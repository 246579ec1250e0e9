"""The one Kafka client configuration every client of the project is built from."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka.retry import RetryPolicy
from hebrus_flywheel.core.kafka.security import embedded_properties
from hebrus_flywheel.core.settings import KAFKA_CONFIG_ENV, bootstrap_servers, kafka_properties

# The project fixes these per client for its guarantees (manual commits after durable
# outputs, idempotent acks=all producers, private reader groups) or its callbacks.
RESERVED_PROPERTIES = frozenset({
    "bootstrap.servers", "group.id", "group.instance.id", "enable.auto.commit",
    "enable.auto.offset.store", "enable.partition.eof", "auto.offset.reset",
    "isolation.level", "enable.idempotence", "acks", "request.required.acks",
    "transactional.id", "logger", "error_cb", "on_delivery", "stats_cb", "throttle_cb",
    "on_commit", "oauth_cb",
})
_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
# Not librdkafka's: the retry policy, settable from the same properties file.
_RETRY_KEYS = {"flywheel.retry.attempts": ("attempts", 1),
               "flywheel.retry.backoff.ms": ("backoff_s", 1000),
               "flywheel.retry.max.backoff.ms": ("max_backoff_s", 1000)}


@dataclass(frozen=True, kw_only=True)
class KafkaClientConfig:
    """Where the cluster is and how every client talks to it.

    Fields:
        bootstrap_servers: comma-separated ``host:port`` list of the cluster.
        properties: librdkafka properties of the user's cluster (``security.protocol``,
            ``sasl.*``, ``ssl.*``, ``client.id``, ``socket.*`` ...), passed to every
            confluent-kafka client and translated for faust; values are strings. Keys
            the project fixes itself (:data:`RESERVED_PROPERTIES`) are refused.
        retry: the retry policy for retriable errors (see :mod:`core.kafka.retry`).
    """

    bootstrap_servers: str
    # Not in repr: it may hold sasl.password / ssl.key.password.
    properties: Mapping[str, str] = field(default_factory=dict, repr=False)
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if not isinstance(self.bootstrap_servers, str) or not self.bootstrap_servers.strip():
            raise ConfigError("KafkaClientConfig.bootstrap_servers must name at least one "
                              "broker (host:port[,host:port...])")
        if not isinstance(self.properties, Mapping):
            raise ConfigError("KafkaClientConfig.properties must be a mapping of strings")
        clean: dict[str, str] = {}
        for key, value in self.properties.items():
            where = f"KafkaClientConfig.properties[{key!r}]"
            if not isinstance(key, str) or not _KEY_RE.match(key):
                raise ConfigError(f"{where}: not a librdkafka property name")
            if key in RESERVED_PROPERTIES:
                raise ConfigError(f"{where}: the project sets {key} itself for its delivery "
                                  "and commit guarantees; remove it from the Kafka config")
            if key.startswith("flywheel."):
                raise ConfigError(f"{where}: unknown flywheel setting; known: "
                                  f"{sorted(_RETRY_KEYS)}")
            if not isinstance(value, str | int | float):
                raise ConfigError(f"{where}: value must be a string, number or bool, got "
                                  f"{value!r}")
            clean[key] = str(value).lower() if isinstance(value, bool) else str(value)
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError("KafkaClientConfig.retry must be a RetryPolicy")
        object.__setattr__(self, "properties", MappingProxyType(clean))

    @classmethod
    def from_properties(cls, bootstrap: str, properties: Mapping[str, str], *,
                        retry: RetryPolicy | None = None) -> KafkaClientConfig:
        """A config from a properties file's content; ``flywheel.retry.*`` keys set the
        retry policy (``attempts``, ``backoff.ms``, ``max.backoff.ms``)."""
        client = {k: v for k, v in properties.items() if k not in _RETRY_KEYS}
        policy: dict[str, Any] = {}
        for key, (name, scale) in _RETRY_KEYS.items():
            if key in properties:
                try:
                    number = float(properties[key])
                except ValueError as exc:
                    raise ConfigError(f"KafkaClientConfig.retry: {key}={properties[key]!r} is "
                                      "not a number") from exc
                policy[name] = int(number) if scale == 1 else number / scale
        if policy:
            base = {} if retry is None else {"attempts": retry.attempts,
                                             "backoff_s": retry.backoff_s,
                                             "max_backoff_s": retry.max_backoff_s}
            retry = RetryPolicy(**{**base, **policy})
        return cls(bootstrap_servers=bootstrap, properties=client,
                   retry=retry if retry is not None else RetryPolicy())

    def librdkafka(self, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A confluent-kafka client configuration: the bootstrap list, the project's
        ``settings`` for this client, then the user's properties (which win: a user's
        ``client.id`` or socket tuning is theirs; reserved keys cannot be set by them)."""
        return {"bootstrap.servers": self.bootstrap_servers, **(settings or {}),
                **self.properties}


KafkaTarget = str | KafkaClientConfig
"""What Kafka-facing functions accept: a ready config, or a bootstrap list that is
completed with the process's Kafka properties (:func:`client_config`)."""


def client_config(target: KafkaTarget | None = None, *,
                  kafka_config: str | Path | None = None,
                  role: str | None = None) -> KafkaClientConfig:
    """``target`` if it is a config; else one for the bootstrap list ``target`` (or the
    settings' default) with the properties of ``kafka_config`` / ``$FLYWHEEL_KAFKA_CONFIG``;
    without either, on the embedded broker, those of ``role`` (default: the process's
    role, see :mod:`core.kafka.security`)."""
    if isinstance(target, KafkaClientConfig):
        return target
    bootstrap = bootstrap_servers(target)
    properties = kafka_properties(kafka_config)
    if not properties and not (kafka_config or os.environ.get(KAFKA_CONFIG_ENV)):
        properties = embedded_properties(bootstrap, role)
    return KafkaClientConfig.from_properties(bootstrap, properties)
