"""Which Kafka the embedded broker runs, and the SHA-256 of every jar it may load.

One version, one place: ``streams/kafka/kafka.env`` (``KAFKA_VERSION=x.y.z``). The
repository root's ``.env`` is a link to it, so ``docker compose`` substitutes the same
value into ``image: apache/kafka:${KAFKA_VERSION}``, and the embedded broker passes it
to Maven as ``-Dkafka.version`` (the pom has no version of its own).

Every jar Maven copies into ``<home>/kafka/libs`` must be listed with its SHA-256 in
``streams/kafka/jars.sha256`` (``sha256sum`` format); the broker checks them after
Maven resolves them and again before every start. ``flywheel broker pin-jars``
(``make pin-jars``) rewrites the list after a deliberate version change.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from hebrus_flywheel.core.files import atomic_write_text
from hebrus_flywheel.streams.exceptions import BrokerError

KAFKA_DIR = Path(__file__).resolve().parent / "kafka"
POM_PATH = KAFKA_DIR / "pom.xml"
VERSION_PATH = KAFKA_DIR / "kafka.env"
PINS_PATH = KAFKA_DIR / "jars.sha256"
VERSION_KEY = "KAFKA_VERSION"
KAFKA_JAR = "kafka_2.13"
_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")
_PIN_RE = re.compile(r"^([0-9a-f]{64}) [ *]([^/\\\s]+\.jar)$")
MARKER = ".pom.sha256"
Resolver = Callable[[Path, str], None]
"""``resolve(dest, version)``: Maven copies the jars of Kafka ``version`` into ``dest``."""
_REPIN = (
    "if the Kafka version or streams/kafka/pom.xml changed on purpose, run "
    "`flywheel broker pin-jars` (make pin-jars), review and commit streams/kafka/jars.sha256"
)


def kafka_version(path: Path = VERSION_PATH) -> str:
    """The ``KAFKA_VERSION`` from ``path`` (``KEY=value`` lines, ``#`` comments)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise BrokerError(f"cannot read the Kafka version file {path}: {exc}") from exc
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == VERSION_KEY:
            version = value.strip().strip("\"'")
            if not _VERSION_RE.match(version):
                raise BrokerError(f"{path}: {VERSION_KEY} must look like 4.4.0, got {version!r}")
            return version
    raise BrokerError(f"{path} has no {VERSION_KEY}=x.y.z line; add one (e.g. {VERSION_KEY}=4.4.0)")


def read_pins(path: Path = PINS_PATH) -> dict[str, str]:
    """``{jar file name: sha256 hex}`` from a ``sha256sum``-style file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise BrokerError(f"cannot read the jar pins {path}: {exc}; {_REPIN}") from exc
    pins: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _PIN_RE.match(line.strip())
        if match is None:
            raise BrokerError(f"{path}:{number}: expected '<sha256>  <name>.jar', got {line!r}")
        pins[match.group(2)] = match.group(1)
    if not pins:
        raise BrokerError(f"{path} pins no jar; {_REPIN}")
    return pins


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def jar_digests(libs: Path) -> dict[str, str]:
    """``{name: sha256}`` of every jar the JVM's ``libs/*`` class path would load."""
    return {p.name: sha256_file(p) for p in sorted(libs.iterdir()) if _is_jar(p)}


def _is_jar(path: Path) -> bool:
    return path.suffix.lower() == ".jar" and (path.is_file() or path.is_symlink())


def verify_jars(libs: Path, pins: dict[str, str] | None = None) -> None:
    """Refuse unless ``libs`` holds exactly the pinned jars with the pinned SHA-256."""
    pins = read_pins() if pins is None else pins
    if not libs.is_dir():
        raise BrokerError(f"{libs} does not exist; run `flywheel broker up` to resolve the jars")
    actual = jar_digests(libs)
    faults = [
        f"{name}: SHA-256 {actual[name]} but {PINS_PATH.name} pins {want}"
        for name, want in sorted(pins.items())
        if name in actual and actual[name] != want
    ]
    faults += [f"{n}: pinned but missing" for n in sorted(pins.keys() - actual.keys())]
    faults += [f"{n}: not pinned (unknown jar)" for n in sorted(actual.keys() - pins.keys())]
    if faults:
        listing = "\n  ".join(faults)
        raise BrokerError(
            f"the Kafka jars in {libs} do not match {PINS_PATH} and were not used:\n  "
            f"{listing}\nDelete {libs} and run `flywheel broker up` to resolve them again "
            f"from Maven Central; {_REPIN}"
        )


def pins_text(digests: dict[str, str], version: str) -> str:
    """The content of ``jars.sha256`` for ``digests`` (sorted, ``sha256sum`` format)."""
    head = [
        f"# SHA-256 of every jar of the embedded Kafka {version} broker (streams/kafka/pom.xml).",
        "# Checked after Maven resolves them and before every `flywheel broker up`.",
        "# Regenerate with `flywheel broker pin-jars` (make pin-jars); review the diff.",
    ]
    return "\n".join([*head, *(f"{digests[n]}  {n}" for n in sorted(digests))]) + "\n"


def check_pins_version(pins: dict[str, str], version: str) -> None:
    """The pinned Kafka jars must be the ones of ``version`` (catches a stale pins file)."""
    kafka = [n for n in pins if n.startswith(("kafka_", "kafka-"))]
    stale = [n for n in kafka if not n.endswith(f"-{version}.jar")]
    if f"{KAFKA_JAR}-{version}.jar" not in pins or stale:
        raise BrokerError(
            f"{PINS_PATH} pins Kafka jars {sorted(kafka)} but {VERSION_PATH} says "
            f"{VERSION_KEY}={version}; {_REPIN}"
        )


def resolution_digest(version: str) -> str:
    """Changes whenever the pom, the version or the pins change (then Maven runs again)."""
    digest = hashlib.sha256(POM_PATH.read_bytes())
    digest.update(f"\0{version}\0".encode())
    digest.update(PINS_PATH.read_bytes() if PINS_PATH.is_file() else b"")
    return digest.hexdigest()


def maven_command(mvn: str, dest: Path, version: str) -> list[str]:
    """``mvn`` copying the jars of Kafka ``version`` into ``dest``; ``-C`` refuses any
    download whose checksum does not match the one Maven Central publishes."""
    return [
        mvn, "-q", "-B", "-C", "-f", str(POM_PATH), "dependency:copy-dependencies",
        f"-Dkafka.version={version}", f"-DoutputDirectory={dest}",
    ]  # fmt: skip


def ensure_jars(libs: Path, resolve: Resolver) -> Path:
    """Resolve into ``libs`` unless its digest marker is current, then refuse any jar that
    is not pinned with its SHA-256 (checked on every call, i.e. before every start)."""
    version, pins = kafka_version(), read_pins()
    check_pins_version(pins, version)
    digest = resolution_digest(version)
    marker = libs / MARKER
    if marker.is_file() and marker.read_text().strip() == digest:
        verify_jars(libs, pins)
        return libs
    partial = libs.with_name(libs.name + ".partial")
    resolve(partial, version)
    verify_jars(partial, pins)  # a bad download never becomes libs/
    (partial / MARKER).write_text(digest + "\n")
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)
    return libs


def pin_jars(scratch: Path, resolve: Resolver, path: Path = PINS_PATH) -> Path:
    """Resolve the jars into ``scratch`` (then removed) and write their SHA-256 to ``path``."""
    version = kafka_version()
    try:
        resolve(scratch, version)
        text = pins_text(jar_digests(scratch), version)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    atomic_write_text(path, text)
    return path
