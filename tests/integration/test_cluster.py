"""A real 3-node local cluster (``flywheel broker up --nodes 3``) on its own ports and home.

The fixture starts the cluster once for the module (base port ``$FLYWHEEL_BROKER_PORT +
10``, or ``$FLYWHEEL_CLUSTER_TEST_PORT``: nodes on base..base+5) and stops it at the end.
Covered: catalogue topics get replication factor 3 and min.insync.replicas 2; every node
refuses plaintext clients and denies what no ACL allows; with the leader of a partition
killed (-9), acks=all produce and consume still work, ``flywheel broker status`` shows
the node down and the ISR shrunk, and after a restart every ISR is full again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.settings import EMBEDDED_BROKER_PORT
from hebrus_flywheel.streams import security
from hebrus_flywheel.streams.broker import (
    BrokerConfig,
    ClusterConfig,
    LocalCluster,
    cluster_view,
)
from hebrus_flywheel.streams.topics import (
    TopicSpec,
    catalogue,
    create_topics,
    describe_topics,
    window_topic,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASE_PORT = int(os.environ.get("FLYWHEEL_CLUSTER_TEST_PORT") or EMBEDDED_BROKER_PORT + 10)
PREFIX = "cluster."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    home = tmp_path_factory.mktemp("cluster-home")
    local = LocalCluster(ClusterConfig(home=home, nodes=3, base_port=BASE_PORT, heap_mb=384,
                                       libs_dir=BrokerConfig().jars_dir))
    try:
        local.up()
        yield local
    finally:
        local.down()


def role(cluster: LocalCluster, name: str, bootstrap: str | None = None
         ) -> kafka.KafkaClientConfig:
    files = security.SecurityFiles.of(cluster.config.home)
    return kafka.KafkaClientConfig(bootstrap_servers=bootstrap or cluster.bootstrap,
                                   properties=security.role_properties(files, name),
                                   retry=kafka.RetryPolicy(attempts=1))


def test_catalogue_topics_get_three_replicas_and_min_isr_two(cluster: LocalCluster) -> None:
    admin = cluster.admin_config()
    specs = catalogue(PREFIX)
    create_topics(admin, specs)
    view = _settled_view(admin, {s.name for s in specs})
    assert {p.topic for p in view.partitions} == {s.name for s in specs}
    assert all(len(p.replicas) == 3 and len(p.isr) == 3 for p in view.partitions)
    assert view.brokers == (1, 2, 3)
    infos = describe_topics(admin, [s.name for s in specs])
    assert {i.configs.get("min.insync.replicas") for i in infos.values()} == {"2"}


def _settled_view(admin: kafka.KafkaClientConfig, topics: set[str],
                  timeout_s: float = 60.0) -> Any:
    """The cluster's view once every node is registered, the node asked knows every new
    topic and every new partition's replicas are all in sync, or whatever it is at the
    deadline: right after creation the node answering may not have the new topics in its
    metadata yet (a fresh-clone CI run saw none of them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = cluster_view(admin, prefix=PREFIX)
        settled = (view.brokers == (1, 2, 3) and {p.topic for p in view.partitions} == topics
                   and all(len(p.isr) == 3 for p in view.partitions))
        if settled or time.monotonic() > deadline:
            return view
        time.sleep(1.0)


def test_every_node_refuses_plaintext_and_denies_what_no_acl_allows(
        cluster: LocalCluster) -> None:
    unlisted = f"{PREFIX}no-acl.v1"
    create_topics(cluster.admin_config(), [TopicSpec(name=unlisted, partitions=1,
                                                     doc="a topic no role has an ACL on")])
    for node in cluster.nodes.values():
        address = node.config.bootstrap
        plain = kafka.KafkaClientConfig(bootstrap_servers=address,
                                        properties={"security.protocol": "PLAINTEXT"})
        assert not kafka.probe(plain, 4.0), address
        runtime = role(cluster, "runtime", address)
        assert kafka.probe(runtime, 15.0), address  # authenticated, so the denial is an ACL's
        metadata = kafka.make_admin(runtime).list_topics(topic=unlisted, timeout=15)
        error = metadata.topics[unlisted].error
        assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, \
            (address, error)
        text = node.config.server_properties.read_text()
        assert "allow.everyone.if.no.acl.found=false" in text
        assert "StandardAuthorizer" in text and "PLAINTEXT://" not in text


def _status(cluster: LocalCluster) -> str:
    env = {**os.environ, "FLYWHEEL_BROKER_PORT": str(BASE_PORT)}
    env.pop("FLYWHEEL_BOOTSTRAP_SERVERS", None)
    env.pop("FLYWHEEL_KAFKA_CONFIG", None)
    flywheel = Path(sys.executable).parent / "flywheel"
    out = subprocess.run([str(flywheel), "broker", "status", "--home",
                          str(cluster.config.home), "--prefix", PREFIX],
                         capture_output=True, text=True, env=env, timeout=120, check=True)
    return out.stdout


def _wait_for(cluster: LocalCluster, full: bool, timeout_s: float = 120) -> None:
    """Until every partition under PREFIX has a full (or every one a shrunk) ISR."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = cluster_view(cluster.admin_config(), prefix=PREFIX)
        if all((len(p.isr) == 3) == full for p in view.partitions) and view.partitions:
            return
        time.sleep(1.0)
    pytest.fail(f"ISRs under {PREFIX} never became {'full' if full else 'shrunk'}: {view.lines()}")


def test_kill_one_node_then_acks_all_still_works_and_status_shows_isr(
        cluster: LocalCluster) -> None:
    topic = PREFIX + window_topic("train")
    create_topics(cluster.admin_config(), catalogue(PREFIX))
    view = cluster_view(cluster.admin_config(), [topic])
    victim = next(p.leader for p in view.partitions if p.partition == 0)
    pid = cluster.nodes[victim].pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _wait_for(cluster, full=False)
    status = _status(cluster)
    assert f"{victim} DOWN" in status and "UNDER-REPLICATED" in status, status

    config = role(cluster, "admin")
    producer = kafka.CheckedProducer(config)  # acks=all, idempotent
    values = [f"v{i}".encode() for i in range(40)]
    for i, value in enumerate(values):
        producer.produce(topic, value, key=f"k{i}".encode())
    producer.flush(60, what="records while a node is down")
    got = [m.value() for m in kafka.read_to_end(config, [topic], timeout_s=60)]
    assert sorted(got) == sorted(values)

    cluster.start_node(victim)
    _wait_for(cluster, full=True)
    status = _status(cluster)
    assert f"{victim} up" in status and "(0 under-replicated)" in status, status
