"""The local cluster's configuration without starting it: port layout, replication,
every node's server.properties, the recorded layout and the bootstrap checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka.security import is_embedded_bootstrap
from hebrus_flywheel.core.settings import EMBEDDED_BROKER_PORT
from hebrus_flywheel.streams.broker import (
    BrokerConfig,
    ClusterConfig,
    is_embedded,
    node_ports,
    render_server_properties,
    replication_for,
)
from hebrus_flywheel.streams.security import ensure_material


def _settings(text: str) -> set[str]:
    return {line for line in text.splitlines() if line and not line.startswith("#")}


def test_ports_derive_from_the_base_port() -> None:
    assert [node_ports(19700, i) for i in (1, 2, 3)] == [(19700, 19701), (19702, 19703),
                                                         (19704, 19705)]
    cluster = ClusterConfig(home=Path("/tmp/x"), nodes=3, base_port=19700)
    assert cluster.bootstrap == "127.0.0.1:19700,127.0.0.1:19702,127.0.0.1:19704"
    assert cluster.voters() == ("1@127.0.0.1:19701", "2@127.0.0.1:19703", "3@127.0.0.1:19705")
    node = cluster.node(2)
    assert (node.port, node.controller_port, node.node_id) == (19702, 19703, 2)
    assert node.data_dir == Path("/tmp/x/kafka/node-2/data")
    assert node.jars_dir == Path("/tmp/x/kafka/libs")


def test_replication_is_three_with_min_isr_two_from_three_nodes() -> None:
    assert [replication_for(n) for n in (1, 2, 3, 5)] == [(1, 1), (2, 1), (3, 2), (3, 2)]
    assert ClusterConfig(home=Path("/tmp/x"), nodes=3).node(1).min_insync_replicas == 2


@pytest.mark.parametrize("change", [{"nodes": 1}, {"nodes": 10}, {"base_port": 65533},
                                    {"heap_mb": 64}])
def test_cluster_config_refuses_bad_values_naming_the_field(change: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=r"Config\.(nodes|base_port|heap_mb)"):
        ClusterConfig(home=Path("/tmp/x"), **change)


def test_voters_must_include_the_node_and_be_distinct() -> None:
    with pytest.raises(ConfigError, match=r"BrokerConfig\.voters"):
        BrokerConfig(home=Path("/tmp/x"), node_id=4, voters=("1@h:1", "2@h:2"))
    with pytest.raises(ConfigError, match=r"BrokerConfig\.min_insync_replicas"):
        BrokerConfig(home=Path("/tmp/x"), replication_factor=1, min_insync_replicas=2)


def test_every_node_renders_the_quorum_replication_and_security(tmp_path: Path) -> None:
    cluster = ClusterConfig(home=tmp_path, nodes=3, base_port=19700)
    ensure_material(tmp_path, cluster.node(1).cert_hosts)
    for i in (1, 2, 3):
        settings = _settings(render_server_properties(cluster.node(i)))
        assert f"node.id={i}" in settings
        assert "controller.quorum.voters=1@127.0.0.1:19701,2@127.0.0.1:19703," \
            "3@127.0.0.1:19705" in settings
        assert {"default.replication.factor=3", "min.insync.replicas=2",
                "offsets.topic.replication.factor=3", "transaction.state.log.min.isr=2",
                "allow.everyone.if.no.acl.found=false"} <= settings
        assert f"listeners=SASL_SSL://127.0.0.1:{19700 + 2 * (i - 1)}," \
            f"CONTROLLER://127.0.0.1:{19701 + 2 * (i - 1)}" in settings
        assert not [s for s in settings if "PLAINTEXT" in s]


def test_single_node_renders_as_before(tmp_path: Path) -> None:
    config = BrokerConfig(home=tmp_path, port=19700, controller_port=19701)
    ensure_material(tmp_path, config.cert_hosts)
    settings = _settings(render_server_properties(config))
    assert {"node.id=1", "controller.quorum.voters=1@127.0.0.1:19701",
            "default.replication.factor=1", "min.insync.replicas=1"} <= settings
    assert config.data_dir == tmp_path / "kafka" / "data"


def test_bootstrap_lists_of_the_cluster_count_as_embedded() -> None:
    cluster = ClusterConfig(home=Path("/tmp/x"), nodes=3, base_port=19700)
    node = cluster.node(1)
    assert is_embedded(cluster.bootstrap, node, cluster.client_ports)
    assert not is_embedded(cluster.bootstrap, node)  # the single node is one address
    assert not is_embedded("127.0.0.1:19700,10.0.0.1:19702", node, cluster.client_ports)
    base = EMBEDDED_BROKER_PORT
    assert is_embedded_bootstrap(f"127.0.0.1:{base},127.0.0.1:{base + 2}")
    assert not is_embedded_bootstrap(f"127.0.0.1:{base},127.0.0.1:{base + 1}")
    assert not is_embedded_bootstrap(f"10.1.1.1:{base}")
