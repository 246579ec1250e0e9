"""faust / aiokafka settings from the same :class:`KafkaClientConfig`.

aiokafka is not librdkafka: only the properties below have an equivalent. Any other
property the user set cannot be honoured by the stream worker, so it is an error rather
than something silently dropped. faust is imported lazily: the base package must stay
importable without starting its event-loop machinery.
"""

from __future__ import annotations

import ssl
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka.config import KafkaClientConfig

TRANSLATED = frozenset({
    "security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username",
    "sasl.password", "ssl.ca.location", "ssl.certificate.location", "ssl.key.location",
    "ssl.key.password", "ssl.endpoint.identification.algorithm", "client.id",
})
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def check_translatable(config: KafkaClientConfig) -> tuple[str, str | None]:
    """(security protocol, SASL mechanism or None); ConfigError for what aiokafka lacks."""
    props = config.properties
    extra = sorted(set(props) - TRANSLATED)
    if extra:
        raise ConfigError(
            f"KafkaClientConfig.properties: {extra} have no aiokafka equivalent, so the faust "
            "stream worker cannot honour them; remove them from the Kafka config used for "
            f"`flywheel streams worker` (it understands {sorted(TRANSLATED)})")
    protocol = props.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise ConfigError(f"KafkaClientConfig.properties['security.protocol']: {protocol!r} "
                          f"is not one of {PROTOCOLS}")
    if not protocol.startswith("SASL"):
        return protocol, None
    mechanism = (props.get("sasl.mechanism") or props.get("sasl.mechanisms") or "GSSAPI").upper()
    if mechanism not in SASL_MECHANISMS:
        raise ConfigError(f"KafkaClientConfig.properties['sasl.mechanism']: {mechanism} is not "
                          f"supported by the faust worker; use one of {SASL_MECHANISMS}")
    return protocol, mechanism


def ssl_context(config: KafkaClientConfig) -> ssl.SSLContext:
    """An SSL context from ``ssl.ca.location`` / ``ssl.certificate.location`` / ``ssl.key.*``."""
    props = config.properties
    try:
        context = ssl.create_default_context(cafile=props.get("ssl.ca.location"))
        if props.get("ssl.certificate.location"):
            context.load_cert_chain(props["ssl.certificate.location"],
                                    props.get("ssl.key.location"),
                                    props.get("ssl.key.password"))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"KafkaClientConfig.properties['ssl.*']: cannot load the CA, "
                          f"certificate or key ({exc}); fix the file paths or password") from exc
    if props.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
        context.check_hostname = False
    return context


def faust_settings(config: KafkaClientConfig) -> dict[str, Any]:
    """``faust.App`` keyword arguments: broker list, credentials, client id."""
    import faust

    protocol, mechanism = check_translatable(config)
    out: dict[str, Any] = {
        "broker": [f"kafka://{b.strip()}" for b in config.bootstrap_servers.split(",")
                   if b.strip()],
    }
    context = ssl_context(config) if protocol in ("SSL", "SASL_SSL") else None
    if protocol == "SSL":
        out["broker_credentials"] = faust.SSLCredentials(context)
    elif mechanism is not None:
        props = config.properties
        out["broker_credentials"] = faust.SASLCredentials(
            username=props.get("sasl.username"), password=props.get("sasl.password"),
            ssl_context=context, mechanism=mechanism)
    if "client.id" in config.properties:
        out["broker_client_id"] = config.properties["client.id"]
    return out
