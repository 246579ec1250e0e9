"""Security material of the embedded broker: a local CA, the broker's certificate and one
SCRAM-SHA-512 password and client properties file per role.

Everything lives in ``$FLYWHEEL_HOME/kafka/security/`` (mode 0700), is generated once by
the first ``flywheel broker up`` and reused afterwards::

    ca.crt                 the local CA (clients trust it: ssl.ca.location)
    ca.key                 its private key (0600; signs nothing after the first start)
    broker.pem             the broker's key and certificate (0600; SAN 127.0.0.1, localhost
                           and the broker's advertised host names)
    <role>.password        the role's SCRAM-SHA-512 password (0600)
    <role>.properties      librdkafka properties of the role (0600; `flywheel broker
                           credentials --role ROLE`, `--kafka-config`, `kcat -F`)

The broker listens for clients on SASL_SSL only (SCRAM-SHA-512, TLS with hostname
verification); its KRaft controller listener is mutual TLS, so only a holder of a key
signed by the local CA (the broker itself) can use it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hebrus_flywheel.core.files import atomic_write_text
from hebrus_flywheel.core.kafka.config import KafkaClientConfig
from hebrus_flywheel.core.kafka.security import (
    INSECURE_MARKER,
    ROLES,
    role_properties_path,
    security_dir,
)
from hebrus_flywheel.streams.exceptions import BrokerError

SCRAM_MECHANISM = "SCRAM-SHA-512"
ADMIN_USER = "admin"
BROKER_CN = "flywheel-broker"
VALID_DAYS = 3650
SECRET_MODE = 0o600
DIR_MODE = 0o700


@dataclass(frozen=True, kw_only=True)
class SecurityFiles:
    """Paths of one home's security material."""

    root: Path

    @classmethod
    def of(cls, home: Path) -> SecurityFiles:
        return cls(root=security_dir(home))

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def broker_pem(self) -> Path:
        return self.root / "broker.pem"

    def password_file(self, role: str) -> Path:
        return self.root / f"{role}.password"

    def properties_file(self, role: str) -> Path:
        return role_properties_path(role, self.root.parent.parent)

    def password(self, role: str) -> str:
        try:
            return self.password_file(role).read_text().strip()
        except OSError as exc:
            raise BrokerError(f"cannot read the {role} password {self.password_file(role)}: "
                              f"{exc.strerror or exc}; run `flywheel broker up`") from exc


def _write_secret(path: Path, text: str) -> None:
    atomic_write_text(path, text)
    os.chmod(path, SECRET_MODE)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


LOCAL_HOSTS = ("127.0.0.1", "localhost")


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, *,
                 issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
                 hosts: tuple[str, ...] = LOCAL_HOSTS) -> x509.Certificate:
    """A CA certificate (``issuer`` None, self-signed) or a broker certificate signed by
    ``issuer`` with SAN ``hosts``, usable for server and client TLS."""
    now = dt.datetime.now(dt.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hebrus-flywheel"),
                      x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name = name if issuer is None else x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hebrus-flywheel"),
        x509.NameAttribute(NameOID.COMMON_NAME, issuer[0])])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(now + dt.timedelta(days=VALID_DAYS)))
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), True)
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), True)
        return builder.sign(key, hashes.SHA256())
    builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
    builder = builder.add_extension(
        x509.SubjectAlternativeName([_san(h) for h in dict.fromkeys(hosts)]), False)
    builder = builder.add_extension(x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False)
    return builder.sign(issuer[1], hashes.SHA256())


