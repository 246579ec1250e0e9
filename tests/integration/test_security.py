"""Transport, identity and least privilege against the real (secure) embedded broker.

Refusals: a client without TLS/SASL, a wrong password, a client that trusts another CA,
and a foreign certificate on the mutual-TLS controller listener. Then the ACL matrix:
every role × every catalogue topic (read, write) and group (describe), asserted against
the broker and against the role table of ``streams/acls.py``, and printed.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.kafka.security import ROLES, insecure_marker, role_properties_path
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV, read_kafka_properties
from hebrus_flywheel.streams.acls import role_grants
from hebrus_flywheel.streams.broker import BrokerConfig
from hebrus_flywheel.streams.processors.topology import DEFAULT_APP_ID
from hebrus_flywheel.streams.security import SecurityFiles, make_ca, make_server_pem
from hebrus_flywheel.streams.topics import TopicSpec

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bool(os.environ.get(BOOTSTRAP_ENV)) or insecure_marker().is_file(),
                       reason="needs the secure embedded broker"),
]
DENIED = {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
          KafkaError.CLUSTER_AUTHORIZATION_FAILED}


def role_config(bootstrap: str, role: str, **change: str) -> kafka.KafkaClientConfig:
    props = {**read_kafka_properties(role_properties_path(role)), **change}
    return kafka.KafkaClientConfig(bootstrap_servers=bootstrap, properties=props,
                                   retry=kafka.RetryPolicy(attempts=1))


# --------------------------------------------------------------------------- refusals


def test_each_role_connects_with_its_own_properties(kafka_bootstrap: str) -> None:
    for role in ROLES:
        assert kafka.probe(role_config(kafka_bootstrap, role), 15.0), role


def test_unauthenticated_client_is_refused(kafka_bootstrap: str) -> None:
    plain = kafka.KafkaClientConfig(bootstrap_servers=kafka_bootstrap,
                                    properties={"security.protocol": "PLAINTEXT"})
    assert not kafka.probe(plain, 4.0)
    ca = read_kafka_properties(role_properties_path("admin"))["ssl.ca.location"]
    tls_only = kafka.KafkaClientConfig(bootstrap_servers=kafka_bootstrap, properties={
        "security.protocol": "SSL", "ssl.ca.location": ca})
    assert not kafka.probe(tls_only, 4.0)


def test_wrong_password_is_refused(kafka_bootstrap: str) -> None:
    assert not kafka.probe(role_config(kafka_bootstrap, "admin", **{"sasl.password": "wrong"}),
                           4.0)
    # Another role's password for the admin's name is just as wrong.
    other = read_kafka_properties(role_properties_path("runtime"))["sasl.password"]
    assert not kafka.probe(role_config(kafka_bootstrap, "admin", **{"sasl.password": other}),
                           4.0)


def test_broker_certificate_is_checked_against_the_ca(kafka_bootstrap: str,
                                                      tmp_path: Path) -> None:
    other = SecurityFiles(root=tmp_path)
    make_ca(other, "some other CA")
    config = role_config(kafka_bootstrap, "admin", **{"ssl.ca.location": str(other.ca_cert)})
    assert not kafka.probe(config, 4.0)


def test_controller_listener_refuses_certificates_of_another_ca(kafka_bootstrap: str,
                                                                tmp_path: Path) -> None:
    ours = SecurityFiles.of(BrokerConfig().home)
    other = SecurityFiles(root=tmp_path)
    make_ca(other, "some other CA")
    make_server_pem(other, tmp_path / "client.pem", "flywheel-broker")  # same name, wrong CA
    controller = BrokerConfig().controller_port
    for cert in (tmp_path / "client.pem", None):
        context = ssl.create_default_context(cafile=str(ours.ca_cert))
        if cert is not None:
            context.load_cert_chain(str(cert))
        assert not _controller_accepts(context, controller), cert


def _controller_accepts(context: ssl.SSLContext, port: int) -> bool:
    """Whether the controller keeps a TLS connection with this client open (it closes or
    alerts at once when it refuses the client's certificate)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"\x00\x00\x00\x00")
            return tls.recv(1) != b""
    except (ssl.SSLError, ConnectionError, TimeoutError):
        return False
    except OSError:
        return False


# --------------------------------------------------------------------------- the matrix


def _allowed(role: str, kind: str, name: str, prefix: str, ops: set[str]) -> bool:
    """What the role table says: some grant on a prefix of ``name`` has one of ``ops``
    (the admin is a super user)."""
    if role == "admin":
        return True
    return any(g.kind == kind and name.startswith(g.prefix)
               and bool(ops & set(g.operations) or "ALL" in g.operations)
               for g in role_grants(role, prefix))


def _writes(config: kafka.KafkaClientConfig, topics: list[str]) -> dict[str, bool]:
    producer = kafka.make_producer(config, settings={"enable.idempotence": False,
                                                     "message.timeout.ms": 20000})
    out: dict[str, bool] = {}

    def report(topic: str):  # type: ignore[no-untyped-def]
        def done(err: KafkaError | None, _msg: object) -> None:
            out[topic] = err is None
            assert err is None or err.code() in DENIED, f"{topic}: {err}"
        return done

    for topic in topics:
        producer.produce(topic, key=b"acl-matrix", value=b"x", on_delivery=report(topic))
    assert producer.flush(40) == 0
    return out


def _reads(config: kafka.KafkaClientConfig, topics: list[str]) -> dict[str, bool]:
    """Per topic, whether a fetch from offset 0 succeeds; a topic the role may not even
    describe is absent from its metadata and denied without a fetch."""
    consumer = kafka.make_consumer(config)
    try:
        visible = set(consumer.list_topics(timeout=20).topics)
        out = {t: False for t in topics if t not in visible}
        consumer.assign([TopicPartition(t, 0, OFFSET_BEGINNING) for t in topics if t in visible])
        deadline = time.monotonic() + 30
        while len(out) < len(topics) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.topic() not in topics or msg.topic() in out:
                continue
            err = msg.error()
            if err is None or err.code() == KafkaError._PARTITION_EOF:
                out[msg.topic()] = True
            elif err.code() in DENIED:
                out[msg.topic()] = False
    finally:
        consumer.close()
    return out


def _describes_group(config: kafka.KafkaClientConfig, group: str) -> bool:
    admin = kafka.make_admin(config)
    future = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                               request_timeout=20)[group]
    try:
        future.result(timeout=30)
    except KafkaException as exc:
        assert exc.args[0].code() in DENIED, exc
        return False
    return True


