"""The embedded Apache Kafka 4.x broker: one KRaft node (:mod:`.node`) or a local cluster
of them (:mod:`.cluster`), secure by default (SASL_SSL, SCRAM, ACLs; :mod:`streams.security`).

Modules: :mod:`.config` (configuration, port layout, address checks), :mod:`.tools`
(Java, Maven, the pinned jars), :mod:`.render` (``server.properties``, formatting,
credentials), :mod:`.node` (one process), :mod:`.cluster` (N nodes), :mod:`.status`
(partition leaders and in-sync replicas).
"""

from hebrus_flywheel.streams.broker.cluster import (
    ClusterConfig,
    LocalCluster,
    NodeStatus,
    read_layout,
)
from hebrus_flywheel.streams.broker.config import (
    DEFAULT_CLUSTER_ID,
    KAFKA_DIR,
    LOG4J2_PATH,
    POM_PATH,
    SERVER_TEMPLATE_PATH,
    BrokerConfig,
    BrokerStatus,
    is_embedded,
    node_ports,
    port_open,
    probe_metadata,
    replication_for,
)
from hebrus_flywheel.streams.broker.node import MAIN_CLASS, EmbeddedBroker
from hebrus_flywheel.streams.broker.render import (
    STORAGE_TOOL,
    ensure_formatted,
    grant_roles,
    read_cluster_id,
    render,
    render_server_properties,
)
from hebrus_flywheel.streams.broker.status import ClusterView, PartitionState, cluster_view
from hebrus_flywheel.streams.broker.tools import (
    JAVA_MIN_MAJOR,
    ensure_jars,
    find_java,
    find_maven,
    pin_jars,
    tail_lines,
)

__all__ = [
    "DEFAULT_CLUSTER_ID", "JAVA_MIN_MAJOR", "KAFKA_DIR", "LOG4J2_PATH", "MAIN_CLASS",
    "POM_PATH", "SERVER_TEMPLATE_PATH", "STORAGE_TOOL", "BrokerConfig", "BrokerStatus",
    "ClusterConfig", "ClusterView", "EmbeddedBroker", "LocalCluster", "NodeStatus",
    "PartitionState", "cluster_view", "ensure_formatted", "ensure_jars", "find_java",
    "find_maven", "grant_roles", "is_embedded", "node_ports", "pin_jars", "port_open",
    "probe_metadata", "read_cluster_id", "read_layout", "render", "render_server_properties",
    "replication_for", "tail_lines",
]
