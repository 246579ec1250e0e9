"""Drive real workers from tests and the bench: subprocesses, producing, reading.

``WorkerProcess`` runs ``python -m hebrus_flywheel.streams.processors.cli worker``
with a set of flags;
:func:`worker_processor_config` turns the same flags into the :class:`ProcessorConfig`
the worker uses, so an in-process :class:`LocalPipeline` can compute the windows a
clean run must produce.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from confluent_kafka import Producer

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.kafka.security import (
    insecure_marker,
    is_embedded_bootstrap,
    role_properties_path,
)
from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, is_pseudonym
from hebrus_flywheel.core.settings import KAFKA_CONFIG_ENV
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.owner_seal import OwnerSealer
from hebrus_flywheel.streams.processors.cli import processor_config
from hebrus_flywheel.streams.processors.exceptions import WorkerError
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.processors.window_seal import encode_window
from tests.support.consent import consent_entries
from tests.support.streams_synthetic import Message, encode_message

DEFAULT_FLAGS: dict[str, Any] = {
    "salt": "hebrus-flywheel-split-v1",
    "validation_fraction": 0.1,
    "temporal_cut_ms": None,
    "stress_rate": 0.5,
    "runtime_holdout_fraction": 0.05,
    "near_threshold": 0.8,
    "idle_timeout_s": 300.0,
    "context_length": 2048,
    "route_context_length": 8192,
}


def worker_processor_config(flags: Mapping[str, Any]) -> ProcessorConfig:
    return processor_config(**{**DEFAULT_FLAGS, **flags})


def streams_role_env(bootstrap: str, home: Path) -> dict[str, str]:
    """The environment of a streams-role subprocess with its own ``home``. That home
    holds no Kafka credentials: it gets the streams role's properties of this process's
    home (unless a Kafka config is set already)."""
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    streams_props = role_properties_path("streams")
    if not os.environ.get(KAFKA_CONFIG_ENV) and streams_props.is_file() \
            and not insecure_marker().is_file() and is_embedded_bootstrap(bootstrap):
        env[KAFKA_CONFIG_ENV] = str(streams_props)
    return env


class WorkerProcess:
    """One ``streams worker`` subprocess (log in ``log_path``)."""

    def __init__(
        self,
        *,
        bootstrap: str,
        prefix: str,
        app_id: str,
        log_path: Path,
        flags: Mapping[str, Any] | None = None,
        home: Path | None = None,
        extra: Iterable[str] = (),
    ) -> None:
        self.args = [
            sys.executable,
            "-m",
            "hebrus_flywheel.streams.processors.cli",
            "worker",
            "--bootstrap-servers",
            bootstrap,
            "--prefix",
            prefix,
            "--app-id",
            app_id,
            "--tick-interval-s",
            "1",
            "--stats-interval-s",
            "1",
            *extra,
        ]
        for name, value in {**DEFAULT_FLAGS, **(flags or {})}.items():
            if value is not None:
                self.args += [f"--{name.replace('_', '-')}", str(value)]
        self.log_path = log_path
        self.env = streams_role_env(bootstrap, home or log_path.parent / "home")
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> WorkerProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()/kill()
        self.proc = subprocess.Popen(
            self.args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=Path(__file__).resolve().parents[2],
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final commit (what a crash looks like)."""
        if self.proc is not None and self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self._close_log()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM and wait for a clean exit."""
        if self.proc is not None and self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._close_log()
        return None if self.proc is None else self.proc.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


LOG_TAIL_BYTES = 1 << 16
"""How much of a worker log's end :func:`last_logged` reads first."""


def last_logged(log_path: Path, marker: str) -> dict[str, Any]:
    """The JSON after ``marker`` on the worker log's last whole line holding it ({}
    before the first). The log's tail is read first (benchmarks poll it often while the
    log grows to megabytes), the whole log only when the tail lacks the marker; a line
    cut by the tail's start, or still being written at the end, is not read."""
    size = log_path.stat().st_size
    with log_path.open("rb") as log:
        for start in dict.fromkeys((max(0, size - LOG_TAIL_BYTES), 0)):
            log.seek(start)
            lines = log.read(size - start).decode(errors="replace").split("\n")[:-1]
            found = [line for line in lines[1 if start else 0:] if marker in line]
            if found:
                return dict(json.loads(found[-1].split(marker, 1)[1]))
    return {}


def producer(bootstrap: str) -> Producer:
    return kafka.make_producer(kafka.client_config(bootstrap),
                               settings={"enable.idempotence": True, "linger.ms": 5})


def produce(
    prod: Producer,
    topics: StreamTopics,
    messages: Iterable[Message],
    *,
    pace_s: float = 0.0,
    every: int = 1,
    consent: bool = True,
) -> int:
    """Encode and publish capture messages (keyed owner/thread) in order. With
    ``consent`` (the default) it first grants every scope to the messages' owners on the
    prefix's consent ledger, as an operator must before capture; a test of refusals
    passes ``consent=False``."""
    names = topics.capture_kinds()
    messages = list(messages)
    if consent:
        grant_for(prod, topics, messages)
    count = 0
    for kind, key, record in messages:
        value, headers = encode_message(kind, record)
        prod.produce(names[kind], key=key, value=value, headers=list(headers))
        count += 1
        if pace_s and count % every == 0:
            prod.poll(0)
            time.sleep(pace_s)
    prod.flush(30)
    return count


def grant_for(prod: Producer, topics: StreamTopics, messages: Iterable[Message]) -> None:
    """Grant consent (every scope, from 1970 to 2100) to the owners of ``messages``."""
    owners = {r["owner"] for kind, _, r in messages
              if kind != "identities" and isinstance(r.get("owner"), str) and r["owner"]}
    for entry in consent_entries(owners):
        prod.produce(topics.consent, key=entry.owner.encode(), value=entry.encode())
    if prod.flush(30):
        raise WorkerError(f"consent grants for {sorted(owners)} were not acknowledged")


def read_windows(bootstrap: str, topics: StreamTopics) -> list[dict[str, Any]]:
    """Every window message (repeats included), decoded, across all split topics."""
    out = []
    for topic in topics.windows.values():
        for msg in read_topic(bootstrap, topic):
            _, record = codec.decode(msg.value() or b"")
            out.append(record)
    return out


def expected_pipeline(messages: Iterable[Message], config: ProcessorConfig) -> LocalPipeline:
    """What a clean single run over ``messages`` (in this order) produces."""
    pipeline = LocalPipeline(config)
    offsets: dict[str, int] = {}
    for kind, key, record in messages:
        value, headers = encode_message(kind, record)
        offsets[kind] = offsets.get(kind, -1) + 1
        pipeline.feed(kind, 0, offsets[kind], key, value, headers)
    return pipeline


def window_pairs(windows: Iterable[Mapping[str, Any]]) -> set[tuple[str, str]]:
    """``(window_id, content_digest)`` of each window as the stream worker writes it:
    plaintext windows of the in-process chain (pseudonymous owners) are sealed first
    with the session's key store, exactly as the worker seals them (deterministic), so
    they compare with the decoded ``Window.v2`` records read back from the topics."""
    out = set()
    for window in windows:
        if "token_ids" in window and is_pseudonym(str(window["owner"]), "o"):
            _, window = encode_window(window, OwnerSealer(LocalOwnerKeyStore))
        out.add((window["window_id"], window["content_digest"]))
    return out


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout_s: float,
    interval_s: float = 1.0,
    what: str = "condition",
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise WorkerError(f"timed out after {timeout_s:.0f} s waiting for {what}")
