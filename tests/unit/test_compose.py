"""compose.yaml, checked without Docker (none on the build machine): three Kafka nodes
wired to the files `flywheel broker render-config --nodes 3` writes, every service's
command parsed by the real CLI (options, types, required options), each worker with only
its own role's client bundle and nothing that stops `--scale`. See the file's header for
what was and was not run."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer._click.exceptions import MissingParameter, NoSuchOption
from typer.testing import CliRunner

from hebrus_flywheel.core.settings import read_kafka_properties
from hebrus_flywheel.streams.cli import broker_app

ROOT = Path(__file__).resolve().parents[2]
WORKER_ROLES = {"streams-worker": "streams", "replay-worker": "replay",
                "candidate-worker": "replay"}
NODES = ("kafka-1", "kafka-2", "kafka-3")


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


def _flywheel_commands(command: list[str]) -> list[list[str]]:
    """The ``flywheel ...`` invocations of a service command (``sh -c "a && b"`` split)."""
    if command[:2] == ["sh", "-c"]:
        return [shlex.split(part) for part in command[2].replace("||", "&&").split("&&")
                if shlex.split(part)[:1] == ["flywheel"]]
    return [command] if command[:1] == ["flywheel"] else []


def _root_command() -> Any:
    """The real ``flywheel`` command tree (typer vendors click: typer._click)."""
    from hebrus_flywheel import cli

    cli._mount_subapps()
    return typer.main.get_command(cli.app)


def _unparsed(ctx: Any) -> list[str]:
    """What a group's context left for its subcommand (the command name is protected)."""
    protected = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])
    return [*protected, *ctx.args]


def _parse(cli: Any, args: list[str]) -> str:
    """Parse ``args`` as the real CLI would (unknown options, bad types and missing
    required options raise click errors) without running anything; the command path."""
    ctx = cli.make_context("flywheel", list(args), resilient_parsing=False)
    command = cli
    path = []
    rest = _unparsed(ctx)
    while hasattr(command, "resolve_command"):  # a group
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None, args
        path.append(str(name))
        ctx = sub.make_context(str(name), list(rest), parent=ctx)
        command, rest = sub, _unparsed(ctx)
    assert not rest, (args, rest)
    return " ".join(path)


def test_every_service_command_parses_with_the_cli(services: dict[str, Any]) -> None:
    group = _root_command()
    parsed = {}
    for name, service in services.items():
        for command in _flywheel_commands(service.get("command") or []):
            parsed[name] = _parse(group, command[1:])
    assert parsed["replay-worker"] == "replay worker"
    assert parsed["streams-worker"] == "streams worker"
    assert parsed["candidate-worker"] == "replay candidate-worker"
    assert set(parsed) == {"kafka-config", "topics", "teacher", "streams-worker",
                           "replay-worker", "candidate-worker", "storage-config",
                           "storage-bucket"}
    replay = services["replay-worker"]["command"]
    teacher = services["teacher"]["command"][-1]
    assert _option(replay, "--teacher") in teacher  # the one-shot creates what it loads
    assert _option(replay, "--dataset").startswith(
        services["replay-worker"]["environment"]["FLYWHEEL_HOME"])


def test_a_missing_required_option_is_refused_by_the_parser() -> None:
    group = _root_command()
    with pytest.raises(MissingParameter):
        _parse(group, ["replay", "worker", "--stall-timeout-s", "120"])
    with pytest.raises(NoSuchOption):
        _parse(group, ["streams", "worker", "--no-such-flag"])


