"""Security material, role selection and the role table, without a broker."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509

from hebrus_flywheel.consumers.worker import ReplayWorkerConfig
from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka import security as roles
from hebrus_flywheel.core.settings import EMBEDDED_BOOTSTRAP, KAFKA_CONFIG_ENV
from hebrus_flywheel.streams import acls
from hebrus_flywheel.streams.broker import BrokerConfig, render_server_properties
from hebrus_flywheel.streams.security import SecurityFiles, ensure_material, server_security


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    monkeypatch.delenv(KAFKA_CONFIG_ENV, raising=False)
    monkeypatch.delenv(roles.ROLE_ENV, raising=False)
    return tmp_path


def test_material_is_private_and_reused(home: Path) -> None:
    files = ensure_material(home)
    assert stat.S_IMODE(files.root.stat().st_mode) == 0o700
    secrets = [files.ca_key, files.broker_pem,
               *(files.password_file(r) for r in roles.ROLES),
               *(files.properties_file(r) for r in roles.ROLES)]
    for path in secrets:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    before = {p: p.read_bytes() for p in [*secrets, files.ca_cert]}
    ensure_material(home)
    assert {p: p.read_bytes() for p in before} == before


def test_broker_certificate_names_the_local_addresses(home: Path) -> None:
    files = ensure_material(home)
    cert = x509.load_pem_x509_certificate(files.broker_pem.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    cert.verify_directly_issued_by(ca)


def test_role_properties_are_librdkafka_properties(home: Path) -> None:
    ensure_material(home)
    props = roles.embedded_properties(EMBEDDED_BOOTSTRAP, "runtime")
    assert props["security.protocol"] == "SASL_SSL"
    assert props["sasl.mechanism"] == "SCRAM-SHA-512"
    assert props["sasl.username"] == "runtime"
    assert props["ssl.endpoint.identification.algorithm"] == "https"
    assert Path(props["ssl.ca.location"]).is_file()
    config = kafka.KafkaClientConfig(bootstrap_servers=EMBEDDED_BOOTSTRAP, properties=props)
    assert "SASLCredentials" in type(kafka.faust_settings(config)["broker_credentials"]).__name__
    assert "password" not in repr(config)


def test_client_config_uses_the_process_role(home: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ensure_material(home)
    assert kafka.client_config(EMBEDDED_BOOTSTRAP).properties["sasl.username"] == "admin"
    assert roles.declare_role("streams") == "streams"
    assert kafka.client_config(EMBEDDED_BOOTSTRAP).properties["sasl.username"] == "streams"
    assert roles.declare_role("replay") == "streams"  # an inherited role wins
    assert kafka.client_config(EMBEDDED_BOOTSTRAP,
                               role="sealer").properties["sasl.username"] == "sealer"
    # Another cluster gets nothing of ours; a user's Kafka config always wins.
    assert dict(kafka.client_config("broker.example:9093").properties) == {}
    mine = home / "mine.properties"
    mine.write_text("security.protocol=SSL\n")
    monkeypatch.setenv(KAFKA_CONFIG_ENV, str(mine))
    assert dict(kafka.client_config(EMBEDDED_BOOTSTRAP).properties) == {
        "security.protocol": "SSL"}


def test_insecure_home_uses_no_properties(home: Path) -> None:
    ensure_material(home)
    roles.insecure_marker(home).write_text("x")
    assert roles.insecure_plaintext(home)
    assert dict(kafka.client_config(EMBEDDED_BOOTSTRAP).properties) == {}


def test_unknown_role_is_refused(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="role"):
        roles.declare_role("root")
    monkeypatch.setenv(roles.ROLE_ENV, "root")
    with pytest.raises(ConfigError, match="root"):
        roles.current_role()


def test_server_properties_secure_by_default(home: Path) -> None:
    ensure_material(home)
    text = render_server_properties(BrokerConfig(home=home))
    assert "listeners=SASL_SSL://127.0.0.1:" in text
    settings = [line for line in text.splitlines() if not line.startswith("#")]
    assert not [line for line in settings if "PLAINTEXT" in line]
    for line in ("auto.create.topics.enable=false", "allow.everyone.if.no.acl.found=false",
                 "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                 "listener.name.controller.ssl.client.auth=required",
                 "ssl.endpoint.identification.algorithm=https"):
        assert line in text
    assert server_security(SecurityFiles.of(home)) in text
    insecure = render_server_properties(BrokerConfig(home=home, insecure_plaintext=True))
    assert "listeners=PLAINTEXT://" in insecure and "authorizer.class.name" not in insecure


def test_role_table_is_least_privilege() -> None:
    assert ReplayWorkerConfig.__dataclass_fields__["group_id"].default == acls.REPLAY_GROUP
    assert acls.role_grants("admin") == ()
    runtime = acls.role_grants("runtime")
    assert [(g.kind, g.prefix, g.operations) for g in runtime] == [
        ("topic", "flywheel.capture.", ("WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")),
        # the consent ledger: read (the publisher refuses owners without a live grant)
        ("topic", "flywheel.consent.", ("READ", "DESCRIBE")),
        ("group", "flywheel-reader-", ("READ",))]
    for role in ("runtime", "streams", "replay", "sealer", "trainer"):  # nobody else writes
        consent = [g for g in acls.role_grants(role) if g.prefix == "flywheel.consent."]
        assert [g.operations for g in consent] == [("READ", "DESCRIBE")], role
    for role in roles.ROLES:
        for grant in acls.role_grants(role, "t-1."):
            # every topic grant is inside the prefixed catalogue; no cluster-wide grant
            assert grant.kind in ("topic", "group")
            if grant.kind == "topic":
                assert grant.prefix.startswith("t-1.")
                assert "ALL" not in grant.operations or role == "streams"
    bindings = acls.acl_bindings("t-1.")
    assert {b.principal for b in bindings} == {f"User:{r}" for r in roles.ROLES if r != "admin"}


def test_data_dir_formatted_without_security_gets_a_clear_error(tmp_path: Path) -> None:
    from hebrus_flywheel.streams.exceptions import BrokerError
    from hebrus_flywheel.streams.security import check_formatted, mark_formatted

    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.properties").write_text("cluster.id=x\n")
    with pytest.raises(BrokerError, match=r"move .* away"):
        check_formatted(tmp_path, data, insecure_plaintext=False)
    check_formatted(tmp_path, data, insecure_plaintext=True)  # plaintext may reuse it
    mark_formatted(tmp_path, insecure_plaintext=False)
    check_formatted(tmp_path, data, insecure_plaintext=False)


def test_insecure_reports_carry_a_red_banner() -> None:
    from hebrus_flywheel.train.qualify.report_html import insecure_banner

    assert insecure_banner({}) == ""
    banner = insecure_banner({"insecure_plaintext": roles.INSECURE_WARNING})
    assert "#b00020" in banner and "--insecure-plaintext" in banner


def test_acting_as_sets_clears_and_restores_the_role(monkeypatch) -> None:
    from hebrus_flywheel.core.kafka.security import ROLE_ENV, acting_as

    monkeypatch.setenv(ROLE_ENV, "trainer")
    with acting_as("runtime"):
        assert os.environ[ROLE_ENV] == "runtime"
        with acting_as(None):
            assert ROLE_ENV not in os.environ
        assert os.environ[ROLE_ENV] == "runtime"
    assert os.environ[ROLE_ENV] == "trainer"
    with pytest.raises(ConfigError), acting_as("root"):
        pass
    assert os.environ[ROLE_ENV] == "trainer"
