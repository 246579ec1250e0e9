"""The broker refuses every quarantine record: the worker stops non-zero, nothing vanishes.

The quarantine topic's ``max.message.bytes`` is set below the size of any quarantine
record, one bad record is published, and ``streams worker --drain`` must exit non-zero
within 60 s (crash-only: the refused delivery stops the worker before the bad record's
offset is committed). With the setting restored, a restarted worker quarantines that
record exactly once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

from hebrus_flywheel.core import kafka
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams import limits
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.topology import StreamTopics
from tests.support.streams_harness import WorkerProcess, producer, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP_ID = "flywheel-streams"
FLAGS = {"validation_fraction": 0.0, "runtime_holdout_fraction": 0.0, "stress_rate": 0.0}
TOO_SMALL = 64  # bytes: below any quarantine record (its schema header alone is longer)


def set_max_message_bytes(bootstrap: str, topic: str, value: int) -> None:
    admin = kafka.make_admin(kafka.client_config(bootstrap))
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[
        ConfigEntry("max.message.bytes", str(value),
                    incremental_operation=AlterConfigOpType.SET)])
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(30)


def _worker(bootstrap: str, prefix: str, tmp: Path, tag: str) -> WorkerProcess:
    return WorkerProcess(
        bootstrap=bootstrap, prefix=prefix, app_id=APP_ID, log_path=tmp / f"worker-{tag}.log",
        flags=FLAGS, home=tmp / "home",
        extra=["--drain", "--session-timeout-s", "6", "--stall-timeout-s", "40",
               "--broker-timeout-s", "40"])


def _wait_exit(worker: WorkerProcess, timeout_s: float) -> int:
    assert worker.proc is not None
    try:
        return worker.proc.wait(timeout=timeout_s)
    except Exception:
        worker.kill()
        pytest.fail(f"worker did not exit within {timeout_s:.0f}s (hang):\n"
                    + worker.log_path.read_text(errors="replace")[-3000:])


def _quarantined(bootstrap: str, topics: StreamTopics) -> list[dict[str, Any]]:
    return [codec.decode(m.value() or b"")[1] for m in read_topic(bootstrap, topics.quarantine)]


def test_refused_quarantine_record_stops_the_worker_and_is_quarantined_after_restart(
        topic_factory: Any, tmp_path: Path) -> None:
    bootstrap = topic_factory.bootstrap
    prefix, topics = topic_factory.streams_namespace("refused", APP_ID)
    prod = producer(bootstrap)
    prod.produce(topics.observations, key=b"o/t1", value=b"\x00not a capture record")
    prod.flush(30)
    [(source, end)] = [((t, p), high) for (t, p), (_, high) in kafka.end_watermarks(
        kafka.client_config(bootstrap), [topics.observations]).items() if high > 0]
    first = _worker(bootstrap, prefix, tmp_path, "0").start()
    # past its topic check (which refuses a quarantine topic that differs from the
    # catalogue) the worker records its run, then starts faust: shrink the limit then
    wait_until(lambda: any(True for _ in read_topic(bootstrap, topics.runs)), timeout_s=60,
               interval_s=0.2, what="the worker's run record")
    set_max_message_bytes(bootstrap, topics.quarantine, TOO_SMALL)
    rc = _wait_exit(first, 60)
    first.stop()
    log = first.log_path.read_text(errors="replace")
    assert rc != 0, log[-3000:]
    assert "differ from the catalogue" not in log, log[-3000:]
    assert _quarantined(bootstrap, topics) == []
    print(f"refused: worker exit {rc}; last log lines:\n" + "\n".join(log.splitlines()[-3:]))

    set_max_message_bytes(bootstrap, topics.quarantine, limits.QUARANTINE_MAX_MESSAGE_BYTES)
    again = _worker(bootstrap, prefix, tmp_path, "1").start()
    rc2 = _wait_exit(again, 120)
    again.stop()
    assert rc2 == 0, again.log_path.read_text(errors="replace")[-3000:]
    records = [r for r in _quarantined(bootstrap, topics)
               if (r["source_topic"], r["source_partition"]) == source]
    assert [r["source_offset"] for r in records] == [end - 1], records
    print(f"after restart: exit {rc2}, quarantined once with reason {records[0]['reason']}")
