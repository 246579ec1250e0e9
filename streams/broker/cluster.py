"""A local Kafka cluster: ``flywheel broker up --nodes N`` starts N embedded nodes of one
home on loopback, secure exactly like the single node.

Topology: KRaft **combined** mode, every node is a broker and a controller voter (a
static quorum of N voters: with 3 nodes, one may be down). Node ``i`` keeps its state in
``<home>/kafka/node-<i>`` and listens on the ports of the layout in
:mod:`streams.broker.config` (client ``B + 2(i-1)``, controller ``B + 2(i-1) + 1``).
The nodes share ``<home>/kafka/security`` (one CA, one broker certificate whose CN is a
super user, the roles' SCRAM passwords; each data dir is formatted with the admin's SCRAM
credential) and ``<home>/kafka/libs`` (the pinned jars). From three nodes up, topics get
replication factor 3 and ``min.insync.replicas=2`` (:func:`replication_for`).

``<home>/kafka/cluster.json`` records the layout that ``up`` started, so ``down`` and
``status`` find every node without being told the node count again.
"""

from __future__ import annotations

import contextlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write_text, exclusive_lock
from hebrus_flywheel.core.settings import EMBEDDED_BROKER_PORT, flywheel_home
from hebrus_flywheel.streams import security
from hebrus_flywheel.streams.broker.config import (
    BrokerConfig,
    BrokerStatus,
    node_ports,
    replication_for,
)
from hebrus_flywheel.streams.broker.node import EmbeddedBroker
from hebrus_flywheel.streams.broker.render import grant_roles
from hebrus_flywheel.streams.broker.tools import tail_lines
from hebrus_flywheel.streams.exceptions import BrokerError

log = logging.getLogger(__name__)
LAYOUT_FILE = "cluster.json"
MAX_NODES = 9


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """A local cluster of embedded nodes.

    Fields:
        home: state root (nodes under ``<home>/kafka/node-<i>``).
        nodes: how many nodes (2..9); each is broker and controller voter.
        base_port: first port of the layout (node i: client ``base + 2(i-1)``,
            controller the next port).
        host: loopback address every node binds to and advertises.
        heap_mb: each node's JVM max heap (MiB).
        start_timeout_s, stop_timeout_s: as :class:`BrokerConfig`, per node.
        insecure_plaintext: as :class:`BrokerConfig` (throwaway runs only).
        libs_dir: where the jars live (default ``<home>/kafka/libs``; tests share one).
    """

    home: Path = field(default_factory=flywheel_home)
    nodes: int = 3
    base_port: int = EMBEDDED_BROKER_PORT
    host: str = "127.0.0.1"
    heap_mb: int = 512
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 30.0
    insecure_plaintext: bool = False
    libs_dir: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home).expanduser().resolve())
        if not 2 <= self.nodes <= MAX_NODES:
            raise ConfigError(f"ClusterConfig.nodes must be in 2..{MAX_NODES} (one node is "
                              f"the plain embedded broker), got {self.nodes!r}")
        last = node_ports(self.base_port, self.nodes)[1]
        if not (self.base_port > 0 and last < 65536):
            raise ConfigError(f"ClusterConfig.base_port must leave room for {self.nodes} "
                              f"nodes' ports below 65536, got {self.base_port!r}")
        self.node(1)  # every node's BrokerConfig rule (heap, timeouts) applies here

    @property
    def kafka_dir(self) -> Path:
        return self.home / "kafka"

    @property
    def client_ports(self) -> tuple[int, ...]:
        return tuple(node_ports(self.base_port, i)[0] for i in range(1, self.nodes + 1))

    @property
    def bootstrap(self) -> str:
        """Every node's client address: a client bootstraps while any one is up."""
        return ",".join(f"{self.host}:{p}" for p in self.client_ports)

    def voters(self) -> tuple[str, ...]:
        return tuple(f"{i}@{self.host}:{node_ports(self.base_port, i)[1]}"
                     for i in range(1, self.nodes + 1))

    def node(self, i: int) -> BrokerConfig:
        """The :class:`BrokerConfig` of node ``i`` (1-based)."""
        client, controller = node_ports(self.base_port, i)
        rf, min_isr = replication_for(self.nodes)
        return BrokerConfig(
            home=self.home, host=self.host, port=client, controller_port=controller,
            heap_mb=self.heap_mb, start_timeout_s=self.start_timeout_s,
            stop_timeout_s=self.stop_timeout_s, insecure_plaintext=self.insecure_plaintext,
            node_id=i, voters=self.voters(), replication_factor=rf, min_insync_replicas=min_isr,
            node_dir=self.kafka_dir / f"node-{i}", libs_dir=self.libs_dir)


