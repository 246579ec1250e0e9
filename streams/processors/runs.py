"""Streams runs: what configuration processed which capture offsets.

Every ``flywheel streams worker`` start appends one record to
``flywheel.streams.runs.v1`` (key: the app id) before it consumes anything:

* the full processor configuration (:func:`streams.processors.pipeline.config_to_json`)
  and its id;
* ``capture_start``: the group's committed offset of every capture topic partition at
  that moment (0 where none is committed: the worker reads from the beginning), i.e.
  where this run's processing begins.

The runs of one app id, in topic order, cut the capture topics into segments, each
processed with one configuration. ``flywheel seal`` copies them into the manifest, and
``flywheel rebuild --from-capture`` replays each segment with its own configuration
(:mod:`consumers.capture_check`).

That is exact when a configuration changes only while no worker of the group runs: the
committed offsets are then where the old configuration stopped. A worker therefore
refuses to start with a configuration other than the app's latest run while the group
still has members (:class:`StreamsRunError`). Workers with the same configuration may
join and leave at any time.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException

from hebrus_flywheel.core import kafka
from hebrus_flywheel.streams.processors.exceptions import InspectError, WorkerError
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.pipeline import (
    ProcessorConfig,
    config_from_json,
    config_id,
    config_to_json,
)

log = logging.getLogger(__name__)
_LOG = "streams.librdkafka"

RUN_FORMAT = "hebrus-flywheel-streams-run/v1"


class StreamsRunError(WorkerError):
    """A streams run record cannot be written, read, or would mix configurations."""


@dataclass(frozen=True, kw_only=True)
class StreamsRun:
    """One worker start.

    Fields:
        app_id: the full faust app id (consumer group).
        run_id: random id of this start.
        config: :func:`config_to_json` of the worker's processor configuration.
        config_id: :func:`config_id` of it.
        capture_start: capture topic -> partition -> first offset this run processes.
        started_at_ms: wall-clock start (diagnostic only).
    """

    app_id: str
    run_id: str
    config: Mapping[str, Any]
    config_id: str
    capture_start: Mapping[str, Mapping[int, int]]
    started_at_ms: int

    def processor_config(self) -> ProcessorConfig:
        return config_from_json(self.config)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": RUN_FORMAT, "app_id": self.app_id, "run_id": self.run_id,
            "config": dict(self.config), "config_id": self.config_id,
            "capture_start": {t: {str(p): o for p, o in sorted(parts.items())}
                              for t, parts in sorted(self.capture_start.items())},
            "started_at_ms": self.started_at_ms,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StreamsRun:
        """Parse a run record; StreamsRunError says what is wrong with it."""
        if not isinstance(data, Mapping) or data.get("format") != RUN_FORMAT:
            raise StreamsRunError(f"not a {RUN_FORMAT} record: {str(data)[:200]}")
        try:
            run = cls(
                app_id=str(data["app_id"]), run_id=str(data["run_id"]),
                config=dict(data["config"]), config_id=str(data["config_id"]),
                capture_start={str(t): {int(p): int(o) for p, o in parts.items()}
                               for t, parts in data["capture_start"].items()},
                started_at_ms=int(data["started_at_ms"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StreamsRunError(f"malformed {RUN_FORMAT} record ({exc!r})") from exc
        if config_id(run.processor_config()) != run.config_id:
            raise StreamsRunError(
                f"streams run {run.run_id} of {run.app_id}: its config does not hash to its "
                "config_id; the record was edited or written by another code version"
            )
        return run


def group_start_offsets(bootstrap: kafka.KafkaTarget, group_id: str, topics: Iterable[str], *,
                        timeout_s: float = 15.0) -> dict[str, dict[int, int]]:
    """Where ``group_id`` resumes each partition of ``topics``: its commit, else 0."""
    config = kafka.client_config(bootstrap)
    consumer = kafka.make_consumer(config, group_id=group_id, log_name=_LOG)
    try:
        tps = []
        for topic in topics:
            parts = kafka.partitions_of(consumer, topic, retry=config.retry, timeout_s=timeout_s)
            if parts is None:
                raise StreamsRunError(f"capture topic {topic} does not exist on "
                                      f"{config.bootstrap_servers}; create the catalogue "
                                      "(`flywheel topics create`)")
            tps += [(topic, p) for p in parts]
        got = kafka.committed(consumer, tps, retry=config.retry, timeout_s=timeout_s,
                              group_id=group_id)
    except (KafkaException, kafka.KafkaIOError) as exc:
        raise StreamsRunError(f"cannot read the committed offsets of {group_id}: {exc}") from exc
    finally:
        consumer.close()
    out: dict[str, dict[int, int]] = {}
    for (topic, partition), offset in got.items():
        out.setdefault(topic, {})[partition] = max(0, offset)
    return out


def group_members(bootstrap: kafka.KafkaTarget, group_id: str, *,
                  timeout_s: float = 15.0) -> int:
    """How many members ``group_id`` has now (0 for an unknown or empty group)."""
    config = kafka.client_config(bootstrap)
    admin = kafka.make_admin(config, log_name=_LOG)

    def describe() -> int:
        future = admin.describe_consumer_groups([group_id], request_timeout=timeout_s)[group_id]
        return len(future.result(timeout=timeout_s).members or [])

    try:
        return config.retry.call(describe, what=f"describing consumer group {group_id}")
    except (KafkaException, kafka.KafkaIOError) as exc:
        raise StreamsRunError(f"cannot describe consumer group {group_id}: {exc}") from exc


def read_runs(bootstrap: str, topic: str, *, app_id: str | None = None) -> list[StreamsRun]:
    """Every run recorded on ``topic`` (of ``app_id`` only, if given), in topic order."""
    runs = []
    try:
        for msg in read_topic(bootstrap, topic):
            try:
                run = StreamsRun.from_json(json.loads(msg.value() or b""))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise StreamsRunError(f"{topic}@{msg.offset()} is not JSON ({exc})") from exc
            if app_id is None or run.app_id == app_id:
                runs.append(run)
    except InspectError as exc:
        raise StreamsRunError(str(exc)) from exc
    return runs


def publish_run(bootstrap: kafka.KafkaTarget, topic: str, run: StreamsRun, *,
                timeout_s: float = 15.0) -> None:
    """Append ``run`` to ``topic`` and wait for the broker's acknowledgement."""
    producer = kafka.CheckedProducer(kafka.client_config(bootstrap), log_name=_LOG)
    try:
        producer.produce(topic, key=run.app_id.encode(),
                         value=json.dumps(run.to_json(), sort_keys=True).encode(),
                         headers=[("content-type", b"application/json")])
        producer.flush(timeout_s, what="the streams run record")
    except kafka.KafkaIOError as exc:
        raise StreamsRunError(f"could not record the streams run on {topic}: {exc}") from exc


def start_run(bootstrap: str, topic: str, *, app_id: str, config: ProcessorConfig,
              capture_topics: Iterable[str]) -> StreamsRun:
    """Record the start of a worker of ``app_id`` running ``config`` (see the module doc)."""
    new_id = config_id(config)
    previous = read_runs(bootstrap, topic, app_id=app_id)
    if previous and previous[-1].config_id != new_id:
        members = group_members(bootstrap, app_id)
        if members:
            raise StreamsRunError(
                f"streams group {app_id} has {members} running member(s) with config "
                f"{previous[-1].config_id[:12]}, this worker's is {new_id[:12]}: workers of "
                "one group run one configuration. Stop the group's workers (a killed one "
                "leaves after the session timeout) and start again, or use another --app-id"
            )
    run = StreamsRun(
        app_id=app_id, run_id=uuid.uuid4().hex, config=config_to_json(config), config_id=new_id,
        capture_start=group_start_offsets(bootstrap, app_id, capture_topics),
        started_at_ms=int(time.time() * 1000),
    )
    publish_run(bootstrap, topic, run)
    log.info("streams run %s of %s: config %s, capture start %s", run.run_id, app_id,
             new_id[:12], run.to_json()["capture_start"])
    return run
