"""compose.yaml, checked without Docker (none on the build machine): its services are wired
to the files `flywheel broker render-config` writes, with the options the CLI accepts, and
each worker gets only its own role's client bundle. See the file's header for what was
and was not run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from hebrus_flywheel.core.settings import read_kafka_properties
from hebrus_flywheel.streams.cli import broker_app

ROOT = Path(__file__).resolve().parents[2]
WORKER_ROLES = {"streams-worker": "streams", "replay-worker": "replay"}


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "compose.yaml").read_text())["services"])


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.fixture(scope="module")
def rendered(services: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, Path]:
    """(the volume's mount point in compose, where the same command rendered it here)."""
    command = services["kafka-config"]["command"]
    assert command[:3] == ["flywheel", "broker", "render-config"]
    args = list(command[2:])
    mount = Path(_option(args, "--home"))
    here = tmp_path_factory.mktemp("volume")
    args[args.index("--home") + 1] = str(here)
    del args[args.index("--owner"):args.index("--owner") + 2]  # chown needs root
    result = CliRunner().invoke(broker_app, args)
    assert result.exit_code == 0, result.output
    return mount, here


def test_broker_starts_from_the_rendered_files(services: dict[str, Any],
                                               rendered: tuple[Path, Path]) -> None:
    mount, here = rendered
    kafka = services["kafka"]
    assert "flywheel-broker:" + str(mount) in kafka["volumes"]
    script = Path(kafka["command"][-1])
    assert (here / script.relative_to(mount)).is_file()
    health = kafka["healthcheck"]["test"][-1]
    java = Path(health.split("--command-config ")[1].split()[0])
    assert (here / java.relative_to(mount)).is_file()
    assert kafka["depends_on"]["kafka-config"]["condition"] == "service_completed_successfully"
    assert kafka["ports"] == ["127.0.0.1:19092:19092"]
    assert _option(services["kafka-config"]["command"], "--external") == "127.0.0.1:19092"
    server = (here / "kafka" / "server.properties").read_text()
    settings = [line for line in server.splitlines() if not line.startswith("#")]
    assert not [line for line in settings if "PLAINTEXT" in line]
    assert "listeners=SASL_SSL://0.0.0.0:9094,EXTERNAL://0.0.0.0:19092," + \
        "CONTROLLER://kafka:19093" in settings
    assert "KAFKA_LISTENERS" not in str(kafka.get("environment"))  # no second config source


def test_topics_service_grants_as_admin(services: dict[str, Any],
                                        rendered: tuple[Path, Path]) -> None:
    mount, here = rendered
    topics = services["topics"]
    script = topics["command"][-1]
    assert f"flywheel broker grant --home {mount}" in script and "flywheel topics create" in script
    admin = Path(topics["environment"]["FLYWHEEL_KAFKA_CONFIG"])
    props = read_kafka_properties(here / admin.relative_to(mount))
    assert props["sasl.username"] == "admin"
    assert f"flywheel-broker:{mount}:ro" in topics["volumes"]
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_each_worker_mounts_only_its_role(services: dict[str, Any],
                                          rendered: tuple[Path, Path]) -> None:
    _, here = rendered
    clients_mount = _option(services["kafka-config"]["command"], "--clients-mount")
    for name, role in WORKER_ROLES.items():
        service = services[name]
        mounts = [v for v in service["volumes"] if isinstance(v, dict)]
        assert [(m["source"], m["target"], m["read_only"], m["volume"]["subpath"])
                for m in mounts] == [("flywheel-broker", clients_mount, True, f"clients/{role}")]
        assert not [v for v in service["volumes"] if str(v).startswith("flywheel-broker:")]
        config = Path(service["environment"]["FLYWHEEL_KAFKA_CONFIG"])
        assert config.parent == Path(clients_mount)
        props = read_kafka_properties(here / "clients" / role / config.name)
        assert props["sasl.username"] == role
        assert props["ssl.ca.location"] == f"{clients_mount}/ca.crt"
        assert service["environment"]["FLYWHEEL_BOOTSTRAP_SERVERS"] == "kafka:9094"
