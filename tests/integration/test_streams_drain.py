"""``flywheel streams worker --drain`` against the real broker, with and without an outage.

Done means caught up (invariant 11): the worker exits 0 only when every input partition
is committed to its end; a broker outage is never idle time. The outage test stops the
embedded broker of this FLYWHEEL_HOME (never an external cluster) for more than three
consumer session timeouts while the worker is mid-stream, and starts it again.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.progress import partition_lag, read_health
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV
from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker
from hebrus_flywheel.streams.processors.liveness import input_topics
from hebrus_flywheel.streams.processors.topology import StreamTopics
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

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDENTITY = make_identity(layers=8, experts=64, top_k=4)
FLAGS = {"validation_fraction": 0.3, "runtime_holdout_fraction": 0.3, "stress_rate": 0.0}
SESSION_S = 6.0  # the broker's group.min.session.timeout.ms
STALL_S = 30.0
APP_ID = "flywheel-streams"


def _messages(n_threads: int, seed: int) -> list[Any]:
    clock = ProducerClock(producer_id=f"runtime-{seed}")
    messages = [identity_message(IDENTITY)]
    for spec in random_specs(n_threads, n_owners=9, seed=seed, assistant_tokens=24):
        messages.extend(thread_messages(spec, IDENTITY, clock))
    return messages


def _setup(topic_factory: Any, name: str) -> tuple[str, StreamTopics]:
    prefix, topics = topic_factory.streams_namespace(name, APP_ID)
    return prefix, topics


def _worker(bootstrap: str, prefix: str, tmp: Path, tag: str) -> WorkerProcess:
    return WorkerProcess(
        bootstrap=bootstrap, prefix=prefix, app_id=APP_ID, log_path=tmp / f"worker-{tag}.log",
        flags=FLAGS, home=tmp / "home",
        extra=["--drain", "--session-timeout-s", str(SESSION_S), "--stall-timeout-s",
               str(STALL_S), "--broker-timeout-s", "120"])


def _lag(bootstrap: str, prefix: str, topics: StreamTopics) -> int:
    probe = kafka.LagProbe(kafka.client_config(bootstrap), prefix + APP_ID, input_topics(topics))
    try:
        ends, committed = probe.read()
    finally:
        probe.close()
    return sum(partition_lag(ends, committed).values())


def _wait_exit(worker: WorkerProcess, timeout_s: float) -> int:
    assert worker.proc is not None
    try:
        return worker.proc.wait(timeout=timeout_s)
    except Exception:
        worker.kill()
        pytest.fail(f"worker did not exit within {timeout_s:.0f}s (hang):\n"
                    + worker.log_path.read_text(errors="replace")[-3000:])


def test_drain_exits_zero_only_when_caught_up(topic_factory: Any, tmp_path: Path) -> None:
    bootstrap = topic_factory.bootstrap
    prefix, topics = _setup(topic_factory, "drain")
    messages = _messages(12, seed=5)
    expected = window_pairs(expected_pipeline(messages, worker_processor_config(FLAGS)).windows)
    produce(producer(bootstrap), topics, messages)
    worker = _worker(bootstrap, prefix, tmp_path, "0").start()
    rc = _wait_exit(worker, 240)
    worker.stop()
    log = worker.log_path.read_text(errors="replace")
    assert rc == 0, log[-3000:]
    found = re.search(r"drained: processed (\d+) records, final lag 0", log)
    # capture records plus the worker's own hops (threads, decisions)
    assert found is not None and int(found.group(1)) > len(messages), log[-3000:]
    assert _lag(bootstrap, prefix, topics) == 0
    assert window_pairs(read_windows(bootstrap, topics)) == expected
    [health] = read_health(tmp_path / "home", "streams")
    assert health["lag"] == 0 and set(health["agents"]) >= {"capture", "dedup", "window"}


@pytest.mark.skipif(bool(os.environ.get(BOOTSTRAP_ENV)),
                    reason="stops the embedded broker; never an external cluster")
def test_broker_outage_mid_stream_never_exits_zero_with_lag(
        topic_factory: Any, tmp_path: Path) -> None:
    bootstrap = topic_factory.bootstrap
    broker = EmbeddedBroker(BrokerConfig())
    assert broker.config.bootstrap == bootstrap
    outage_s = float(os.environ.get("FLYWHEEL_TEST_OUTAGE_S") or 3.5 * SESSION_S)
    prefix, topics = _setup(topic_factory, "outage")
    messages = _messages(36, seed=7)
    expected = window_pairs(expected_pipeline(messages, worker_processor_config(FLAGS)).windows)
    produce(producer(bootstrap), topics, messages)
    worker = _worker(bootstrap, prefix, tmp_path, "0").start()
    wait_until(lambda: len(read_windows(bootstrap, topics)) >= 2, timeout_s=120,
               interval_s=0.3, what="first windows")
    broker.down()
    time.sleep(outage_s)
    broker.up()
    back = time.monotonic()
    rc = _wait_exit(worker, STALL_S + 60 + 120)
    waited = time.monotonic() - back
    worker.stop()
    if rc == 0:
        assert _lag(bootstrap, prefix, topics) == 0  # exit 0 only when caught up
    else:
        assert waited <= STALL_S + 60 + 5, f"exit {rc} came {waited:.0f}s after the broker"
    print(f"outage {outage_s:.0f}s: first worker exit {rc} {waited:.0f}s after the broker "
          "returned")
    again = _worker(bootstrap, prefix, tmp_path, "1").start()
    rc2 = _wait_exit(again, 240)
    again.stop()
    assert rc2 == 0, again.log_path.read_text(errors="replace")[-3000:]
    assert _lag(bootstrap, prefix, topics) == 0
    assert window_pairs(read_windows(bootstrap, topics)) == expected
