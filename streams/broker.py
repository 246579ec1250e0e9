"""The embedded single-node Apache Kafka 4.x broker (KRaft, combined broker+controller).

Layout under ``<home>/kafka`` (``home`` is ``$FLYWHEEL_HOME`` or ``./.flywheel``)::

    libs/               jars resolved by Maven from streams/kafka/pom.xml (+ .pom.sha256 marker),
                        checked against streams/kafka/jars.sha256 before every start
    data/               log.dirs; formatted once, survives restarts
    logs/server.log     broker log (log4j2, see streams/kafka/log4j2.properties)
    logs/server.out     the JVM's stdout/stderr
    server.properties   regenerated on every ``up``
    cluster.id          the cluster id the data dir was formatted with
    broker.pid          pid of the running broker (checked against its cmdline)

The quorum is static (``controller.quorum.voters``), so the listener ports may change
between restarts without re-formatting.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import logging
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write_text
from hebrus_flywheel.core.processes import pid_alive
from hebrus_flywheel.core.settings import (
    EMBEDDED_BROKER_PORT,
    EMBEDDED_CONTROLLER_PORT,
    flywheel_home,
)
from hebrus_flywheel.streams import acls, kafka_jars, security
from hebrus_flywheel.streams.exceptions import BrokerError, ToolNotFoundError

log = logging.getLogger(__name__)

KAFKA_DIR = kafka_jars.KAFKA_DIR
POM_PATH = kafka_jars.POM_PATH
LOG4J2_PATH = KAFKA_DIR / "log4j2.properties"
SERVER_TEMPLATE_PATH = KAFKA_DIR / "server.properties.template"
MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"
JVM_FLAGS = (
    "-XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true"
)
JAVA_MIN_MAJOR = 17
DEFAULT_CLUSTER_ID = (
    base64.urlsafe_b64encode(uuid.uuid5(uuid.NAMESPACE_URL, "hebrus-flywheel/kafka").bytes)
    .decode()
    .rstrip("=")
)
_CLUSTER_ID_RE = re.compile(r"^[A-Za-z0-9_-]{22}$")


@dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    """Where the embedded broker keeps its state and how it listens."""

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home).expanduser().resolve())
        if self.libs_dir is not None:
            object.__setattr__(self, "libs_dir", Path(self.libs_dir).expanduser().resolve())
        rules = {
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
        }
        for name, (want, ok) in rules.items():
            if not ok:
                raise ConfigError(
                    f"BrokerConfig.{name} must be {want}, got {getattr(self, name)!r}"
                )

    def _external_port(self) -> int | None:
        host, _, port = (self.external or "").rpartition(":")
        return int(port) if host and port.isdigit() and 0 < int(port) < 65536 else None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def cert_hosts(self) -> tuple[str, ...]:
        """The names clients verify the broker's certificate against (besides 127.0.0.1
        and localhost): ``host`` and the external listener's host."""
        external = (self.external or "").rpartition(":")[0]
        return tuple(h for h in (self.host, external) if h)

    @property
    def kafka_dir(self) -> Path:
        return self.home / "kafka"

    @property
    def jars_dir(self) -> Path:
        return self.libs_dir or self.kafka_dir / "libs"

    @property
    def data_dir(self) -> Path:
        return self.kafka_dir / "data"

    @property
    def logs_dir(self) -> Path:
        return self.kafka_dir / "logs"

    @property
    def server_properties(self) -> Path:
        return self.kafka_dir / "server.properties"

    @property
    def pid_file(self) -> Path:
        return self.kafka_dir / "broker.pid"


@dataclass(frozen=True, kw_only=True)
class BrokerStatus:
    """A snapshot of the embedded broker's state."""

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


def is_embedded(bootstrap: str, config: BrokerConfig) -> bool:
    """Whether ``bootstrap`` names this embedded broker (and nothing else)."""
    host, _, port = bootstrap.strip().rpartition(":")
    local = {"127.0.0.1", "localhost", config.host}
    return "," not in bootstrap and host in local and port == str(config.port)


def probe_metadata(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """True when a metadata request to ``bootstrap`` succeeds and lists at least one broker."""
    return kafka.probe(kafka.client_config(bootstrap), timeout_s)


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout_s):
        return True
    return False


# --------------------------------------------------------------------------- tools


