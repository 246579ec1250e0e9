"""What a node starts from: ``server.properties`` (from
``streams/kafka/server.properties.template``), the security material, the formatted data
dir, and the roles' credentials and ACLs once it answers."""

from __future__ import annotations

import logging
import os
import re
import string
from pathlib import Path

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.files import atomic_write_text
from hebrus_flywheel.streams import acls, security
from hebrus_flywheel.streams.broker.config import LOG4J2_PATH, SERVER_TEMPLATE_PATH, BrokerConfig
from hebrus_flywheel.streams.broker.tools import run_tool

log = logging.getLogger(__name__)
STORAGE_TOOL = "kafka.tools.StorageTool"


def render_server_properties(config: BrokerConfig) -> str:
    """The broker's ``server.properties`` (from ``streams/kafka/server.properties.template``)."""
    template = string.Template(SERVER_TEMPLATE_PATH.read_text())
    insecure = config.insecure_plaintext
    protocol = "PLAINTEXT" if insecure else "SASL_SSL"
    bind = config.bind_host or config.host
    listeners = {protocol: (f"{bind}:{config.port}", config.bootstrap)}
    if config.external:
        listeners["EXTERNAL"] = (f"{bind}:{config._external_port()}", config.external)
    return template.substitute(
        client_listener=protocol,
        listeners=",".join(f"{n}://{bound}" for n, (bound, _) in listeners.items()),
        advertised=",".join(f"{n}://{adv}" for n, (_, adv) in listeners.items()),
        protocol_map="".join(f"{n}:{protocol}," for n in listeners),
        controller_protocol="PLAINTEXT" if insecure else "SSL",
        security="" if insecure else security.server_security(
            security.SecurityFiles.of(config.home), tuple(listeners)),
        host=config.host,
        controller_port=config.controller_port,
        node_id=config.node_id,
        voters=config.quorum,
        replication_factor=config.replication_factor,
        min_insync_replicas=config.min_insync_replicas,
        data_dir=str(config.data_dir).replace("\\", "\\\\"),
        num_partitions=config.num_partitions,
        message_max_bytes=config.message_max_bytes,
    )


def render(config: BrokerConfig) -> None:
    """Everything the broker starts from, without starting it: the data and log dirs, the
    security material (secure; certificate valid for ``config.cert_hosts``), the mode
    marker and ``server.properties`` (0600: it holds the admin's password). ``up`` and
    ``flywheel broker render-config`` (compose.yaml) both run this."""
    for d in (config.data_dir, config.logs_dir):
        d.mkdir(parents=True, exist_ok=True)
    security.prepare(config.home, config.kafka_dir, config.insecure_plaintext,
                     config.cert_hosts)
    atomic_write_text(config.server_properties, render_server_properties(config))
    os.chmod(config.server_properties, security.SECRET_MODE)


def grant_roles(admin: kafka.KafkaClientConfig, home: Path, prefix: str = "") -> int:
    """As ``admin``: every role's SCRAM credential (passwords of ``home``) and the ACLs of
    the catalogue with ``prefix`` (idempotent); returns the number of ACL bindings."""
    acls.upsert_credentials(admin, security.passwords(home))
    return acls.grant_catalogue(admin, prefix)


def java_base(config: BrokerConfig, java: str) -> list[str]:
    log4j = [f"-Dlog4j2.configurationFile={LOG4J2_PATH}", f"-Dkafka.logs.dir={config.logs_dir}"]
    return [java, *log4j, "-cp", f"{config.jars_dir}{os.sep}*"]


def ensure_formatted(config: BrokerConfig, java: str) -> bool:
    """Format the data dir once (static quorum, so no --standalone); True if it formatted now."""
    if (config.data_dir / "meta.properties").is_file():
        security.check_formatted(config.state_dir, config.data_dir, config.insecure_plaintext)
        return False
    config.data_dir.mkdir(parents=True, exist_ok=True)
    args = ["--cluster-id", config.cluster_id, "--config", str(config.server_properties)]
    if not config.insecure_plaintext:  # the admin's SCRAM credential exists from the start
        args += security.add_scram_args(security.SecurityFiles.of(config.home))
    hint = "if the data dir holds another cluster's data, move it away and run `flywheel broker up`"
    cmd = [*java_base(config, java), "-Xmx256m", STORAGE_TOOL, "format", *args]
    run_tool(cmd, f"formatting {config.data_dir}", hint, 300)
    (config.state_dir / "cluster.id").write_text(config.cluster_id + "\n")
    security.mark_formatted(config.state_dir, config.insecure_plaintext)
    log.info("formatted %s with cluster id %s", config.data_dir, config.cluster_id)
    return True


def read_cluster_id(config: BrokerConfig) -> str | None:
    """The cluster id recorded in the formatted data dir, or None if not formatted."""
    meta = config.data_dir / "meta.properties"
    if not meta.is_file():
        return None
    match = re.search(r"^cluster\.id=(\S+)$", meta.read_text(), re.MULTILINE)
    return match.group(1) if match else None