@pytest.fixture(scope="module")
def matrix_topics(topic_factory) -> tuple[str, dict[str, str]]:  # type: ignore[no-untyped-def]
    prefix = topic_factory.prefix
    specs = {s.name[len(prefix):]: s.name for s in topic_factory.catalogue()}
    for name in (f"{DEFAULT_APP_ID}-threads-v1", f"{DEFAULT_APP_ID}-decisions-v1",
                 f"{DEFAULT_APP_ID}-crashes-v1"):
        topic_factory.create([TopicSpec(name=prefix + name, partitions=1, doc="internal")])
        specs[name] = prefix + name
    return prefix, specs


def test_acl_matrix(kafka_bootstrap: str, matrix_topics: tuple[str, dict[str, str]]) -> None:
    prefix, topics = matrix_topics
    groups = {"streams group": prefix + DEFAULT_APP_ID, "replay group": prefix + "flywheel-replay",
              "reader group": f"flywheel-reader-{uuid.uuid4().hex}",
              "other group": prefix + "someone-else"}
    names = sorted(topics.values())
    rows: dict[str, dict[str, str]] = {}
    mismatches = []
    for role in ROLES:
        config = role_config(kafka_bootstrap, role)
        writes, reads = _writes(config, names), _reads(config, names)
        row = {}
        for short, name in sorted(topics.items()):
            got = (reads.get(name), writes.get(name))
            want = (_allowed(role, "topic", name, prefix, {"READ"}),
                    _allowed(role, "topic", name, prefix, {"WRITE"}))
            row[short] = ("r" if got[0] else "-") + ("w" if got[1] else "-")
            if got != want:
                mismatches.append(f"{role} {short}: broker {got}, table {want}")
        for label, group in groups.items():
            got_g = _describes_group(config, group)
            want_g = _allowed(role, "group", group, prefix, {"READ", "DESCRIBE"})
            row[label] = "d" if got_g else "-"
            if got_g != want_g:
                mismatches.append(f"{role} {label}: broker {got_g}, table {want_g}")
        rows[role] = row
    _print_matrix(rows)
    assert not mismatches, mismatches
    # The examples, spelled out.
    assert rows["runtime"]["flywheel.windows.train.v1"] == "--"
    assert rows["runtime"]["flywheel.quarantine.records.v1"] == "--"
    assert rows["runtime"]["flywheel.capture.observations.v1"] == "-w"
    assert rows["trainer"]["flywheel.control.epochs.v1"] == "--"
    assert rows["replay"]["flywheel.capture.observations.v1"] == "--"
    # The consent ledger: only the admin writes it; every stage reads it.
    assert rows["admin"]["flywheel.consent.ledger.v1"] == "rw"
    for role in ("runtime", "streams", "replay", "sealer", "trainer"):
        assert rows[role]["flywheel.consent.ledger.v1"] == "r-", role