def test_three_nodes_start_from_the_rendered_files(services: dict[str, Any],
                                                   rendered: tuple[Path, Path]) -> None:
    mount, here = rendered
    assert _option(services["kafka-config"]["command"], "--nodes") == "3"
    for i, name in enumerate(NODES, 1):
        node = services[name]
        assert "flywheel-broker:" + str(mount) in node["volumes"]
        script = Path(node["command"][-1])
        assert (here / script.relative_to(mount)).is_file()
        health = node["healthcheck"]["test"][-1]
        assert f"--bootstrap-server {name}:9094" in health
        java = Path(health.split("--command-config ")[1].split()[0])
        assert (here / java.relative_to(mount)).is_file()
        assert node["depends_on"]["kafka-config"]["condition"] == \
            "service_completed_successfully"
        port = 19092 + 2 * (i - 1)
        assert node["ports"] == [f"127.0.0.1:{port}:{port}"]
        server = (here / script.relative_to(mount)).parent / "server.properties"
        settings = [line for line in server.read_text().splitlines()
                    if not line.startswith("#")]
        assert not [line for line in settings if "PLAINTEXT" in line]
        assert f"listeners=SASL_SSL://0.0.0.0:9094,EXTERNAL://0.0.0.0:{port}," \
            f"CONTROLLER://{name}:19093" in settings
        assert f"node.id={i}" in settings
        assert "controller.quorum.voters=1@kafka-1:19093,2@kafka-2:19093,3@kafka-3:19093" \
            in settings
        assert {"default.replication.factor=3", "min.insync.replicas=2",
                "offsets.topic.replication.factor=3"} <= set(settings)
        assert "KAFKA_LISTENERS" not in str(node.get("environment"))
        assert node["image"].startswith("apache/kafka:${KAFKA_VERSION")


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
    assert {n: c["condition"] for n, c in topics["depends_on"].items()} == \
        dict.fromkeys(NODES, "service_healthy")


def test_each_worker_mounts_only_its_role_and_scales(services: dict[str, Any],
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
        assert service["environment"]["FLYWHEEL_BOOTSTRAP_SERVERS"] == \
            ",".join(f"{n}:9094" for n in NODES)
        # --scale: no fixed container name, host port or static group member id
        assert not {"container_name", "ports"} & set(service)
        assert "--instance-id" not in service["command"]


def test_the_object_store_runs_the_pinned_seaweedfs_on_the_rendered_identities(
        services: dict[str, Any], tmp_path: Path) -> None:
    """The image tag is the pinned module's release; its command is the embedded store's
    (server_args) with the S3 port on 0.0.0.0 and every other port on loopback, reading the
    s3.json, certificate and key that `storage render-config` writes."""
    from hebrus_flywheel.streams import seaweedfs
    from hebrus_flywheel.streams.storage_server import render_config

    store, config = services["object-store"], services["storage-config"]["command"]
    assert store["image"] == f"chrislusf/seaweedfs:{seaweedfs.RELEASE}" == seaweedfs.IMAGE
    assert store["entrypoint"] == ["/usr/bin/weed"]
    home = services["storage-config"]["volumes"][0].split(":")[1]
    assert _option(config, "--home") == home
    security = Path(home) / "storage" / "security"
    port = int(store["ports"][0].rsplit(":", 1)[1])
    layout = seaweedfs.ServerLayout(s3_port=port, s3_bind="0.0.0.0", data_dir=Path("/data"),
                                    security_dir=security)
    assert store["command"] == seaweedfs.server_args(layout)
    assert "flywheel-objects:/data" in store["volumes"]
    written = {p.name: p for p in render_config(tmp_path, host=_option(config, "--host"))}
    assert {"s3.json", "ca.crt", "tls.key"} <= set(written)
    for flag in ("-s3.config=", "-s3.cert.file=", "-s3.key.file="):
        used = next(a for a in store["command"] if a.startswith(flag)).split("=", 1)[1]
        assert Path(used).parent == security and Path(used).name in written
    bucket = services["storage-bucket"]
    assert bucket["command"] == ["flywheel", "storage", "ensure-bucket"]
    assert bucket["environment"]["FLYWHEEL_HOME"] == home
    endpoint = services["replay-worker"]["environment"]["FLYWHEEL_S3_ENDPOINT"]
    assert endpoint == f"https://object-store:{port}" == bucket["environment"][
        "FLYWHEEL_S3_ENDPOINT"]
