"""The tools an embedded node needs: a Java 17+ runtime, Maven (once, to resolve the
jars) and the pinned jars themselves (:mod:`streams.kafka_jars`)."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

from hebrus_flywheel.core import processes
from hebrus_flywheel.streams import kafka_jars
from hebrus_flywheel.streams.broker.config import BrokerConfig
from hebrus_flywheel.streams.exceptions import BrokerError, ToolNotFoundError

log = logging.getLogger(__name__)
JAVA_MIN_MAJOR = 17


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


def run_tool(cmd: list[str], what: str, hint: str, timeout_s: float) -> None:
    """Run a broker tool; :class:`BrokerError` when it fails."""
    processes.run_tool(cmd, what=what, hint=hint, timeout_s=timeout_s, error=BrokerError)


def _resolve_jars(dest: Path, version: str) -> None:
    """Maven copies the jars of Kafka ``version`` (checksums checked by Maven) into ``dest``."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("resolving Kafka %s jars with Maven into %s", version, dest)
    hint = "check network access to Maven Central (or a mirror in ~/.m2/settings.xml) and retry"
    cmd = kafka_jars.maven_command(find_maven(), dest, version)
    run_tool(cmd, "resolving the Kafka jars", hint, 1800)
    if not (dest / f"{kafka_jars.KAFKA_JAR}-{version}.jar").is_file():
        raise BrokerError(f"Maven left no {kafka_jars.KAFKA_JAR}-{version}.jar in {dest}; {hint}")


def ensure_jars(config: BrokerConfig) -> Path:
    """Resolve the jars into ``config.jars_dir`` if needed; refuse any not pinned by SHA-256."""
    return kafka_jars.ensure_jars(config.jars_dir, _resolve_jars)


def pin_jars(config: BrokerConfig) -> Path:
    """Resolve the jars afresh and write their SHA-256 to ``streams/kafka/jars.sha256``."""
    return kafka_jars.pin_jars(config.kafka_dir / "libs.pinning", _resolve_jars)


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