def _print_matrix(rows: Mapping[str, Mapping[str, str]]) -> None:
    columns = list(next(iter(rows.values())))
    width = max(len(c) for c in columns)
    print("\nACL matrix (r=read, w=write, d=describe group; - denied), from the broker:")
    print(" " * width + "  " + "  ".join(f"{r:>7}" for r in rows))
    for column in columns:
        print(f"{column:<{width}}  " + "  ".join(f"{rows[r][column]:>7}" for r in rows))


# --------------------------------------------------------------------------- CLI, opt-out


def test_cli_prints_pasteable_credentials(kafka_bootstrap: str) -> None:
    from typer.testing import CliRunner

    from hebrus_flywheel.streams.cli import broker_app

    result = CliRunner().invoke(broker_app, ["credentials", "--role", "replay"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line and not line.startswith("#")]
    props = dict(line.split("=", 1) for line in lines)
    assert props["security.protocol"] == "SASL_SSL" and props["sasl.username"] == "replay"
    assert Path(props["ssl.ca.location"]).is_file()
    assert "password file:" in result.output
    assert kafka.probe(kafka.KafkaClientConfig(bootstrap_servers=kafka_bootstrap,
                                               properties=props), 15.0)
    bad = CliRunner().invoke(broker_app, ["credentials", "--role", "root"])
    assert bad.exit_code == 2 and "one of" in bad.output


def test_insecure_plaintext_is_an_explicit_recorded_opt_out(tmp_path: Path) -> None:
    from hebrus_flywheel.core.kafka.security import insecure_plaintext
    from hebrus_flywheel.streams.broker import EmbeddedBroker

    libs = BrokerConfig().jars_dir
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = (a.getsockname()[1], b.getsockname()[1])
    config = BrokerConfig(home=tmp_path, port=ports[0], controller_port=ports[1], heap_mb=256,
                          insecure_plaintext=True,
                          libs_dir=libs if (libs / ".pom.sha256").is_file() else None)
    broker = EmbeddedBroker(config)
    try:
        assert broker.up() is True
        assert insecure_marker(tmp_path).is_file()
        assert not (tmp_path / "kafka" / "security").exists()
        plain = kafka.KafkaClientConfig(bootstrap_servers=config.bootstrap)
        assert kafka.probe(plain, 15.0)
        saved = os.environ.pop("FLYWHEEL_KAFKA_CONFIG", None)
        try:
            assert insecure_plaintext(tmp_path)
        finally:
            if saved is not None:
                os.environ["FLYWHEEL_KAFKA_CONFIG"] = saved
    finally:
        broker.down()
