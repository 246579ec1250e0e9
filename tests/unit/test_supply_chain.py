"""Supply chain: one Kafka version, pinned jar SHA-256s, and a lock that covers pyproject.toml."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from hebrus_flywheel.streams import kafka_jars
from hebrus_flywheel.streams.broker import BrokerConfig, ensure_jars
from hebrus_flywheel.streams.exceptions import BrokerError

ROOT = Path(__file__).resolve().parents[2]


def _lockfile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lockfile", ROOT / "tools" / "lockfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("lockfile", module)
    spec.loader.exec_module(module)
    return module


def _fake_libs(tmp_path: Path, names: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
    libs = tmp_path / "libs"
    libs.mkdir()
    for name, data in names.items():
        (libs / name).write_bytes(data)
    return libs, {name: hashlib.sha256(data).hexdigest() for name, data in names.items()}


# --------------------------------------------------------------------------- one version


def test_compose_pom_and_broker_use_the_one_kafka_version() -> None:
    version = kafka_jars.kafka_version()
    assert (ROOT / ".env").resolve() == kafka_jars.VERSION_PATH.resolve()
    assert kafka_jars.kafka_version(ROOT / ".env") == version
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    images = {s["image"] for s in services.values() if "apache/kafka" in s.get("image", "")}
    assert len(images) == 1 and {"kafka-1", "kafka-2", "kafka-3"} <= set(services)
    substituted = re.sub(r"\$\{KAFKA_VERSION(:[?-][^}]*)?\}", version, images.pop())
    assert substituted == f"apache/kafka:{version}"
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    pom = ET.parse(kafka_jars.POM_PATH).getroot()
    assert pom.find("m:properties/m:kafka.version", ns) is None  # no second place
    kafka = [d for d in pom.iterfind("m:dependencies/m:dependency", ns)
             if d.findtext("m:artifactId", namespaces=ns) == kafka_jars.KAFKA_JAR]  # fmt: skip
    assert [d.findtext("m:version", namespaces=ns) for d in kafka] == ["${kafka.version}"]
    command = kafka_jars.maven_command("mvn", Path("/x"), version)
    assert f"-Dkafka.version={version}" in command and "-C" in command


def test_pinned_kafka_jars_carry_the_version() -> None:
    version, pins = kafka_jars.kafka_version(), kafka_jars.read_pins()
    kafka_jars.check_pins_version(pins, version)
    assert f"kafka_2.13-{version}.jar" in pins
    assert f"kafka-clients-{version}.jar" in pins


def test_a_pins_file_of_another_version_is_refused() -> None:
    pins = {"kafka_2.13-4.1.0.jar": "0" * 64, "kafka-clients-4.1.0.jar": "1" * 64}
    with pytest.raises(BrokerError, match=r"KAFKA_VERSION=4\.4\.0.*pin-jars"):
        kafka_jars.check_pins_version(pins, "4.4.0")


def test_kafka_version_file_errors_name_the_file(tmp_path: Path) -> None:
    env = tmp_path / "kafka.env"
    env.write_text("# nothing\nOTHER=1\n")
    with pytest.raises(BrokerError, match="has no KAFKA_VERSION"):
        kafka_jars.kafka_version(env)
    env.write_text("KAFKA_VERSION=latest\n")
    with pytest.raises(BrokerError, match=r"must look like 4\.4\.0, got 'latest'"):
        kafka_jars.kafka_version(env)
    env.write_text('KAFKA_VERSION="4.5.1"\n')
    assert kafka_jars.kafka_version(env) == "4.5.1"


# --------------------------------------------------------------------------- jar pins


def test_matching_jars_pass(tmp_path: Path) -> None:
    libs, pins = _fake_libs(tmp_path, {"a-1.jar": b"a", "b-2.jar": b"b"})
    (libs / ".pom.sha256").write_text("marker\n")  # not a jar: ignored
    kafka_jars.verify_jars(libs, pins)


def test_a_tampered_jar_is_refused_by_name(tmp_path: Path) -> None:
    libs, pins = _fake_libs(tmp_path, {"a-1.jar": b"a", "b-2.jar": b"b"})
    (libs / "b-2.jar").write_bytes(b"b but evil")
    with pytest.raises(BrokerError) as err:
        kafka_jars.verify_jars(libs, pins)
    message = str(err.value)
    assert "b-2.jar: SHA-256" in message and "a-1.jar" not in message
    assert "flywheel broker up" in message and "pin-jars" in message


def test_missing_and_unknown_jars_are_refused(tmp_path: Path) -> None:
    libs, pins = _fake_libs(tmp_path, {"a-1.jar": b"a", "b-2.jar": b"b"})
    (libs / "a-1.jar").unlink()
    (libs / "extra-9.JAR").write_bytes(b"x")
    with pytest.raises(BrokerError) as err:
        kafka_jars.verify_jars(libs, pins)
    assert "a-1.jar: pinned but missing" in str(err.value)
    assert "extra-9.JAR: not pinned (unknown jar)" in str(err.value)


def test_pins_text_round_trips(tmp_path: Path) -> None:
    digests = {"z-1.jar": "a" * 64, "kafka_2.13-9.9.9.jar": "b" * 64}
    path = tmp_path / "jars.sha256"
    path.write_text(kafka_jars.pins_text(digests, "9.9.9"))
    assert kafka_jars.read_pins(path) == digests
    path.write_text("nothex  z-1.jar\n")
    with pytest.raises(BrokerError, match=r"jars.sha256:1: expected"):
        kafka_jars.read_pins(path)


def _resolved(config: BrokerConfig) -> None:
    """Mark config.jars_dir as resolved for the current pom/version/pins (Maven not run)."""
    digest = kafka_jars.resolution_digest(kafka_jars.kafka_version())
    (config.jars_dir / ".pom.sha256").write_text(digest + "\n")


def test_broker_start_refuses_jars_that_differ_from_the_pins(tmp_path: Path) -> None:
    pins = kafka_jars.read_pins()
    libs = tmp_path / "libs"
    libs.mkdir()
    for name in pins:
        (libs / name).write_bytes(b"not the real jar")
    config = BrokerConfig(home=tmp_path / "home", libs_dir=libs)
    _resolved(config)
    with pytest.raises(BrokerError, match=r"kafka_2\.13-[\d.]+\.jar: SHA-256"):
        ensure_jars(config)


def test_broker_start_refuses_a_tampered_copy_of_the_real_jars(tmp_path: Path) -> None:
    shared = BrokerConfig().jars_dir
    if not (shared / f"kafka-clients-{kafka_jars.kafka_version()}.jar").is_file():
        pytest.skip(f"no resolved jars in {shared}; `flywheel broker up` resolves them")
    libs = tmp_path / "libs"
    shutil.copytree(shared, libs, ignore=shutil.ignore_patterns(".*"))
    config = BrokerConfig(home=tmp_path / "home", libs_dir=libs)
    _resolved(config)
    assert ensure_jars(config) == libs  # the copy matches the pins
    victim = libs / f"kafka-clients-{kafka_jars.kafka_version()}.jar"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(BrokerError) as err:
        ensure_jars(config)
    assert f"{victim.name}: SHA-256" in str(err.value)
    assert str(err.value).count(": SHA-256") == 1


# --------------------------------------------------------------------------- Python lock


def test_the_lock_covers_pyproject() -> None:
    assert _lockfile().problems(ROOT) == []


def _copy_project(tmp_path: Path) -> Path:
    for name in ("pyproject.toml", "requirements.lock", "requirements-build.in"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_a_dependency_added_without_relocking_is_caught(tmp_path: Path) -> None:
    root = _copy_project(tmp_path)
    text = (root / "pyproject.toml").read_text()
    (root / "pyproject.toml").write_text(
        text.replace('  "matplotlib>=3.8",\n', '  "matplotlib>=3.8",\n  "zzz-new-dep>=1",\n')
    )
    found = _lockfile().problems(root)
    assert found == [
        "pyproject.toml dependencies requires 'zzz-new-dep>=1' but requirements.lock has no pin "
        "for zzz-new-dep"
    ]


def test_a_raised_bound_and_a_missing_hash_are_caught(tmp_path: Path) -> None:
    root = _copy_project(tmp_path)
    text = (root / "pyproject.toml").read_text()
    (root / "pyproject.toml").write_text(text.replace('"pytest>=8"', '"pytest>=99"'))
    lock = (root / "requirements.lock").read_text()
    (root / "requirements.lock").write_text(lock + "extra-unhashed==1.0\n")
    found = _lockfile().problems(root)
    assert any("'pytest>=99' but requirements.lock pins pytest==" in f for f in found)
    assert "requirements.lock pins extra-unhashed without a --hash" in found
    assert len(found) == 2