def make_ca(files: SecurityFiles, common_name: str = "hebrus-flywheel local CA") -> None:
    """Write a fresh CA key (0600) and self-signed certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    _write_secret(files.ca_key, _pem_key(key))
    atomic_write_text(files.ca_cert, _pem_cert(_certificate(common_name, key, issuer=None)))


def make_server_pem(files: SecurityFiles, out: Path, common_name: str = BROKER_CN,
                    hosts: tuple[str, ...] = ()) -> None:
    """Write ``out`` (0600): a new key and its certificate signed by the files' CA, valid
    for 127.0.0.1, localhost and ``hosts``."""
    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise BrokerError(f"{files.ca_key} is not the EC key flywheel generates; move the "
                          f"directory {files.root} away and run `flywheel broker up`")
    ca_cn = ca_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(common_name, key, issuer=(str(ca_cn), ca_key),
                        hosts=(*LOCAL_HOSTS, *hosts))
    _write_secret(out, _pem_key(key) + _pem_cert(cert))


def role_properties(files: SecurityFiles, role: str) -> dict[str, str]:
    """The librdkafka client properties of ``role`` on the embedded broker."""
    return {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": SCRAM_MECHANISM,
        "sasl.username": role,
        "sasl.password": files.password(role),
        "ssl.ca.location": str(files.ca_cert),
        "ssl.endpoint.identification.algorithm": "https",
    }


def render_properties(files: SecurityFiles, role: str) -> str:
    head = (f"# Kafka client properties of the flywheel role {role!r} on the embedded broker.\n"
            f"# CA: {files.ca_cert}\n# password file: {files.password_file(role)}\n")
    body = "".join(f"{k}={v}\n" for k, v in role_properties(files, role).items())
    return head + body


def cert_hosts(pem: Path) -> set[str]:
    """The host names and addresses a PEM certificate (the first one in ``pem``) is valid for."""
    cert = x509.load_pem_x509_certificate(pem.read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in san.get_values_for_type(x509.IPAddress)} | set(
        san.get_values_for_type(x509.DNSName))


def ensure_material(home: Path, hosts: tuple[str, ...] = ()) -> SecurityFiles:
    """Generate what is missing (CA, broker key, passwords, properties); keep what exists,
    except a broker certificate not valid for every one of ``hosts`` (re-issued)."""
    files = SecurityFiles.of(home)
    files.root.mkdir(parents=True, exist_ok=True)
    os.chmod(files.root, DIR_MODE)
    if not files.ca_key.is_file() or not files.ca_cert.is_file():
        if files.broker_pem.is_file():
            raise BrokerError(f"{files.root} has a broker key but no CA; move the directory "
                              "away (clients must then use the new CA) and run "
                              "`flywheel broker up`")
        make_ca(files)
    if not files.broker_pem.is_file() or not set(hosts) <= cert_hosts(files.broker_pem):
        make_server_pem(files, files.broker_pem, hosts=hosts)
    for role in ROLES:
        if not files.password_file(role).is_file():
            _write_secret(files.password_file(role), secrets.token_urlsafe(24) + "\n")
        text = render_properties(files, role)
        path = files.properties_file(role)
        if not path.is_file() or path.read_text() != text:
            _write_secret(path, text)
    return files


def server_security(files: SecurityFiles, listeners: tuple[str, ...] = ("SASL_SSL",)) -> str:
    """The ``server.properties`` lines of the secure broker (SASL_SSL + mTLS controller);
    ``listeners`` names the SASL_SSL listeners (each needs its own JAAS line)."""
    jaas = ("org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{ADMIN_USER}" password="{files.password(ADMIN_USER)}";')
    return "\n".join([
        f"sasl.enabled.mechanisms={SCRAM_MECHANISM}",
        f"sasl.mechanism.inter.broker.protocol={SCRAM_MECHANISM}",
        *(f"listener.name.{name.lower()}.scram-sha-512.sasl.jaas.config={jaas}"
          for name in listeners),
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={files.broker_pem}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={files.ca_cert}",
        "ssl.endpoint.identification.algorithm=https",
        "listener.name.controller.ssl.client.auth=required",
        "ssl.principal.mapping.rules=RULE:^CN=([a-zA-Z0-9.-]+).*$/$1/,DEFAULT",
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found=false",
        f"super.users=User:{ADMIN_USER};User:{BROKER_CN}",
    ]) + "\n"


def add_scram_args(files: SecurityFiles) -> list[str]:
    """``kafka-storage format`` arguments that create the admin's SCRAM credential."""
    password = files.password(ADMIN_USER)
    return ["--add-scram", f"{SCRAM_MECHANISM}=[name={ADMIN_USER},password={password}]"]


# --------------------------------------------------------------------------- start-up

FORMATTED_MARKER = "data.security"


def prepare(home: Path, kafka_dir: Path, insecure_plaintext: bool,
            hosts: tuple[str, ...] = ()) -> None:
    """Before a start: the material (secure; the broker certificate valid for ``hosts``)
    and the home's mode marker."""
    marker = kafka_dir / INSECURE_MARKER
    if insecure_plaintext:
        atomic_write_text(marker, "started with --insecure-plaintext\n")
        return
    marker.unlink(missing_ok=True)
    ensure_material(home, hosts)


def check_running_mode(kafka_dir: Path, insecure_plaintext: bool) -> None:
    """Refuse to treat a running broker of the other mode as the one asked for."""
    running_insecure = (kafka_dir / INSECURE_MARKER).is_file()
    if running_insecure != insecure_plaintext:
        now = "--insecure-plaintext" if running_insecure else "secure (SASL_SSL)"
        raise BrokerError(f"the embedded broker is already running {now}; run `flywheel "
                          "broker down` first to restart it in the other mode")


def mark_formatted(kafka_dir: Path, insecure_plaintext: bool) -> None:
    text = "plaintext\n" if insecure_plaintext else f"{SCRAM_MECHANISM} {ADMIN_USER}\n"
    atomic_write_text(kafka_dir / FORMATTED_MARKER, text)


def check_formatted(kafka_dir: Path, data_dir: Path, insecure_plaintext: bool) -> None:
    """A data dir formatted without the admin's SCRAM credential cannot start secure."""
    marker = kafka_dir / FORMATTED_MARKER
    scram = marker.is_file() and marker.read_text().startswith(SCRAM_MECHANISM)
    if insecure_plaintext or scram:
        return
    raise BrokerError(
        f"{data_dir} was formatted without security (by an older flywheel or with "
        "--insecure-plaintext), so it holds no SCRAM credential for the admin and cannot "
        f"start secure. Run `flywheel broker down`, move {data_dir} away (its topics are "
        "lost; capture again afterwards) and run `flywheel broker up`; or keep using it "
        "insecurely with `flywheel broker up --insecure-plaintext`")


def admin_config(home: Path, bootstrap: str, insecure_plaintext: bool) -> KafkaClientConfig:
    """The broker's own client configuration (probes, credentials, ACLs): admin, or
    nothing in insecure mode; independent of the process's role and Kafka config."""
    if insecure_plaintext:
        return KafkaClientConfig(bootstrap_servers=bootstrap)
    return KafkaClientConfig(bootstrap_servers=bootstrap,
                             properties=role_properties(SecurityFiles.of(home), ADMIN_USER))


def passwords(home: Path) -> dict[str, str]:
    files = SecurityFiles.of(home)
    return {role: files.password(role) for role in ROLES}
