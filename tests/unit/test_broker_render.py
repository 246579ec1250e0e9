"""``flywheel broker render-config``: the files compose.yaml's broker and workers start
from, rendered by the same code as ``flywheel broker up`` (no Docker, no broker here;
tests/integration/test_broker_render.py starts a broker from them)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka.security import ROLES
from hebrus_flywheel.core.settings import read_kafka_properties
from hebrus_flywheel.streams.broker import BrokerConfig
from hebrus_flywheel.streams.cli import broker_app
from hebrus_flywheel.streams.container import parse_owner
from hebrus_flywheel.streams.security import SecurityFiles, cert_hosts


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _render(home: Path) -> str:
    result = CliRunner().invoke(broker_app, [
        "render-config", "--home", str(home), "--host", "kafka", "--external",
        "127.0.0.1:19092", "--clients-mount", "/etc/flywheel/kafka"])
    assert result.exit_code == 0, result.output
    return (home / "kafka" / "server.properties").read_text()


def test_rendered_server_properties_are_secure(tmp_path: Path) -> None:
    text = _render(tmp_path)
    settings = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert not [line for line in settings if "PLAINTEXT" in line]
    for line in (
        "listeners=SASL_SSL://0.0.0.0:9094,EXTERNAL://0.0.0.0:19092,CONTROLLER://kafka:19093",
        "advertised.listeners=SASL_SSL://kafka:9094,EXTERNAL://127.0.0.1:19092",
        "listener.security.protocol.map=SASL_SSL:SASL_SSL,EXTERNAL:SASL_SSL,CONTROLLER:SSL",
        "controller.quorum.voters=1@kafka:19093",
        "auto.create.topics.enable=false", "allow.everyone.if.no.acl.found=false",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "listener.name.controller.ssl.client.auth=required",
        "ssl.endpoint.identification.algorithm=https",
    ):
        assert line in settings, line
    for listener in ("sasl_ssl", "external"):
        assert any(s.startswith(f"listener.name.{listener}.scram-sha-512.sasl.jaas.config=")
                   for s in settings), listener
    # the certificate is valid for the container's name and for host tools
    assert {"kafka", "127.0.0.1", "localhost"} <= cert_hosts(
        SecurityFiles.of(tmp_path).broker_pem)


def test_rendered_secrets_are_private(tmp_path: Path) -> None:
    _render(tmp_path)
    files = SecurityFiles.of(tmp_path)
    secrets = [tmp_path / "kafka" / "server.properties", files.ca_key, files.broker_pem,
               tmp_path / "kafka" / "admin-java.properties",
               *(files.password_file(r) for r in ROLES),
               *(tmp_path / "clients" / r / "client.properties" for r in ROLES)]
    assert {p.name: _mode(p) for p in secrets} == {p.name: 0o600 for p in secrets}
    assert _mode(files.root) == 0o700
    assert {_mode(tmp_path / "clients" / r) for r in ROLES} == {0o700}
    script = (tmp_path / "kafka" / "start.sh").read_text()
    assert "--add-scram" in script and files.password("admin") not in script


def test_rendered_client_properties_name_the_mounted_ca(tmp_path: Path) -> None:
    _render(tmp_path)
    for role in ROLES:
        props = read_kafka_properties(tmp_path / "clients" / role / "client.properties")
        assert props["ssl.ca.location"] == "/etc/flywheel/kafka/ca.crt"
        assert props["sasl.username"] == role
        assert props["security.protocol"] == "SASL_SSL"
        assert (tmp_path / "clients" / role / "ca.crt").read_text() == \
            SecurityFiles.of(tmp_path).ca_cert.read_text()


def test_render_is_idempotent(tmp_path: Path) -> None:
    _render(tmp_path)
    files = SecurityFiles.of(tmp_path)
    before = files.password("streams"), files.ca_cert.read_text(), files.broker_pem.read_text()
    _render(tmp_path)
    assert (files.password("streams"), files.ca_cert.read_text(),
            files.broker_pem.read_text()) == before


def test_render_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"BrokerConfig\.external"):
        BrokerConfig(home=tmp_path, external="127.0.0.1:19092", port=19092)
    with pytest.raises(ConfigError, match="--owner"):
        parse_owner("appuser")
    assert parse_owner("1000:1000") == (1000, 1000)
    bad = CliRunner().invoke(broker_app, ["render-config", "--home", str(tmp_path), "--host",
                                          "kafka", "--external", "nohost"])
    assert bad.exit_code == 2 and "BrokerConfig.external" in bad.output


def test_segment_indexes_are_small_sparse_files(tmp_path: Path) -> None:
    # Every fresh partition maps an offset and a time index of this size; its first touch
    # faults in up to the disk's read-ahead, zero-filled (8 MiB on this build machine's
    # virtual disk). Kafka's 10 MiB default made that most of the broker's CPU on new
    # topics; 1 MiB still indexes 512 MiB of log per segment.
    settings = dict(line.split("=", 1) for line in _render(tmp_path).splitlines()
                    if line and not line.startswith("#"))
    assert int(settings["log.index.size.max.bytes"]) == 1 << 20
