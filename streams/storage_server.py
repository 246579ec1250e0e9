"""The embedded S3-compatible store: SeaweedFS on loopback, TLS only, one identity per role.

``flywheel storage up|down|status`` (and ``make test``) run it. Layout under
``$FLYWHEEL_HOME/storage/``::

    bin/weed              SeaweedFS, built once from the pinned Go module
                          (:mod:`streams.seaweedfs`; ``bin/weed.version`` names the pin)
    data/                 master, volume and filer data (0700)
    security/             0700, made on the first start and reused:
      ca.crt              the self-signed certificate clients trust (SAN 127.0.0.1, localhost)
      tls.key             its private key (0600)
      <role>.json         the role's access and secret key (0600)
      admin.json          the store's own administrator, used only to create the bucket
      s3.json             SeaweedFS's identities: every role's keys and actions (0600)
    logs/weed.log         SeaweedFS's output
    weed.pid

Each role is its own identity with only its actions: ``sealer`` reads, lists and writes,
``trainer`` reads and lists and writes only the checkpoint bucket (its writes to
snapshots are refused by the server). SeaweedFS honours
``If-None-Match: *``, so a second manifest for one epoch is refused at the server
(:mod:`consumers.publish`). Only the S3 port serves clients; the master, volume and filer
ports (the next seven) listen on loopback for the server's own components.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import logging
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hebrus_flywheel.core.files import atomic_write_text, exclusive_lock, make_dirs
from hebrus_flywheel.core.processes import pid_alive
from hebrus_flywheel.core.storage.config import (
    CHECKPOINT_BUCKET,
    DEFAULT_BUCKET,
    ENDPOINT_ENV,
    STORAGE_ROLES,
    S3Target,
    credentials_path,
    embedded_endpoint,
    security_dir,
    storage_dir,
    storage_port,
)
from hebrus_flywheel.core.storage.exceptions import StorageError
from hebrus_flywheel.core.storage.objects import S3Store
from hebrus_flywheel.streams import seaweedfs
from hebrus_flywheel.streams.broker.config import port_open
from hebrus_flywheel.streams.broker.tools import tail_lines

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
SECRET_MODE = 0o600
ADMIN = "admin"
READY_PROBE = "_flywheel/ready"


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
    _write_secret(files / "tls.key", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode())
    atomic_write_text(files / "ca.crt", cert.public_bytes(serialization.Encoding.PEM).decode())


def _keys_path(role: str, home: Path | None) -> Path:
    return security_dir(home) / f"{ADMIN}.json" if role == ADMIN else credentials_path(role, home)


def _keys(role: str, home: Path | None) -> dict[str, str]:
    keys: dict[str, str] = json.loads(_keys_path(role, home).read_text(encoding="utf-8"))
    return keys


def ensure_material(home: Path | None = None, hosts: tuple[str, ...] = ()) -> Path:
    """The certificate (SAN 127.0.0.1, localhost and ``hosts``), every role's keys and
    SeaweedFS's identities (``s3.json``), made once (0600) and reused."""
    files = security_dir(home)
    make_dirs(files, 0o700)
    if not (files / "tls.key").is_file() or not (files / "ca.crt").is_file():
        _certificate(files, hosts)
    for role in (*STORAGE_ROLES, ADMIN):
        path = _keys_path(role, home)
        if not path.is_file():
            keys = {"access_key": f"flywheel-{role}-{secrets.token_hex(6)}",
                    "secret_key": secrets.token_urlsafe(30)}
            _write_secret(path, json.dumps(keys, indent=2) + "\n")
    config = seaweedfs.identities({r: _keys(r, home) for r in (*STORAGE_ROLES, ADMIN)},
                                  checkpoint_bucket=CHECKPOINT_BUCKET)
    _write_secret(files / "s3.json", json.dumps(config, indent=2) + "\n")
    return files


def admin_target(home: Path | None = None) -> S3Target:
    """The store's administrator (bucket creation only; no client role has it)."""
    keys = _keys(ADMIN, home)
    return S3Target(endpoint=os.environ.get(ENDPOINT_ENV) or embedded_endpoint(),
                    access_key=keys["access_key"], secret_key=keys["secret_key"],
                    ca_bundle=security_dir(home) / "ca.crt", role=ADMIN)


