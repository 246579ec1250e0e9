"""A broker started only from what ``flywheel broker render-config`` wrote, the way
compose.yaml starts it: the generated ``kafka/start.sh`` (format with the admin's SCRAM
credential, then run) with ``KAFKA_BIN`` scripts that run this project's pinned jars in
place of the apache/kafka image's. Then ``flywheel broker grant`` and a worker role that
reads its own ``clients/<role>`` bundle through a "mount" (a symlink)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError
from typer.testing import CliRunner

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.settings import read_kafka_properties
from hebrus_flywheel.streams.broker import LOG4J2_PATH, BrokerConfig, find_java
from hebrus_flywheel.streams.cli import broker_app
from hebrus_flywheel.streams.security import admin_config
from hebrus_flywheel.streams.topics import TopicSpec, create_topics
from tests.support.ports import free_port

pytestmark = [pytest.mark.integration]


def _kafka_bin(tmp: Path, jars: Path, logs: Path) -> Path:
    """``kafka-storage.sh`` and ``kafka-server-start.sh`` as in the apache/kafka image."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    base = (f'exec {find_java()} -Dlog4j2.configurationFile={LOG4J2_PATH} '
            f'-Dkafka.logs.dir={logs} -cp "{jars}/*"')
    for name, main in (("kafka-storage.sh", "-Xmx256m kafka.tools.StorageTool"),
                       ("kafka-server-start.sh", "-Xmx512m -Xms128m kafka.Kafka")):
        (bin_dir / name).write_text(f'#!/bin/sh\n{base} {main} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.fixture(scope="module")
def rendered(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Path, str, str]]:
    """(home, bootstrap, external bootstrap) of a broker started from rendered files."""
    del kafka_bootstrap  # the session broker's jars (resolved and pinned) are reused
    tmp = tmp_path_factory.mktemp("render")
    home, port, external = tmp / "home", free_port(), f"127.0.0.1:{free_port()}"
    result = CliRunner().invoke(broker_app, [
        "render-config", "--home", str(home), "--host", "127.0.0.1", "--port", str(port),
        "--controller-port", str(free_port()), "--bind-host", "127.0.0.1",
        "--external", external, "--clients-mount", str(tmp / "mnt")])
    assert result.exit_code == 0, result.output
    env = {**os.environ, "KAFKA_BIN": str(_kafka_bin(tmp, BrokerConfig().jars_dir,
                                                      tmp / "logs"))}
    with (tmp / "broker.out").open("wb") as out:
        proc = subprocess.Popen(["sh", str(home / "kafka" / "start.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    bootstrap = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not kafka.probe(admin_config(home, bootstrap, False), 2.0):
            assert proc.poll() is None, (tmp / "broker.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the rendered broker did not start"
            time.sleep(0.5)
        yield home, bootstrap, external
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_rendered_broker_answers_on_both_listeners(rendered: tuple[Path, str, str]) -> None:
    home, bootstrap, external = rendered
    assert (home / "kafka" / "data" / "meta.properties").is_file()
    assert kafka.probe(admin_config(home, external, False), 15.0)
    plain = kafka.KafkaClientConfig(bootstrap_servers=bootstrap,
                                    properties={"security.protocol": "PLAINTEXT"})
    assert not kafka.probe(plain, 3.0)


def test_granted_role_uses_its_mounted_bundle(rendered: tuple[Path, str, str],
                                              tmp_path: Path) -> None:
    home, bootstrap, _ = rendered
    result = CliRunner().invoke(broker_app, ["grant", "--home", str(home), "-b", bootstrap])
    assert result.exit_code == 0, result.output
    admin = admin_config(home, bootstrap, False)
    capture, windows = "flywheel.capture.render-test.v1", "flywheel.windows.render-test.v1"
    create_topics(admin, [TopicSpec(name=n, partitions=1, doc="render test")
                          for n in (capture, windows)])
    (home.parent / "mnt").symlink_to(home / "clients" / "runtime")  # the worker's mount
    props = read_kafka_properties(home.parent / "mnt" / "client.properties")
    runtime = kafka.KafkaClientConfig(bootstrap_servers=bootstrap, properties=props,
                                      retry=kafka.RetryPolicy(attempts=1))
    producer = kafka.make_producer(runtime)
    producer.produce(capture, b"ok")
    assert producer.flush(30) == 0
    refused: list[KafkaError | None] = []
    producer = kafka.make_producer(runtime, settings={"message.timeout.ms": 10000})
    producer.produce(windows, b"no", on_delivery=lambda err, msg: refused.append(err))
    producer.flush(30)
    assert refused and refused[0] is not None  # the runtime may not write windows
    assert refused[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
