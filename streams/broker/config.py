"""What an embedded Kafka node (or a local cluster of them) is: its configuration, its
status, the port layout and the address checks shared by ``node`` and ``cluster``.

Port layout (all on loopback, derived from one base port ``B`` = ``$FLYWHEEL_BROKER_PORT``,
default 19092): node ``i`` (1-based) listens for clients on ``B + 2(i-1)`` and for the
KRaft controller quorum on ``B + 2(i-1) + 1``. A single node is node 1 (``B``, ``B+1``);
a 3-node cluster uses ``B .. B+5``.
"""

from __future__ import annotations

import base64
import contextlib
import re
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.settings import (
    EMBEDDED_BROKER_PORT,
    EMBEDDED_CONTROLLER_PORT,
    flywheel_home,
)
from hebrus_flywheel.streams import kafka_jars

KAFKA_DIR = kafka_jars.KAFKA_DIR
POM_PATH = kafka_jars.POM_PATH
LOG4J2_PATH = KAFKA_DIR / "log4j2.properties"
SERVER_TEMPLATE_PATH = KAFKA_DIR / "server.properties.template"
DEFAULT_CLUSTER_ID = (
    base64.urlsafe_b64encode(uuid.uuid5(uuid.NAMESPACE_URL, "hebrus-flywheel/kafka").bytes)
    .decode()
    .rstrip("=")
)
_CLUSTER_ID_RE = re.compile(r"^[A-Za-z0-9_-]{22}$")
_VOTER_RE = re.compile(r"^(\d+)@([^:@\s]+):(\d{1,5})$")
PORTS_PER_NODE = 2


def node_ports(base_port: int, node: int) -> tuple[int, int]:
    """``(client, controller)`` ports of node ``node`` (1-based) of the layout at ``base_port``."""
    client = base_port + PORTS_PER_NODE * (node - 1)
    return client, client + 1


def replication_for(nodes: int) -> tuple[int, int]:
    """``(replication factor, min.insync.replicas)`` of a cluster of ``nodes``: 3 and 2
    from three nodes up (one node may be down and acks=all writes still succeed), else
    every node holds a replica and one in-sync replica suffices."""
    return (3, 2) if nodes >= 3 else (max(nodes, 1), 1)


@dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    """Where one embedded Kafka node keeps its state and how it listens."""

    home: Path = field(default_factory=flywheel_home)
    """State root; the broker lives in ``<home>/kafka``."""
    host: str = "127.0.0.1"
    """Address both listeners bind to and the broker advertises."""
    port: int = EMBEDDED_BROKER_PORT
    """Client (SASL_SSL) listener port."""
    bind_host: str | None = None
    """Address the client listeners bind to instead of ``host`` (a container: 0.0.0.0)."""
    external: str | None = None
    """``host:port`` of a second client listener (EXTERNAL, same protocol), bound on that
    port of ``bind_host`` and advertised as given: how host tools reach a broker that runs
    in a container (published on the same port). None: one client listener."""
    controller_port: int = EMBEDDED_CONTROLLER_PORT
    """KRaft controller listener port."""
    heap_mb: int = 768
    """JVM max heap in MiB (256..1024); the initial heap is 256 MiB."""
    start_timeout_s: float = 90.0
    """How long ``up`` waits for a metadata request to succeed."""
    stop_timeout_s: float = 30.0
    """How long ``down`` waits after SIGTERM before SIGKILL."""
    cluster_id: str = DEFAULT_CLUSTER_ID
    """Cluster id used when formatting a fresh data dir (22-char base64 UUID)."""
    num_partitions: int = 4
    """Default partition count of auto-created topics (faust changelogs etc.)."""
    message_max_bytes: int = 16 * 1024 * 1024
    """Largest record batch the broker accepts (window records can exceed 1 MiB)."""
    libs_dir: Path | None = None
    """Where the jars live; ``<home>/kafka/libs`` when None (tests share one)."""
    insecure_plaintext: bool = False
    """Listen in PLAINTEXT with no authentication and no authorizer (throwaway runs only;
    recorded in the home, and every report made from such a run says so in red)."""
    node_id: int = 1
    """KRaft node id (every node is broker and controller: combined mode)."""
    voters: tuple[str, ...] = ()
    """The static controller quorum, ``id@host:port`` each; empty: this node alone."""
    replication_factor: int = 1
    """``default.replication.factor`` and the internal topics' replication (the catalogue
    is created with the broker's default)."""
    min_insync_replicas: int = 1
    """``min.insync.replicas`` (1..replication_factor): acks=all needs this many."""
    node_dir: Path | None = None
    """This node's own state (data, logs, server.properties, pid); None: ``<home>/kafka``.
    The CA, the passwords and the jars stay shared under ``<home>/kafka``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home).expanduser().resolve())
        for name in ("libs_dir", "node_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)).expanduser().resolve())
        object.__setattr__(self, "voters", tuple(self.voters))
        for name, (want, ok) in self._rules().items():
            if not ok:
                raise ConfigError(
                    f"BrokerConfig.{name} must be {want}, got {getattr(self, name)!r}"
                )

    def _rules(self) -> dict[str, tuple[str, bool]]:
        voter_ids = [int(m.group(1)) for m in map(_VOTER_RE.match, self.voters) if m]
        return {
            "host": ("a host name or address, e.g. 127.0.0.1", bool(self.host)),
            "port": ("a TCP port in 1..65535", 0 < self.port < 65536),
            "controller_port": (
                "a TCP port in 1..65535 other than port",
                0 < self.controller_port < 65536 and self.controller_port != self.port,
            ),
            "heap_mb": ("in 256..1024 (MiB)", 256 <= self.heap_mb <= 1024),
            "start_timeout_s": ("> 0 seconds", self.start_timeout_s > 0),
            "stop_timeout_s": ("> 0 seconds", self.stop_timeout_s > 0),
            "cluster_id": (
                "a 22-character base64url UUID (`kafka-storage random-uuid`)",
                bool(_CLUSTER_ID_RE.match(self.cluster_id)),
            ),
            "num_partitions": (">= 1", self.num_partitions >= 1),
            "message_max_bytes": (">= 1048576 (1 MiB)", self.message_max_bytes >= 1 << 20),
            "bind_host": ("None or a host name or address", self.bind_host != ""),
            "external": ("None or host:port on a port other than port and controller_port",
                         self.external is None or self._external_port() not in
                         (None, self.port, self.controller_port)),
            "node_id": (">= 1", self.node_id >= 1),
            "voters": ("empty or id@host:port entries with distinct ids, including node_id",
                       not self.voters or (len(voter_ids) == len(self.voters)
                                           == len(set(voter_ids))
                                           and self.node_id in voter_ids)),
            "replication_factor": (">= 1", self.replication_factor >= 1),
            "min_insync_replicas": ("in 1..replication_factor",
                                    1 <= self.min_insync_replicas <= self.replication_factor),
        }

    def _external_port(self) -> int | None:
        host, _, port = (self.external or "").rpartition(":")
        return int(port) if host and port.isdigit() and 0 < int(port) < 65536 else None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def quorum(self) -> str:
        """``controller.quorum.voters``: the configured voters, else this node alone."""
        return ",".join(self.voters) or f"{self.node_id}@{self.host}:{self.controller_port}"

    @property
    def cert_hosts(self) -> tuple[str, ...]:
        """The names clients and peers verify the broker's certificate against (besides
        127.0.0.1 and localhost): ``host``, the external listener's host and every voter's
        host (the nodes of a cluster share one certificate)."""
        external = (self.external or "").rpartition(":")[0]
        peers = [m.group(2) for m in map(_VOTER_RE.match, self.voters) if m]
        return tuple(dict.fromkeys(h for h in (self.host, external, *peers) if h))

    @property
    def kafka_dir(self) -> Path:
        return self.home / "kafka"

    @property
    def state_dir(self) -> Path:
        """This node's own directory (``node_dir``, else ``kafka_dir``)."""
        return self.node_dir or self.kafka_dir

    @property
    def jars_dir(self) -> Path:
        return self.libs_dir or self.kafka_dir / "libs"

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def server_properties(self) -> Path:
        return self.state_dir / "server.properties"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "broker.pid"


@dataclass(frozen=True, kw_only=True)
class BrokerStatus:
    """A snapshot of one embedded node's state."""

    running: bool
    pid: int | None
    bootstrap: str
    data_dir: Path
    formatted: bool
    cluster_id: str | None
    metadata_ok: bool
    log_file: Path

    def lines(self) -> list[str]:
        state = "running" if self.running else "stopped"
        return [
            f"state:       {state}" + (f" (pid {self.pid})" if self.pid else ""),
            f"bootstrap:   {self.bootstrap}",
            f"metadata:    {'ok' if self.metadata_ok else 'unreachable'}",
            f"data dir:    {self.data_dir}" + ("" if self.formatted else " (not formatted yet)"),
            f"cluster id:  {self.cluster_id or '-'}",
            f"log:         {self.log_file}",
        ]


def is_embedded(bootstrap: str, config: BrokerConfig, ports: tuple[int, ...] = ()) -> bool:
    """Whether ``bootstrap`` names only this embedded node, or only nodes of the local
    cluster whose client ports are ``ports``."""
    local = {"127.0.0.1", "localhost", config.host}
    allowed = {str(p) for p in (ports or (config.port,))}
    entries = [e.strip().rpartition(":") for e in bootstrap.split(",")]
    if not ports and len(entries) != 1:
        return False
    return all(host in local and port in allowed for host, _, port in entries)


def probe_metadata(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """True when a metadata request to ``bootstrap`` succeeds and lists at least one broker."""
    return kafka.probe(kafka.client_config(bootstrap), timeout_s)


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout_s):
        return True
    return False