def ensure_buckets(target: S3Target) -> list[S3Store]:
    """Create the snapshot and checkpoint buckets (with ``target``, the admin's keys) if
    they are missing; a store on each, snapshots first."""
    stores = [S3Store(f"s3://{bucket}", target) for bucket in (DEFAULT_BUCKET, CHECKPOINT_BUCKET)]
    for store in stores:
        store.ensure_bucket()
    return stores


def render_config(home: Path, *, host: str) -> list[Path]:
    """For a container (compose.yaml ``storage-config``): the certificate (valid for
    ``host``), every role's keys and SeaweedFS's ``s3.json``; kept when present."""
    files = ensure_material(home, (host,))
    return [files / "ca.crt", files / "tls.key", files / "s3.json",
            *(_keys_path(r, home) for r in (*STORAGE_ROLES, ADMIN))]


def embedded_layout(home: Path | None = None) -> seaweedfs.ServerLayout:
    port = storage_port()
    if port + 7 > 65535:
        raise StorageError(f"FLYWHEEL_STORAGE_PORT={port}: the store also needs the next "
                           "seven ports; choose one below 65528")
    return seaweedfs.ServerLayout(s3_port=port, s3_bind=HOST,
                                  data_dir=storage_dir(home) / "data",
                                  security_dir=security_dir(home))


class EmbeddedStorage:
    """Start, stop and inspect the SeaweedFS of ``$FLYWHEEL_HOME`` (or ``home``)."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = home
        self.dir = storage_dir(home)
        self.pid_file = self.dir / "weed.pid"
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
        return pid if "weed" in cmd and str(self.dir) in cmd else None

    def status(self) -> StorageStatus:
        pid = self.pid()
        return StorageStatus(running=pid is not None, pid=pid, endpoint=embedded_endpoint(),
                             data_dir=self.dir / "data", log_file=self.logs / "weed.log",
                             reachable=pid is not None and port_open(HOST, storage_port()))

    def up(self, timeout_s: float = 120.0) -> bool:
        """Start SeaweedFS (built on the first start), wait until the bucket exists and
        takes a write; False if it was already running."""
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
        return tail_lines(self.logs / "weed.log", lines)

    def _start(self) -> None:
        self.pid_file.unlink(missing_ok=True)
        layout = embedded_layout(self.home)
        busy = [p for p in (layout.s3_port, *layout.ports()) if port_open(HOST, p)]
        if busy:
            raise StorageError(f"ports {busy} on {HOST} are in use by something that is not "
                               f"the store of {self.dir}; stop it or set FLYWHEEL_STORAGE_PORT "
                               "(the store uses that port and the next seven)")
        weed = seaweedfs.ensure_binary(self.dir / "bin")
        ensure_material(self.home)
        make_dirs(layout.data_dir, 0o700)
        make_dirs(self.logs)
        with (self.logs / "weed.log").open("ab") as out:
            proc = subprocess.Popen([str(weed), *seaweedfs.server_args(layout)], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.dir, start_new_session=True)
        atomic_write_text(self.pid_file, f"{proc.pid}\n")
        log.info("SeaweedFS starting on %s (pid %d)", embedded_endpoint(), proc.pid)

    def _ready(self) -> None:
        """The buckets exist and a write lands (the volume server has registered)."""
        store = ensure_buckets(admin_target(self.home))[0]
        store.put_bytes(READY_PROBE, b"ready\n")
        store.delete([READY_PROBE])

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.pid() is None:
                tail = "\n".join(self.log_tail())
                raise StorageError(f"SeaweedFS exited during start-up; its log:\n{tail}")
            if port_open(HOST, storage_port()):
                try:
                    self._ready()
                    return
                except StorageError as exc:
                    last = exc
            time.sleep(0.5)
        raise StorageError(f"SeaweedFS did not answer on {embedded_endpoint()} within "
                           f"{timeout_s:.0f} s ({last}); see {self.logs / 'weed.log'}")
