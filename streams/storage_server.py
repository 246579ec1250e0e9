"""The embedded S3-compatible store: S3Proxy on loopback, TLS only, one key pair per role.

``flywheel storage up|down|status`` (and ``make test``) run it. Layout under
``$FLYWHEEL_HOME/storage/``::

    libs/                 S3Proxy's jars (Maven, streams/s3proxy/pom.xml; every jar checked
                          against streams/s3proxy/jars.sha256 before every start)
    data/                 the filesystem backend (one directory per bucket)
    security/             0700, made on the first start and reused:
      ca.crt              the self-signed certificate clients trust (SAN 127.0.0.1, localhost)
      keystore.p12        its key for Jetty (0600)
      <role>.json         the role's access and secret key (0600)
      <role>.properties   S3Proxy's configuration of the role's identity (0600)
    logs/s3proxy.log      S3Proxy's log; logs/s3proxy.out the JVM's stdout/stderr
    s3proxy.pid

Each role is its own S3Proxy identity (one ``--properties`` file each, all on the same
backend directory): ``sealer`` read-write, ``trainer`` read-only
(``s3proxy.read-only-blobstore``: its writes are refused). S3Proxy 2.6.0 has no ACLs or
policies beyond that; per-bucket rights need a managed store (docs/operations.md).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hebrus_flywheel.core.files import atomic_write_text, exclusive_lock, make_dirs
from hebrus_flywheel.core.processes import pid_alive
from hebrus_flywheel.core.storage.config import (
    DEFAULT_BUCKET,
    STORAGE_ROLES,
    WRITE_ROLE,
    credentials_path,
    embedded_endpoint,
    s3_target,
    security_dir,
    storage_dir,
    storage_port,
)
from hebrus_flywheel.core.storage.exceptions import StorageError
from hebrus_flywheel.core.storage.objects import S3Store
from hebrus_flywheel.streams import kafka_jars
from hebrus_flywheel.streams.broker.config import port_open
from hebrus_flywheel.streams.broker.tools import find_java, find_maven, run_tool, tail_lines

log = logging.getLogger(__name__)

S3PROXY_DIR = Path(__file__).resolve().parent / "s3proxy"
POM_PATH = S3PROXY_DIR / "pom.xml"
PINS_PATH = S3PROXY_DIR / "jars.sha256"
LOGBACK_PATH = S3PROXY_DIR / "logback.xml"
MAIN_CLASS = "org.gaul.s3proxy.Main"
MAIN_JAR = "s3proxy-2.6.0.jar"
HOST = "127.0.0.1"
SECRET_MODE = 0o600
READ_ONLY_ROLES = ("trainer",)


@dataclass(frozen=True, kw_only=True)
class StorageStatus:
    running: bool
    pid: int | None
    endpoint: str
    data_dir: Path
    reachable: bool
    log_file: Path


def _write_secret(path: Path, text: str) -> None:
    atomic_write_text(path, text, mode=SECRET_MODE)


def _certificate(files: Path, hosts: tuple[str, ...] = ()) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import pkcs12
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flywheel-storage")])
    now = dt.datetime.now(dt.UTC)
    san: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                   x509.IPAddress(ipaddress.ip_address(HOST))]
    san += [x509.DNSName(h) for h in hosts if h not in ("localhost", HOST)]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    password = secrets.token_hex(16)
    blob = pkcs12.serialize_key_and_certificates(
        b"flywheel-storage", key, cert, None,
        serialization.BestAvailableEncryption(password.encode()))
    fd = os.open(files / "keystore.p12", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, SECRET_MODE)
    with os.fdopen(fd, "wb") as out:
        out.write(blob)
    _write_secret(files / "keystore.password", password + "\n")
    atomic_write_text(files / "ca.crt", cert.public_bytes(serialization.Encoding.PEM).decode())


def ensure_material(home: Path | None = None, hosts: tuple[str, ...] = ()) -> Path:
    """The certificate (SAN 127.0.0.1, localhost and ``hosts``) and every role's keys, made
    once (0600) and reused."""
    files = security_dir(home)
    make_dirs(files, 0o700)
    if not (files / "keystore.p12").is_file():
        _certificate(files, hosts)
    for role in STORAGE_ROLES:
        path = credentials_path(role, home)
        if not path.is_file():
            keys = {"access_key": f"flywheel-{role}-{secrets.token_hex(6)}",
                    "secret_key": secrets.token_urlsafe(30)}
            _write_secret(path, json.dumps(keys, indent=2) + "\n")
    return files


def role_properties(role: str, home: Path | None = None, *, bind: str | None = None,
                    mount: Path | None = None, data_dir: Path | None = None) -> str:
    """S3Proxy's properties of one role's identity (all roles share the backend).

    ``bind`` (host:port, default 127.0.0.1:$FLYWHEEL_STORAGE_PORT), ``mount`` (where the
    security directory is seen by S3Proxy) and ``data_dir`` serve a container.
    """
    files = mount or security_dir(home)
    keys = json.loads(credentials_path(role, home).read_text())
    password = (security_dir(home) / "keystore.password").read_text().strip()
    lines = [
        f"s3proxy.secure-endpoint=https://{bind or f'{HOST}:{storage_port()}'}",
        "s3proxy.authorization=aws-v4",
        f"s3proxy.identity={keys['access_key']}",
        f"s3proxy.credential={keys['secret_key']}",
        f"s3proxy.keystore-path={files / 'keystore.p12'}",
        f"s3proxy.keystore-password={password}",
        "jclouds.provider=filesystem",
        f"jclouds.filesystem.basedir={data_dir or storage_dir(home) / 'data'}",
        f"jclouds.identity={keys['access_key']}",
        f"jclouds.credential={keys['secret_key']}",
    ]
    if role in READ_ONLY_ROLES:
        lines.append("s3proxy.read-only-blobstore=true")
    return "\n".join(lines) + "\n"


def _resolution_digest() -> str:
    digest = hashlib.sha256(POM_PATH.read_bytes())
    digest.update(PINS_PATH.read_bytes())
    return digest.hexdigest()


def _verify_jars(libs: Path, pins: dict[str, str]) -> None:
    actual = kafka_jars.jar_digests(libs) if libs.is_dir() else {}
    faults = [f"{n}: SHA-256 {actual[n]}, pinned {w}" for n, w in sorted(pins.items())
              if n in actual and actual[n] != w]
    faults += [f"{n}: pinned but missing" for n in sorted(pins.keys() - actual.keys())]
    faults += [f"{n}: not pinned" for n in sorted(actual.keys() - pins.keys())]
    if faults:
        raise StorageError(f"the S3Proxy jars in {libs} do not match {PINS_PATH}: "
                           + "; ".join(faults[:10]) + f". Delete {libs} and run `flywheel "
                           "storage up` again; after a deliberate change of the pom run "
                           "`flywheel storage pin-jars` and review the diff")


def _resolve(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    make_dirs(dest.parent)
    cmd = [find_maven(), "-q", "-B", "-C", "-f", str(POM_PATH), "dependency:copy-dependencies",
           f"-DoutputDirectory={dest}"]
    run_tool(cmd, "resolving the S3Proxy jars", "check access to Maven Central and retry", 1800)


def ensure_jars(home: Path | None = None) -> Path:
    """Resolve the jars once (again when the pom or pins change); refuse unpinned ones."""
    libs = storage_dir(home) / "libs"
    pins = kafka_jars.read_pins(PINS_PATH)
    marker = libs / kafka_jars.MARKER
    if marker.is_file() and marker.read_text().strip() == _resolution_digest():
        _verify_jars(libs, pins)
        return libs
    partial = libs.with_name("libs.partial")
    _resolve(partial)
    _verify_jars(partial, pins)
    (partial / kafka_jars.MARKER).write_text(_resolution_digest() + "\n")
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)
    return libs


def pin_jars(home: Path | None = None) -> Path:
    """Resolve into a scratch directory and rewrite streams/s3proxy/jars.sha256."""
    scratch = storage_dir(home) / "libs.pin"
    try:
        _resolve(scratch)
        digests = kafka_jars.jar_digests(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    head = ["# SHA-256 of every jar of the embedded S3Proxy store (streams/s3proxy/pom.xml).",
            "# Checked after Maven resolves them and before every `flywheel storage up`.",
            "# Regenerate with `flywheel storage pin-jars`; review the diff."]
    atomic_write_text(PINS_PATH, "\n".join([*head, *(f"{digests[n]}  {n}"
                                                      for n in sorted(digests))]) + "\n")
    return PINS_PATH


def render_config(home: Path, *, host: str, port: int, mount: Path,
                  data_dir: Path) -> list[Path]:
    """For a container (compose.yaml ``storage-config``): the certificate (valid for
    ``host``), every role's keys and properties binding ``0.0.0.0:port``, with paths as
    the S3Proxy container sees them (``mount``: this home's ``storage/security``)."""
    files = ensure_material(home, (host,))
    written = []
    for role in STORAGE_ROLES:
        path = files / f"{role}.properties"
        _write_secret(path, role_properties(role, home, bind=f"0.0.0.0:{port}", mount=mount,
                                            data_dir=data_dir))
        written.append(path)
    return written


class EmbeddedStorage:
    """Start, stop and inspect the S3Proxy of ``$FLYWHEEL_HOME`` (or ``home``)."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = home
        self.dir = storage_dir(home)
        self.pid_file = self.dir / "s3proxy.pid"
        self.logs = self.dir / "logs"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not pid_alive(pid):
            return None
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return None
        return pid if MAIN_CLASS in cmd and str(self.dir) in cmd else None

    def status(self) -> StorageStatus:
        pid = self.pid()
        return StorageStatus(running=pid is not None, pid=pid, endpoint=embedded_endpoint(),
                             data_dir=self.dir / "data", log_file=self.logs / "s3proxy.log",
                             reachable=pid is not None and port_open(HOST, storage_port()))

    def up(self, timeout_s: float = 120.0) -> bool:
        """Start S3Proxy, wait until a signed request works and the default bucket exists;
        False if it was already running."""
        make_dirs(self.dir)
        with exclusive_lock(self.dir / ".lock"):
            started = False
            if self.pid() is None:
                self._start()
                started = True
            self._wait_ready(timeout_s)
            return started

    def down(self) -> bool:
        with exclusive_lock(self.dir / ".lock"):
            pid = self.pid()
            if pid is not None:
                os.kill(pid, 15)
                deadline = time.monotonic() + 30
                while pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.2)
                if pid_alive(pid):
                    os.kill(pid, 9)
            self.pid_file.unlink(missing_ok=True)
            return pid is not None

    def log_tail(self, lines: int = 40) -> list[str]:
        path = self.logs / "s3proxy.log"
        return tail_lines(path if path.is_file() else self.logs / "s3proxy.out", lines)

    def _start(self) -> None:
        self.pid_file.unlink(missing_ok=True)
        if port_open(HOST, storage_port()):
            raise StorageError(f"{HOST}:{storage_port()} is in use by a process that is not the "
                               f"store of {self.dir}; stop it or set FLYWHEEL_STORAGE_PORT")
        java, libs = find_java(), ensure_jars(self.home)
        files = ensure_material(self.home)
        make_dirs(self.dir / "data")
        make_dirs(self.logs)
        args: list[str] = []
        for role in STORAGE_ROLES:
            path = files / f"{role}.properties"
            _write_secret(path, role_properties(role, self.home))
            args += ["--properties", str(path)]
        cmd = [java, "-Xmx256m", f"-Dlogback.configurationFile={LOGBACK_PATH}",
               f"-Ds3proxy.log={self.logs / 's3proxy.log'}", "-cp", f"{libs}/*",
               MAIN_CLASS, *args]
        with (self.logs / "s3proxy.out").open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        atomic_write_text(self.pid_file, f"{proc.pid}\n")
        log.info("S3Proxy starting on %s (pid %d)", embedded_endpoint(), proc.pid)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.pid() is None:
                tail = "\n".join(self.log_tail())
                raise StorageError(f"S3Proxy exited during start-up; its log:\n{tail}")
            if port_open(HOST, storage_port()):
                try:
                    S3Store(f"s3://{DEFAULT_BUCKET}", s3_target(WRITE_ROLE, self.home)
                            ).ensure_bucket()
                    return
                except StorageError as exc:
                    last = exc
            time.sleep(0.5)
        raise StorageError(f"S3Proxy did not answer on {embedded_endpoint()} within "
                           f"{timeout_s:.0f} s ({last}); see {self.logs}")
