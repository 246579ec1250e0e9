"""One embedded Apache Kafka 4.x node (KRaft, combined broker+controller): a process
started from the files :mod:`streams.broker.render` writes.

Layout of a node's state directory (``<home>/kafka`` for the single node,
``<home>/kafka/node-<id>`` for a node of a local cluster, :mod:`streams.broker.cluster`)::

    data/               log.dirs; formatted once, survives restarts
    logs/server.log     broker log (log4j2, see streams/kafka/log4j2.properties)
    logs/server.out     the JVM's stdout/stderr
    server.properties   regenerated on every ``up``
    cluster.id          the cluster id the data dir was formatted with
    broker.pid          pid of the running broker (checked against its cmdline)

Shared by every node of a home, under ``<home>/kafka``: ``libs/`` (the jars resolved by
Maven from streams/kafka/pom.xml, checked against streams/kafka/jars.sha256 before every
start) and ``security/`` (one CA, one broker certificate, the roles' passwords).

The quorum is static (``controller.quorum.voters``), so the listener ports may change
between restarts without re-formatting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.files import exclusive_lock
from hebrus_flywheel.core.processes import pid_alive
from hebrus_flywheel.streams import security
from hebrus_flywheel.streams.broker.config import BrokerConfig, BrokerStatus, port_open
from hebrus_flywheel.streams.broker.render import (
    ensure_formatted,
    grant_roles,
    java_base,
    read_cluster_id,
    render,
)
from hebrus_flywheel.streams.broker.tools import ensure_jars, find_java, tail_lines
from hebrus_flywheel.streams.exceptions import BrokerError

log = logging.getLogger(__name__)

MAIN_CLASS = "kafka.Kafka"
JVM_FLAGS = (
    "-XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true"
)


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


# --------------------------------------------------------------------------- the broker


class EmbeddedBroker:
    """Start, stop and inspect the embedded broker described by a :class:`BrokerConfig`."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self._started: subprocess.Popen[bytes] | None = None

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
        with self._locked():
            started = self.start()
            self.wait_ready()
            self._grant()
            if started is not None:
                log.info("embedded Kafka broker started on %s (pid %d)",
                         self.config.bootstrap, started.pid)
            return started is not None

    def start(self) -> subprocess.Popen[bytes] | None:
        """Without waiting for it: render, format once and spawn the node; None when it
        already runs (in the mode asked for). The caller holds the lock."""
        cfg = self.config
        if self.pid() is not None:
            security.check_running_mode(cfg.kafka_dir, cfg.insecure_plaintext)
            return None
        cfg.pid_file.unlink(missing_ok=True)
        for port in (cfg.port, cfg.controller_port):
            if port_open(cfg.host, port):
                raise BrokerError(
                    f"{cfg.host}:{port} is in use by a process that is not the broker of "
                    f"{cfg.state_dir} (no live pid in {cfg.pid_file}). Stop that process, use "
                    "the FLYWHEEL_HOME that started it, or set FLYWHEEL_BOOTSTRAP_SERVERS "
                    "to use it as an external cluster"
                )
        java = find_java()
        ensure_jars(cfg)
        render(cfg)
        ensure_formatted(cfg, java)
        self._started = self._spawn(java)
        return self._started

    def wait_ready(self) -> None:
        """Wait until the running node answers metadata (see :meth:`_wait_ready`)."""
        proc = self._started
        pid = proc.pid if proc is not None else self.pid()
        if pid is None:
            raise BrokerError(f"the broker of {self.config.state_dir} is not running; "
                              "run `flywheel broker up`")
        self._wait_ready(pid, proc)
        self._started = None

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

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return exclusive_lock(self.config.state_dir / ".lock")

    def _spawn(self, java: str) -> subprocess.Popen[bytes]:
        cfg = self.config
        jvm = f"-Xmx{cfg.heap_mb}m -Xms256m {JVM_FLAGS}".split()
        cmd = [*java_base(cfg, java), *jvm, MAIN_CLASS, str(cfg.server_properties)]
        with (cfg.logs_dir / "server.out").open("ab") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, cwd=cfg.state_dir,
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
