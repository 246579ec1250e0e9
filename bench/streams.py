"""Stream-processor throughput at the 48-layer, top-10 geometry; one JSON line per figure.

Publishes synthetic capture threads (RouteObservation: 48 layers x top-10 of 512) to
uuid-prefixed topics on the broker, then, in the same run:

1. ``raw``: confluent-kafka consume of the transcripts and observations topics + fastavro
   decode of every record (the floor any Python consumer pays);
2. ``processed``: the same consume feeding validate → assemble → split → dedup → window
   (the stage objects the faust worker runs), in one process;
3. ``faust_worker``: a real ``streams worker`` subprocess, from first record produced to
   last window published (includes faust, table changelogs and Kafka round trips).

Rates count observation records (one per decoded token) per wall second; ``cpu_rate``
is the same count per CPU second of this process (less sensitive to other load on the
machine). Observations are ``RouteObservation.v2`` (packed routes). Usage::

    python bench/streams.py [--threads 40] [--assistant-tokens 120] [--no-worker]
    python -m bench.streams ...   # the same
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

# Run by path, sys.path[0] is bench/: the repository root makes tests.support importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from fastavro import schemaless_reader

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.settings import bootstrap_servers
from hebrus_flywheel.schemas.registry import HEADER_SIZE, default_registry
from hebrus_flywheel.streams.acls import grant_catalogue
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.topics import catalogue, create_topics, delete_topics, describe_topics
from tests.support.streams_harness import (
    WorkerProcess,
    produce,
    producer,
    read_windows,
    wait_until,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

FLAGS = {"runtime_holdout_fraction": 0.2}


def emit(figure: str, value: float, unit: str, **extra: Any) -> None:
    print(
        json.dumps(
            {"bench": "streams", "figure": figure, "value": round(value, 3), "unit": unit, **extra}
        ),
        flush=True,
    )


def consume_all(bootstrap: str, topics: list[str], handle: Any) -> tuple[int, float, float]:
    """Read ``topics`` to their end, calling ``handle(msg)``; returns (messages, wall
    seconds, CPU seconds of this process, librdkafka's threads included).

    Each ``consume`` asks for at most the messages still due, so the last call returns as
    soon as they are there instead of waiting out its timeout for a full batch.
    """
    config = kafka.client_config(bootstrap)
    consumer = kafka.make_consumer(config, settings={"fetch.max.bytes": 52_428_800})
    marks = kafka.watermarks(consumer, topics, retry=config.retry, timeout_s=10)
    ends = {tp: high for tp, (_, high) in marks.items()}
    due = sum(high - low for low, high in marks.values())
    pending = {tp for tp, end in ends.items() if end > 0}
    consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in pending])
    check = kafka.MessageCheck(config.retry, "bench read")
    count, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while pending:
        for msg in consumer.consume(max(1, min(500, due - count)), timeout=1.0):
            if check.check(msg) != "data":
                continue
            handle(msg)
            count += 1
            tp = (msg.topic() or "", msg.partition() or 0)
            if (msg.offset() or 0) + 1 >= ends[tp]:
                pending.discard(tp)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    consumer.close()
    return count, elapsed, cpu


def raw_decoder() -> Any:
    registry = default_registry()

    def handle(msg: Any) -> None:
        value = msg.value()
        entry = registry.by_fingerprint(value[2:HEADER_SIZE])
        buf = io.BytesIO(value)
        buf.seek(HEADER_SIZE)
        schemaless_reader(buf, entry.plain, None)

    return handle


def pipeline_feeder(topics: StreamTopics) -> tuple[LocalPipeline, Any]:
    pipeline = LocalPipeline(worker_processor_config(FLAGS), prefix=topics.prefix)
    kinds = {v: k for k, v in topics.capture_kinds().items()}

    def handle(msg: Any) -> None:
        pipeline.feed(
            kinds[msg.topic()], msg.partition(), msg.offset(), msg.key(), msg.value(), msg.headers()
        )

    return pipeline, handle


def make_messages(threads: int, assistant_tokens: int) -> tuple[list[Any], int]:
    identity = make_identity(layers=48, experts=512, top_k=10)
    clock = ProducerClock()
    messages = [identity_message(identity)]
    for spec in random_specs(threads, n_owners=16, seed=7, assistant_tokens=assistant_tokens):
        messages.extend(thread_messages(spec, identity, clock))
    return messages, sum(1 for m in messages if m[0] == "observations")


def bench_worker(
    bootstrap: str, prefix: str, messages: list[Any], n_obs: int, expected: int
) -> None:
    topics = StreamTopics.from_prefix(prefix)
    create_topics(bootstrap, catalogue(prefix))
    grant_catalogue(bootstrap, prefix)  # the streams worker runs as the streams role
    with tempfile.TemporaryDirectory() as tmp:
        worker = WorkerProcess(
            bootstrap=bootstrap,
            prefix=prefix,
            app_id="flywheel-streams",
            log_path=Path(tmp) / "worker.log",
            flags=FLAGS,
        ).start()
        try:
            time.sleep(10)  # join the group and finish (empty) recovery before data arrives
            start = time.perf_counter()
            produce(producer(bootstrap), topics, messages)
            wait_until(
                lambda: _refused(bootstrap, topics)
                or len(read_windows(bootstrap, topics)) >= expected,
                timeout_s=600,
                interval_s=0.5,
                what="the worker's windows",
            )
            elapsed = time.perf_counter() - start
        finally:
            worker.stop()
    emit(
        "faust_worker_observations_per_s",
        n_obs / elapsed,
        "obs/s",
        seconds=round(elapsed, 2),
        note="one worker process, produce->last window, includes changelog writes",
    )


def _refused(bootstrap: str, topics: StreamTopics) -> bool:
    """Stop at the first quarantined record: the worker would never reach the expected
    windows (clean bench data is refused by nothing), so say why instead of waiting."""
    reasons = Counter(
        dict(msg.headers() or []).get("reason", b"?").decode()
        for msg in read_topic(bootstrap, topics.quarantine)
    )
    if reasons:
        raise SystemExit(f"the faust worker quarantined bench records: {dict(reasons)}")
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--threads", type=int, default=40)
    parser.add_argument("--assistant-tokens", type=int, default=120)
    parser.add_argument("--no-worker", action="store_true", help="skip the faust worker figure")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bootstrap = bootstrap_servers(args.bootstrap_servers)
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    messages, n_obs = make_messages(args.threads, args.assistant_tokens)
    topics = StreamTopics.from_prefix(prefix)
    create_topics(bootstrap, catalogue(prefix))
    grant_catalogue(bootstrap, prefix)  # the streams worker runs as the streams role
    try:
        produce(producer(bootstrap), topics, messages)
        names = [topics.transcripts, topics.observations]
        _, raw_s, raw_cpu = consume_all(bootstrap, names, raw_decoder())
        pipeline, feeder = pipeline_feeder(topics)
        consume_all(bootstrap, [topics.identities], feeder)  # the worker loads them at start
        _, proc_s, proc_cpu = consume_all(bootstrap, names, feeder)
        raw_rate, proc_rate = n_obs / raw_s, n_obs / proc_s
        geometry = {"layers": 48, "top_k": 10, "experts": 512, "observations": n_obs}
        emit("raw_consume_decode_observations_per_s", raw_rate, "obs/s",
             cpu_rate=round(n_obs / raw_cpu, 1), **geometry)
        emit(
            "processed_observations_per_s",
            proc_rate,
            "obs/s",
            cpu_rate=round(n_obs / proc_cpu, 1),
            windows=len(pipeline.windows),
            quarantined=len(pipeline.quarantined),
            **geometry,
        )
        if pipeline.quarantined or not pipeline.windows:
            raise SystemExit(f"bench data was refused: {pipeline.counters.stage('quarantine')}")
        emit("processed_to_raw_ratio", proc_rate / raw_rate, "ratio", goal=">= 0.333")
        emit("goal_10k_observations_per_s_met", float(proc_rate >= 10_000), "bool")
        if not args.no_worker:
            bench_worker(bootstrap, f"{prefix}w.", messages, n_obs, len(pipeline.windows))
    finally:
        cleanup(bootstrap, prefix)


def cleanup(bootstrap: str, prefix: str) -> None:
    names = [n for n in describe_topics(bootstrap) if n.startswith(prefix)]
    delete_topics(bootstrap, names)


if __name__ == "__main__":
    main()
