"""Build and run the Java capture producer (``runtimes/java``) from tests.

:func:`java_skip_reason` says why the Java producer cannot run here (no ``java`` or no
``mvn``), so its tests skip with that reason instead of failing ``make test`` on a
machine without a JDK. :func:`build_java_producer` runs Maven once per change: the jar and
its dependencies stay in ``runtimes/java/target/`` with a digest of everything that goes
into them (pom, sources, the packed ``schemas/*.avsc``, the Kafka version of
``streams/kafka/kafka.env``), and a later call with the same digest does not run Maven.
:func:`run_java_producer` writes records as the producer's JSON-lines input (raw ids,
plaintext tokens, routes as per-row lists, exactly what a runtime hands the Python
publisher) and runs it with the runtime role's credentials.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hebrus_flywheel.core.kafka.security import insecure_marker, role_properties_path
from hebrus_flywheel.streams.kafka_jars import kafka_version
from hebrus_flywheel.streams.routes import is_packed

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "runtimes" / "java"
TARGET = PROJECT / "target"
JAR = TARGET / "flywheel-capture.jar"
STAMP = TARGET / ".build.sha256"
MAIN = "dev.hebrus.flywheel.capture.Main"


def java_skip_reason() -> str | None:
    """Why the Java producer cannot be built or run here, or None."""
    missing = [tool for tool in ("java", "mvn") if shutil.which(tool) is None]
    if missing:
        return (f"{' and '.join(missing)} not on PATH: the Java capture producer "
                "(runtimes/java) needs a JDK 17 and Maven")
    return None


def _inputs_digest() -> str:
    digest = hashlib.sha256(f"kafka={kafka_version()}\n".encode())
    files = [PROJECT / "pom.xml", *sorted((PROJECT / "src").rglob("*.java")),
             *sorted((ROOT / "schemas").glob("*.avsc"))]
    for path in files:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_java_producer(*, timeout_s: float = 600.0) -> Path:
    """The built jar (Maven runs only when its inputs changed since the last build)."""
    wanted = _inputs_digest()
    if JAR.is_file() and STAMP.is_file() and STAMP.read_text().strip() == wanted:
        return JAR
    cmd = ["mvn", "-q", "-B", "-f", str(PROJECT / "pom.xml"), "package",
           "dependency:copy-dependencies", "-DincludeScope=runtime",
           f"-Dkafka.version={kafka_version()}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building the Java producer failed ({' '.join(cmd)}):\n"
                           f"{done.stdout[-4000:]}{done.stderr[-4000:]}")
    STAMP.write_text(wanted + "\n")
    return JAR


def runtime_line(kind: str, record: dict[str, Any]) -> dict[str, Any]:
    """One input line: the record with packed routes unpacked into per-row lists."""
    out = dict(record)
    if kind == "observations" and is_packed(out):
        rows, k = len(out["layers"]), int(out["top_k"])
        out["expert_ids"] = np.frombuffer(out["expert_ids"], "<u2").reshape(rows, k).tolist()
        out["weights"] = [[float(w) for w in row] for row in
                          np.frombuffer(out["weights"], "<f4").reshape(rows, k)]
    return {"kind": kind, "record": out}


def _client_properties(tmp_path: Path) -> Path:
    """The runtime role's librdkafka properties (empty for an insecure-plaintext home)."""
    if insecure_marker().is_file():
        empty = tmp_path / "plaintext.properties"
        empty.write_text("security.protocol=PLAINTEXT\n")
        return empty
    return role_properties_path("runtime")


def run_java_producer(bootstrap: str, prefix: str, messages: Iterable[tuple[str, bytes, Any]],
                      tmp_path: Path, *, producer_id: str = "java-runtime",
                      timeout_s: float = 180.0) -> dict[str, Any]:
    """Publish ``(kind, key, record)`` messages (raw ids) with the Java producer; returns
    the counters it prints (``enqueued``, ``delivered``, ``failed``,
    ``refused_no_consent``, ``first_error``). Raises when it exits non-zero."""
    jar = build_java_producer()
    records = tmp_path / f"{producer_id}.jsonl"
    with records.open("w", encoding="utf-8") as fh:
        for kind, _, record in messages:
            fh.write(json.dumps(runtime_line(kind, record)) + "\n")
    cmd = ["java", "-cp", f"{jar}:{TARGET / 'dependency'}/*", MAIN,
           "--bootstrap-servers", bootstrap, "--prefix", prefix, "--input", str(records),
           "--kafka-properties", str(_client_properties(tmp_path)), "--producer-id", producer_id]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the Java producer exited {done.returncode}:\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-6000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