@functools.lru_cache(maxsize=4)
def find_java() -> str:
    """The ``java`` binary (``$JAVA_HOME/bin/java`` or PATH), checked to be Java 17+."""
    java_home = os.environ.get("JAVA_HOME")
    path = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if path is None or not Path(path).is_file():
        where = f"JAVA_HOME={java_home} has no bin/java" if java_home else "java is not on PATH"
        raise ToolNotFoundError(
            f"{where}; install a Java {JAVA_MIN_MAJOR}+ runtime (e.g. `apt-get install "
            "openjdk-17-jre-headless`) and put it on PATH or point JAVA_HOME at it"
        )
    out = subprocess.run([path, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(?:1\.)?(\d+)', out.stderr + out.stdout)
    major = int(match.group(1)) if match else 0
    if major < JAVA_MIN_MAJOR:
        raise ToolNotFoundError(
            f"{path} is Java {major or 'of unknown version'}; Kafka 4.x needs Java "
            f"{JAVA_MIN_MAJOR}+. Install a newer JDK/JRE and point JAVA_HOME at it"
        )
    return path


def find_maven() -> str:
    """The ``mvn`` binary on PATH."""
    found = shutil.which("mvn")
    if found is None:
        raise ToolNotFoundError(
            "mvn not found on PATH; install Apache Maven (e.g. `apt-get install maven`): "
            "it resolves the broker jars from Maven Central once"
        )
    return found


def _run_tool(cmd: list[str], what: str, hint: str, timeout_s: float) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise BrokerError(f"{what} did not finish within {timeout_s:.0f}s; {hint}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise BrokerError(f"{what} failed (exit {done.returncode}):\n{tail}\n{hint}")


def _resolve_jars(dest: Path, version: str) -> None:
    """Maven copies the jars of Kafka ``version`` (checksums checked by Maven) into ``dest``."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("resolving Kafka %s jars with Maven into %s", version, dest)
    hint = "check network access to Maven Central (or a mirror in ~/.m2/settings.xml) and retry"
    cmd = kafka_jars.maven_command(find_maven(), dest, version)
    _run_tool(cmd, "resolving the Kafka jars", hint, 1800)
    if not (dest / f"{kafka_jars.KAFKA_JAR}-{version}.jar").is_file():
        raise BrokerError(f"Maven left no {kafka_jars.KAFKA_JAR}-{version}.jar in {dest}; {hint}")


def ensure_jars(config: BrokerConfig) -> Path:
    """Resolve the jars into ``config.jars_dir`` if needed; refuse any not pinned by SHA-256."""
    return kafka_jars.ensure_jars(config.jars_dir, _resolve_jars)


def pin_jars(config: BrokerConfig) -> Path:
    """Resolve the jars afresh and write their SHA-256 to ``streams/kafka/jars.sha256``."""
    return kafka_jars.pin_jars(config.kafka_dir / "libs.pinning", _resolve_jars)


def render_server_properties(config: BrokerConfig) -> str:
    """The broker's ``server.properties`` (from ``streams/kafka/server.properties.template``)."""
    template = string.Template(SERVER_TEMPLATE_PATH.read_text())
    insecure = config.insecure_plaintext
    protocol = "PLAINTEXT" if insecure else "SASL_SSL"
    bind = config.bind_host or config.host
    listeners = {protocol: (f"{bind}:{config.port}", config.bootstrap)}
    if config.external:
        listeners["EXTERNAL"] = (f"{bind}:{config._external_port()}", config.external)
    return template.substitute(
        client_listener=protocol,
        listeners=",".join(f"{n}://{bound}" for n, (bound, _) in listeners.items()),
        advertised=",".join(f"{n}://{adv}" for n, (_, adv) in listeners.items()),
        protocol_map="".join(f"{n}:{protocol}," for n in listeners),
        controller_protocol="PLAINTEXT" if insecure else "SSL",
        security="" if insecure else security.server_security(
            security.SecurityFiles.of(config.home), tuple(listeners)),
        host=config.host,
        controller_port=config.controller_port,
        data_dir=str(config.data_dir).replace("\\", "\\\\"),
        num_partitions=config.num_partitions,
        message_max_bytes=config.message_max_bytes,
    )


def render(config: BrokerConfig) -> None:
    """Everything the broker starts from, without starting it: the data and log dirs, the
    security material (secure; certificate valid for ``config.cert_hosts``), the mode
    marker and ``server.properties`` (0600: it holds the admin's password). ``up`` and
    ``flywheel broker render-config`` (compose.yaml) both run this."""
    for d in (config.data_dir, config.logs_dir):
        d.mkdir(parents=True, exist_ok=True)
    security.prepare(config.home, config.kafka_dir, config.insecure_plaintext,
                     config.cert_hosts)
    atomic_write_text(config.server_properties, render_server_properties(config))
    os.chmod(config.server_properties, security.SECRET_MODE)


def grant_roles(admin: kafka.KafkaClientConfig, home: Path, prefix: str = "") -> int:
    """As ``admin``: every role's SCRAM credential (passwords of ``home``) and the ACLs of
    the catalogue with ``prefix`` (idempotent); returns the number of ACL bindings."""
    acls.upsert_credentials(admin, security.passwords(home))
    return acls.grant_catalogue(admin, prefix)


def _java_base(config: BrokerConfig, java: str) -> list[str]:
    log4j = [f"-Dlog4j2.configurationFile={LOG4J2_PATH}", f"-Dkafka.logs.dir={config.logs_dir}"]
    return [java, *log4j, "-cp", f"{config.jars_dir}{os.sep}*"]


def ensure_formatted(config: BrokerConfig, java: str) -> bool:
    """Format the data dir once (static quorum, so no --standalone); True if it formatted now."""
    if (config.data_dir / "meta.properties").is_file():
        security.check_formatted(config.kafka_dir, config.data_dir, config.insecure_plaintext)
        return False
    config.data_dir.mkdir(parents=True, exist_ok=True)
    args = ["--cluster-id", config.cluster_id, "--config", str(config.server_properties)]
    if not config.insecure_plaintext:  # the admin's SCRAM credential exists from the start
        args += security.add_scram_args(security.SecurityFiles.of(config.home))
    hint = "if the data dir holds another cluster's data, move it away and run `flywheel broker up`"
    cmd = [*_java_base(config, java), "-Xmx256m", STORAGE_TOOL, "format", *args]
    _run_tool(cmd, f"formatting {config.data_dir}", hint, 300)
    (config.kafka_dir / "cluster.id").write_text(config.cluster_id + "\n")
    security.mark_formatted(config.kafka_dir, config.insecure_plaintext)
    log.info("formatted %s with cluster id %s", config.data_dir, config.cluster_id)
    return True


def read_cluster_id(config: BrokerConfig) -> str | None:
    """The cluster id recorded in the formatted data dir, or None if not formatted."""
    meta = config.data_dir / "meta.properties"
    if not meta.is_file():
        return None
    match = re.search(r"^cluster\.id=(\S+)$", meta.read_text(), re.MULTILINE)
    return match.group(1) if match else None


# --------------------------------------------------------------------------- processes


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return []
    out = subprocess.run(
        ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, check=False
    )
    return out.stdout.split()


# Brokers spawned by this process; kept referenced so an exited one is reaped via poll()
# (no zombie) and a running one never triggers Popen's "still running" ResourceWarning.
_SPAWNED: dict[int, subprocess.Popen[bytes]] = {}


def _alive(pid: int) -> bool:
    proc = _SPAWNED.get(pid)
    if proc is not None and proc.poll() is not None:
        del _SPAWNED[pid]  # reap our own child, so it is not left a zombie
        return False
    return pid_alive(pid)


def tail_lines(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines of ``path`` (empty when it does not exist)."""
    if lines <= 0 or not path.is_file():
        return []
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        pos, data = fh.tell(), b""
        while pos > 0 and data.count(b"\n") <= lines:
            step = min(65536, pos)
            pos -= step
            fh.seek(pos)
            data = fh.read(step) + data
    return data.decode(errors="replace").splitlines()[-lines:]


# --------------------------------------------------------------------------- the broker


class EmbeddedBroker:
    """Start, stop and inspect the embedded broker described by a :class:`BrokerConfig`."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()

    def pid(self) -> int | None:
        """The pid from the pid file if that process is alive and is our broker, else None."""
        try:
            pid = int(self.config.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not _alive(pid):
            return None
        cmd = _cmdline(pid)
        if MAIN_CLASS in cmd and str(self.config.server_properties) in cmd:
            return pid
        return None

    def status(self, probe_timeout_s: float = 3.0) -> BrokerStatus:
        cfg, pid = self.config, self.pid()
        ok = (
            pid is not None
            and port_open(cfg.host, cfg.port)
            and kafka.probe(self.admin_config(), probe_timeout_s)
        )
        return BrokerStatus(
            running=pid is not None,
            pid=pid,
            bootstrap=cfg.bootstrap,
            data_dir=cfg.data_dir,
            formatted=(cfg.data_dir / "meta.properties").is_file(),
            cluster_id=read_cluster_id(cfg),
            metadata_ok=ok,
            log_file=cfg.logs_dir / "server.log",
        )

    def up(self) -> bool:
        """Start the broker and wait until it answers metadata; False if it was already running."""
        cfg = self.config
        with self._locked():
            pid = self.pid()
            if pid is not None:
                security.check_running_mode(cfg.kafka_dir, cfg.insecure_plaintext)
                self._wait_ready(pid, None)
                self._grant()
                return False
            cfg.pid_file.unlink(missing_ok=True)
            for port in (cfg.port, cfg.controller_port):
                if port_open(cfg.host, port):
                    raise BrokerError(
                        f"{cfg.host}:{port} is in use by a process that is not the broker of "
                        f"{cfg.home} (no live pid in {cfg.pid_file}). Stop that process, use "
                        "the FLYWHEEL_HOME that started it, or set FLYWHEEL_BOOTSTRAP_SERVERS "
                        "to use it as an external cluster"
                    )
            java = find_java()
            ensure_jars(cfg)
            render(cfg)
            ensure_formatted(cfg, java)
            proc = self._spawn(java)
            self._wait_ready(proc.pid, proc)
            self._grant()
            log.info("embedded Kafka broker started on %s (pid %d)", cfg.bootstrap, proc.pid)
            return True

    def down(self) -> bool:
        """Stop the broker named by the pid file; False if it was not running."""
        with self._locked():
            pid = self.pid()
            if pid is not None:
                self._stop(pid)
            self.config.pid_file.unlink(missing_ok=True)
            return pid is not None

    def admin_config(self) -> kafka.KafkaClientConfig:
        """The broker's own client configuration: admin (or plaintext when insecure)."""
        cfg = self.config
        return security.admin_config(cfg.home, cfg.bootstrap, cfg.insecure_plaintext)

    def _grant(self) -> None:
        """Secure mode: every role's SCRAM credential and catalogue ACLs (idempotent)."""
        if not self.config.insecure_plaintext:
            grant_roles(self.admin_config(), self.config.home)

    def log_tail(self, lines: int = 50) -> list[str]:
        """The last ``lines`` lines of ``server.log`` (or ``server.out`` if there is no log yet)."""
        logs = self.config.logs_dir
        path = logs / "server.log" if (logs / "server.log").is_file() else logs / "server.out"
        return tail_lines(path, lines)

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.config.kafka_dir.mkdir(parents=True, exist_ok=True)
        with (self.config.kafka_dir / ".lock").open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _spawn(self, java: str) -> subprocess.Popen[bytes]:
        cfg = self.config
        jvm = f"-Xmx{cfg.heap_mb}m -Xms256m {JVM_FLAGS}".split()
        cmd = [*_java_base(cfg, java), *jvm, MAIN_CLASS, str(cfg.server_properties)]
        with (cfg.logs_dir / "server.out").open("ab") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, cwd=cfg.kafka_dir,
            )  # fmt: skip
        _SPAWNED[proc.pid] = proc
        cfg.pid_file.write_text(f"{proc.pid}\n")
        return proc

    def _wait_ready(self, pid: int, proc: subprocess.Popen[bytes] | None) -> None:
        """Poll until metadata works; a broker we just spawned is stopped if it never does."""
        cfg = self.config
        deadline = time.monotonic() + cfg.start_timeout_s
        while time.monotonic() < deadline:
            exited = proc.poll() if proc is not None else (None if _alive(pid) else -1)
            if exited is not None:
                cfg.pid_file.unlink(missing_ok=True)
                raise BrokerError(
                    f"the Kafka broker (pid {pid}) exited with code {exited} while starting.\n"
                    f"{self._failure_context()}\nFix the cause above and run `flywheel broker up`"
                )
            if port_open(cfg.host, cfg.port) and kafka.probe(self.admin_config(), 2.0):
                return
            time.sleep(0.5)
        if proc is None:
            raise BrokerError(
                f"the broker (pid {pid}) is running but {cfg.bootstrap} did not answer a metadata "
                f"request within {cfg.start_timeout_s:.0f}s; see `flywheel broker logs`, then "
                "`flywheel broker down` and `flywheel broker up`"
            )
        self._stop(pid)
        cfg.pid_file.unlink(missing_ok=True)
        raise BrokerError(
            f"the Kafka broker did not answer a metadata request on {cfg.bootstrap} within "
            f"{cfg.start_timeout_s:.0f}s and was stopped.\n{self._failure_context()}\n"
            "Check the log above; on a slow machine raise the start timeout (--start-timeout)"
        )

    def _failure_context(self) -> str:
        logs = self.config.logs_dir
        parts = []
        for name, n in (("server.out", 15), ("server.log", 30)):
            lines = tail_lines(logs / name, n)
            if lines:
                parts.append(f"--- last {len(lines)} lines of {logs / name}:\n" + "\n".join(lines))
        return "\n".join(parts) or f"(no log output in {logs})"

    def _stop(self, pid: int) -> None:
        for sig, wait_s in ((signal.SIGTERM, self.config.stop_timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            except PermissionError as exc:
                raise BrokerError(
                    f"not allowed to signal broker pid {pid}; stop it as its owner"
                ) from exc
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not _alive(pid):
                    return
                time.sleep(0.2)
            if sig == signal.SIGTERM:
                log.warning("broker pid %d ignored SIGTERM for %.0fs; sending SIGKILL", pid, wait_s)
        raise BrokerError(f"broker pid {pid} survived SIGKILL; inspect it with `ps -p {pid}`")
