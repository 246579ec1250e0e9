"""No pickle in the stream worker: explicit codecs everywhere, and a crafted pickle
payload written to a table's changelog topic is refused without being run.

The payload unpickles to ``os.mkdir(<marker>)``; the marker directory never appears.
The worker restoring that changelog stops with the crash status and one line naming
the record (topic[partition]@offset); ``flywheel streams accounting`` exits 1 and
lists it under ``refused_state_records``.
"""

from __future__ import annotations

import json
import os
import pickle  # builds the hostile payload
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.core import kafka
from hebrus_flywheel.streams.processors.app import (
    CAPTURE_TABLE,
    DEDUP_TABLE,
    StreamsWorker,
    WorkerConfig,
)
from hebrus_flywheel.streams.processors.common import header_key, instance_id
from hebrus_flywheel.streams.processors.crash import CRASH_EXIT_STATUS
from hebrus_flywheel.streams.processors.state_codec import (
    STATE_CODEC,
    RefusingChangelogTopic,
)
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.topics import catalogue
from tests.support.streams_harness import (
    WorkerProcess,
    expected_pipeline,
    produce,
    producer,
    read_windows,
    wait_until,
    window_pairs,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

pytestmark = [pytest.mark.integration]

IDENTITY = make_identity(layers=4, experts=64, top_k=4)
FLAGS = {"validation_fraction": 0.3, "stress_rate": 0.0}
APP_ID = "flywheel-streams"
EXPLICIT = {"raw", "json", STATE_CODEC}


class _Marker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def _setup(topic_factory: Any, name: str) -> tuple[str, StreamTopics]:
    prefix, topics = topic_factory.streams_namespace(name, APP_ID)
    return prefix, topics


def _drain(bootstrap: str, prefix: str, tmp: Path, tag: str) -> tuple[int, str]:
    worker = WorkerProcess(bootstrap=bootstrap, prefix=prefix, app_id=APP_ID,
                           log_path=tmp / f"worker-{tag}.log", flags=FLAGS, home=tmp / "home",
                           extra=["--drain", "--stall-timeout-s", "60"]).start()
    assert worker.proc is not None
    try:
        rc = worker.proc.wait(timeout=240)
    finally:
        worker.kill()
    return rc, worker.log_path.read_text(errors="replace")


def test_every_table_and_topic_of_the_worker_has_an_explicit_codec(topic_factory: Any,
                                                                    tmp_path: Path) -> None:
    prefix, _ = _setup(topic_factory, "codecs")
    names = [spec.name for spec in catalogue(prefix)]
    wait_until(lambda: {t for t, _ in kafka.end_watermarks(
        kafka.client_config(topic_factory.bootstrap), names, missing_ok=True)} == set(names),
        timeout_s=60, interval_s=0.5, what="the new topics in the broker's metadata")
    worker = StreamsWorker(WorkerConfig(bootstrap=topic_factory.bootstrap, prefix=prefix,
                                        data_dir=tmp_path))
    app = worker.app
    assert (app.conf.key_serializer, app.conf.value_serializer) == ("raw", "raw")
    assert {t.name for t in app.tables.values()} == {CAPTURE_TABLE, DEDUP_TABLE}
    for table in app.tables.values():
        assert (table.key_serializer, table.value_serializer) == ("json", STATE_CODEC)
        changelog = table.changelog_topic
        assert isinstance(changelog, RefusingChangelogTopic)
        assert (changelog.key_serializer, changelog.value_serializer) == ("json", STATE_CODEC)
    topics = [agent.channel for agent in app.agents.values()]
    topics += [worker.threads_topic, worker.decisions_topic, worker.ticks_topic,
               worker.quarantine_topic, *worker.window_topics.values(),
               app._leader_assignor._leader_topic]
    for topic in topics:
        serializers = {topic.key_serializer or app.conf.key_serializer,
                       topic.value_serializer or app.conf.value_serializer}
        assert serializers <= EXPLICIT, (topic, serializers)


def _pickle_into_changelog(bootstrap: str, topic: str, marker: Path) -> None:
    prod = producer(bootstrap)
    key = json.dumps(header_key(instance_id("owner-0000", "thread-00000", 0))).encode()
    prod.produce(topic, key=key, value=pickle.dumps(_Marker(marker), protocol=5), partition=0)
    assert prod.flush(30) == 0


def _accounting(bootstrap: str, prefix: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hebrus_flywheel.streams.processors.cli", "accounting",
         "--bootstrap-servers", bootstrap, "--prefix", prefix, "--app-id", APP_ID],
        capture_output=True, text=True, timeout=180, env={**os.environ, "FLYWHEEL_HOME": str(home)},
        check=False)


def test_a_pickle_in_a_changelog_topic_is_refused_and_never_run(topic_factory: Any,
                                                                tmp_path: Path) -> None:
    bootstrap = topic_factory.bootstrap
    prefix, topics = _setup(topic_factory, "pickle")
    clock = ProducerClock(producer_id="runtime-np")
    messages = [identity_message(IDENTITY)]
    for spec in random_specs(6, n_owners=3, seed=11, assistant_tokens=16):
        messages.extend(thread_messages(spec, IDENTITY, clock))
    later = list(thread_messages(random_specs(1, seed=12)[0], IDENTITY, clock))
    expected = window_pairs(expected_pipeline(messages, worker_processor_config(FLAGS)).windows)
    half = len(messages) // 2
    produce(producer(bootstrap), topics, messages[:half])
    rc, log = _drain(bootstrap, prefix, tmp_path, "first")
    assert rc == 0, log[-3000:]
    # the second half completes generations the first run left open: only a correct
    # restore of the JSON changelogs gives the expected windows
    produce(producer(bootstrap), topics, messages[half:])
    rc, log = _drain(bootstrap, prefix, tmp_path, "restored")
    assert rc == 0, log[-3000:]
    assert window_pairs(read_windows(bootstrap, topics)) == expected

    changelog = f"{prefix}{APP_ID}-{CAPTURE_TABLE}-changelog"
    offset = kafka.end_watermarks(kafka.client_config(bootstrap), [changelog],
                                  timeout_s=30)[(changelog, 0)][1]
    marker = tmp_path / "pwned"
    _pickle_into_changelog(bootstrap, changelog, marker)

    done = _accounting(bootstrap, prefix, tmp_path / "home")
    assert done.returncode == 1, done.stderr[-3000:]
    assert json.loads(done.stdout)["refused_state_records"] == [[changelog, 0, offset]]
    assert "refused 1 state changelog record" in done.stderr
    assert not marker.exists()

    produce(producer(bootstrap), topics, later)  # work to do: the worker must restore first
    rc, log = _drain(bootstrap, prefix, tmp_path, "hostile")
    assert rc == CRASH_EXIT_STATUS, log[-3000:]
    assert f"on {changelog}[0]@{offset}" in log and "changelog restore" in log, log[-3000:]
    assert not marker.exists()
    assert window_pairs(read_windows(bootstrap, topics)) == expected
