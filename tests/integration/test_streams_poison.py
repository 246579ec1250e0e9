"""A record that crashes the streams worker every time is bounded (issue 20): the worker
exits non-zero N times (crash-only, nothing committed past it), and on the next start
the record is quarantined by reference as ``poison``, the valid thread after it on the
same partition is windowed, inspect counts poison=1 and accounting finds every consumed
record.

The crash is made with the test-only fault injection of
:mod:`streams.processors.poison` (``FLYWHEEL_STREAMS_FAULT=crash_on_key:<key>``): the
capture agent raises on that record, outside the validate stage's own error handling,
the way a bug in an agent or a failing send would. It stays set on the last start too,
so that run proves the poisoned record itself is not processed again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.processors.accounting import account
from hebrus_flywheel.streams.processors.crash import CRASH_EXIT_STATUS
from hebrus_flywheel.streams.processors.inspect import read_topic, summarize_topics
from hebrus_flywheel.streams.processors.poison import FAULT_ENV
from hebrus_flywheel.streams.processors.topology import StreamTopics
from tests.support.streams_harness import (
    WorkerProcess,
    expected_pipeline,
    grant_for,
    producer,
    read_windows,
    window_pairs,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    Message,
    ProducerClock,
    ThreadSpec,
    encode_message,
    identity_message,
    make_identity,
    thread_messages,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP_ID = "flywheel-streams"
IDENTITY = make_identity(layers=8, experts=64, top_k=4)
FLAGS = {"validation_fraction": 0.0, "runtime_holdout_fraction": 0.0, "stress_rate": 0.0}
POISON_KEY = b"poison/p1"
CRASHES = 3  # the default --poison-after-crashes


def _worker(bootstrap: str, prefix: str, tmp: Path, tag: str) -> WorkerProcess:
    worker = WorkerProcess(
        bootstrap=bootstrap, prefix=prefix, app_id=APP_ID, log_path=tmp / f"worker-{tag}.log",
        flags=FLAGS, home=tmp / "home",
        extra=["--drain", "--drain-timeout-s", "150", "--session-timeout-s", "6",
               "--stall-timeout-s", "60", "--broker-timeout-s", "60"])
    worker.env[FAULT_ENV] = f"crash_on_key:{POISON_KEY.decode()}"
    return worker


def _run(worker: WorkerProcess, timeout_s: float = 180) -> int:
    worker.start()
    assert worker.proc is not None
    try:
        rc = worker.proc.wait(timeout=timeout_s)
    except Exception:
        worker.kill()
        pytest.fail(f"worker did not exit within {timeout_s:.0f}s:\n"
                    + worker.log_path.read_text(errors="replace")[-3000:])
    worker.stop()
    return rc


def _publish(prod: Producer, topics: StreamTopics, messages: list[Message]) -> None:
    """Everything on partition 0, so the valid thread queues behind the poison record."""
    names = topics.capture_kinds()
    grant_for(prod, topics, messages)
    for kind, key, record in messages:
        value, headers = encode_message(kind, record)
        prod.produce(names[kind], key=key, value=value, headers=list(headers), partition=0)
    prod.flush(30)


def test_a_record_that_always_crashes_the_worker_is_quarantined_as_poison(
        topic_factory: Any, tmp_path: Path) -> None:
    bootstrap = topic_factory.bootstrap
    prefix, topics = topic_factory.streams_namespace("poison", APP_ID)
    valid = list(thread_messages(ThreadSpec(owner="ok", thread="t1"), IDENTITY, ProducerClock()))
    prod = producer(bootstrap)
    _publish(prod, topics, [identity_message(IDENTITY)])
    prod.produce(topics.observations, key=POISON_KEY, value=b"any bytes", partition=0)
    prod.flush(30)
    poison_at = (topics.observations, 0, 0)
    _publish(prod, topics, valid)

    codes = [_run(_worker(bootstrap, prefix, tmp_path, str(i))) for i in range(CRASHES)]
    assert codes == [CRASH_EXIT_STATUS] * CRASHES, codes
    first_log = (tmp_path / "worker-0.log").read_text(errors="replace")
    assert "InjectedFault" in first_log and f"{poison_at[0]}[0]@0" in first_log, first_log[-3000:]
    assert not any(True for _ in read_topic(bootstrap, topics.quarantine))
    assert read_windows(bootstrap, topics) == []  # stalled behind the poison record

    last = _worker(bootstrap, prefix, tmp_path, "last")
    rc = _run(last)
    log = last.log_path.read_text(errors="replace")
    assert rc == 0, log[-3000:]
    records = [codec.decode(m.value() or b"")[1] for m in read_topic(bootstrap, topics.quarantine)]
    assert [(r["reason"], r["reference_only"]) for r in records] == [("poison", True)], records
    assert (records[0]["source_topic"], records[0]["source_partition"],
            records[0]["source_offset"]) == poison_at
    assert records[0]["value_size"] == len(b"any bytes")
    expected = window_pairs(expected_pipeline([identity_message(IDENTITY), *valid],
                                              worker_processor_config(FLAGS)).windows)
    assert expected and window_pairs(read_windows(bootstrap, topics)) == expected
    summary = summarize_topics(bootstrap, prefix=prefix, app_id=APP_ID)
    assert summary["quarantine"] == {"poison": 1}, summary
    assert summary["crashes"] == {f"{poison_at[0]}[0]@0": CRASHES}, summary
    totals = account(bootstrap, prefix=prefix, app_id=APP_ID)["totals"]
    print(f"exit codes {codes} then {rc}; quarantine {summary['quarantine']}; "
          f"crash ledger {summary['crashes']}; "
          f"accounting {totals}")
    assert totals["unaccounted"] == 0 and totals["quarantined"] == 1, totals