def read_layout(home: Path) -> ClusterConfig | None:
    """The cluster recorded in ``<home>/kafka/cluster.json`` by ``up``, or None."""
    path = home / "kafka" / LAYOUT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return ClusterConfig(home=home, nodes=int(data["nodes"]),
                             base_port=int(data["base_port"]), host=str(data["host"]))
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        raise BrokerError(f"{path} is not a cluster layout flywheel wrote ({exc}); stop the "
                          "nodes by hand and remove it") from exc


@dataclass(frozen=True, kw_only=True)
class NodeStatus:
    node_id: int
    status: BrokerStatus


class LocalCluster:
    """Start, stop and inspect the nodes of a :class:`ClusterConfig` (the same interface
    as :class:`EmbeddedBroker`, so the CLI drives either)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.nodes = {i: EmbeddedBroker(config.node(i)) for i in range(1, config.nodes + 1)}

    @property
    def bootstrap(self) -> str:
        return self.config.bootstrap

    def up(self) -> bool:
        """Start every node that is not running (all spawned before any is waited for: a
        node answers only once a quorum majority runs), wait for each, then store the
        roles' credentials and ACLs. False if every node was already running."""
        with self._locked():
            self._refuse_single_node()
            atomic_write_text(self.config.kafka_dir / LAYOUT_FILE, json.dumps({
                "nodes": self.config.nodes, "base_port": self.config.base_port,
                "host": self.config.host}) + "\n")
            started = [i for i, node in self.nodes.items() if node.start() is not None]
            for node in self.nodes.values():
                node.wait_ready()
            if not self.config.insecure_plaintext:
                grant_roles(self.admin_config(), self.config.home)
            log.info("local Kafka cluster up on %s (started nodes %s)", self.bootstrap, started)
            return bool(started)

    def start_node(self, i: int) -> None:
        """Start node ``i`` alone (after it was killed) and wait until it answers."""
        with self._locked():
            self.nodes[i].start()
            self.nodes[i].wait_ready()

    def down(self) -> bool:
        """Stop every node at once (one by one, the last ones would wait for a quorum that
        is gone); False if none was running. The layout file is removed."""
        with self._locked(), ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            stopped = list(pool.map(EmbeddedBroker.down, self.nodes.values()))
            (self.config.kafka_dir / LAYOUT_FILE).unlink(missing_ok=True)
            return any(stopped)

    def status(self, probe_timeout_s: float = 3.0) -> list[NodeStatus]:
        return [NodeStatus(node_id=i, status=n.status(probe_timeout_s))
                for i, n in self.nodes.items()]

    def admin_config(self) -> kafka.KafkaClientConfig:
        return security.admin_config(self.config.home, self.bootstrap,
                                     self.config.insecure_plaintext)

    def log_tail(self, lines: int = 50) -> list[str]:
        """The last ``lines`` lines of every node's ``server.log``, each prefixed by its node."""
        out = []
        for i, node in self.nodes.items():
            out += [f"[node {i}] {line}" for line in
                    tail_lines(node.config.logs_dir / "server.log", lines)]
        return out

    def _refuse_single_node(self) -> None:
        single = EmbeddedBroker(replace(self.config.node(1), node_dir=None, voters=(),
                                        node_id=1, replication_factor=1,
                                        min_insync_replicas=1, libs_dir=None))
        if single.pid() is not None:
            raise BrokerError(f"the single-node broker of {self.config.home} is running; run "
                              "`flywheel broker down` before `flywheel broker up --nodes N`")

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return exclusive_lock(self.config.kafka_dir / ".cluster.lock")
