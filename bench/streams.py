"""Stream-processor throughput at the 48-layer, top-10 geometry; one JSON line per figure.

Publishes synthetic capture threads (RouteObservation: 48 layers x top-10 of 512) to
uuid-prefixed topics on the broker, then, in the same run:

1. ``raw``: confluent-kafka consume of the transcripts and observations topics + fastavro
   decode of every record (the floor any Python consumer pays);
2. ``processed``: the same consume feeding validate → assemble → split → dedup → window
   (the stage objects the faust worker runs), in one process;
3. ``faust_worker``: a real ``streams worker`` subprocess, from first record produced to
   last window published (includes faust, table changelogs and Kafka round trips);
4. ``two_worker_speedup``: the same with two worker processes of one app id (each its own
   data directory) against the one worker, and whether both wrote the same set of
   windows (``--no-two-workers`` skips it).

Rates count token-observations (one per decoded token) per wall second, however they
are carried; ``cpu_rate`` is the same count per CPU second of the process that did the
work (this process for raw and processed, the worker subprocess for the worker: less
sensitive to other load on the machine). Capture is published as the runtime publisher
sends it: runs of up to ``--chunk-tokens`` observations of one request as one
``RouteObservationChunk.v1`` (``--chunk-tokens 0``: one ``RouteObservation.v3`` per
token). The figures ``faust_to_raw_ratio`` (wall) and ``faust_to_raw_cpu_ratio`` compare
the worker with the raw floor of the same run. ``--profile FILE`` runs the worker under
cProfile (CPU time) and writes its stats there. The bench and its worker share one fresh
owner key store (``$FLYWHEEL_OWNER_KEYS``, a temporary directory). Usage::

    python bench/streams.py [--threads 40] [--assistant-tokens 120] [--chunk-tokens 64]
                            [--no-worker] [--no-two-workers] [--profile FILE]
    python -m bench.streams ...   # the same
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

# Run by path, sys.path[0] is bench/: the repository root makes tests.support importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# One fresh owner key store for this run, set before anything opens one: the bench seals
# its capture with it and the worker subprocess (its own FLYWHEEL_HOME) opens with it.
# Without it the worker has no key store to open sealed capture ("no owner key store").
os.environ.setdefault("FLYWHEEL_OWNER_KEYS",
                      os.path.join(tempfile.mkdtemp(prefix="flywheel-bench-"), "owner-keys"))

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from fastavro import schemaless_reader

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.processes import exit_on_sigterm
from hebrus_flywheel.core.settings import bootstrap_servers
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.registry import HEADER_SIZE, default_registry
from hebrus_flywheel.streams.acls import grant_catalogue
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline
from hebrus_flywheel.streams.processors.runs import group_members
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.topics import catalogue, create_topics, delete_topics, describe_topics
from tests.support.chunks import chunked
from tests.support.streams_harness import (
    WorkerProcess,
    grant_for,
    producer,
    read_windows,
    wait_until,
    window_pairs,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    encode_message,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

APP_ID = "flywheel-streams"
FLAGS = {"runtime_holdout_fraction": 0.2}
PROFILED_WORKER = """
import cProfile, runpy, sys, time
profile = cProfile.Profile(time.process_time)
sys.argv[0] = "streams"
profile.enable()
try:
    runpy.run_module("hebrus_flywheel.streams.processors.cli", run_name="__main__")
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats({path!r})
"""


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


class Capture:
    """The bench's capture records, encoded once: ``messages`` (kind, key, record) as the
    stream sees them, ``encoded`` (kind, key, value, headers) as they are produced, with
    each run of up to ``chunk_tokens`` observations of one request as one
    ``RouteObservationChunk.v1`` (0: one ``RouteObservation.v3`` per token)."""

    def __init__(self, threads: int, assistant_tokens: int, chunk_tokens: int) -> None:
        identity = make_identity(layers=48, experts=512, top_k=10)
        clock = ProducerClock()
        self.messages = [identity_message(identity)]
        for spec in random_specs(threads, n_owners=16, seed=7,
                                 assistant_tokens=assistant_tokens):
            self.messages.extend(thread_messages(spec, identity, clock))
        self.observations = sum(1 for m in self.messages if m[0] == "observations")
        if chunk_tokens:
            registry = default_registry()
            self.encoded = [
                (kind, key, value,
                 codec.kafka_headers(registry.by_fingerprint(value[2:HEADER_SIZE])))
                for kind, key, value in chunked(self.messages, max_tokens=chunk_tokens)]
        else:
            self.encoded = [(kind, key, *encode_message(kind, record))
                            for kind, key, record in self.messages]
        self.records = len(self.encoded)

    def produce(self, bootstrap: str, topics: StreamTopics) -> None:
        """Consent grants for every owner, then every record in order (acknowledged)."""
        prod = producer(bootstrap)
        grant_for(prod, topics, self.messages)
        names = topics.capture_kinds()
        for kind, key, value, headers in self.encoded:
            while True:
                try:
                    prod.produce(names[kind], key=key, value=value,
                                 headers=list(headers or []))
                    break
                except BufferError:
                    prod.poll(0.1)
        if prod.flush(60):
            raise SystemExit("the bench's capture records were not all acknowledged")


def bench_worker(bootstrap: str, prefix: str, capture: Capture, expected: int,
                 profile: Path | None, workers: int = 1) -> tuple[float, float]:
    """The workers' token-observations per wall second, first record produced to last
    window on the broker (``workers`` processes of one app id, each with its own home);
    ``profile``: run the (first) worker under cProfile, stats to that file."""
    topics = StreamTopics.from_prefix(prefix)
    create_topics(bootstrap, catalogue(prefix))
    grant_catalogue(bootstrap, prefix)  # the streams worker runs as the streams role
    with tempfile.TemporaryDirectory() as tmp:
        procs = [WorkerProcess(bootstrap=bootstrap, prefix=prefix, app_id=APP_ID,
                               log_path=Path(tmp) / f"worker-{i}.log", flags=FLAGS,
                               home=Path(tmp) / f"home-{i}") for i in range(workers)]
        if profile is not None:  # CPU time, not wall time: the machine may be shared
            procs[0].args[1:3] = ["-c", PROFILED_WORKER.format(path=str(profile))]
        for worker in procs:
            worker.start()
        try:
            # join the group and finish (empty) recovery before data arrives
            wait_until(lambda: group_members(bootstrap, prefix + APP_ID) >= workers,
                       timeout_s=120, interval_s=0.5, what="every worker in the group")
            time.sleep(10)
            cpu_start = sum(_cpu_seconds(_pid(w)) for w in procs)
            start = time.perf_counter()
            capture.produce(bootstrap, topics)
            produced_s = time.perf_counter() - start
            wait_until(
                lambda: _refused(bootstrap, topics)
                or _windows_published(bootstrap, topics) >= expected,
                timeout_s=900,
                interval_s=0.5,
                what="the worker's windows",
            )
            elapsed = time.perf_counter() - start
            cpu_s = sum(_cpu_seconds(_pid(w)) for w in procs) - cpu_start
        except BaseException:
            for worker in procs:
                print(worker.log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        finally:
            for worker in procs:
                worker.stop()
    rate = capture.observations / elapsed
    name = "faust_worker_observations_per_s" if workers == 1 else \
        f"faust_{workers}_workers_observations_per_s"
    emit(name, rate, "obs/s", seconds=round(elapsed, 2), workers=workers,
         produce_seconds=round(produced_s, 2), worker_cpu_s=round(cpu_s, 2),
         cpu_rate=round(capture.observations / cpu_s, 1),
         observations=capture.observations, records=capture.records,
         note=f"{workers} worker process(es), produce->last window, includes changelog "
              "writes")
    return rate, capture.observations / cpu_s


def _pid(worker: WorkerProcess) -> int:
    assert worker.proc is not None
    return worker.proc.pid


def _same_windows(bootstrap: str, prefixes: list[str]) -> bool:
    """Whether the namespaces' window topics hold the same set of windows."""
    sets = [window_pairs(read_windows(bootstrap, StreamTopics.from_prefix(p)))
            for p in prefixes]
    return all(s == sets[0] for s in sets[1:]) and bool(sets[0])


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _windows_published(bootstrap: str, topics: StreamTopics) -> int:
    """Window records on the window topics (their watermarks: nothing is read)."""
    config = kafka.client_config(bootstrap)
    consumer = kafka.make_consumer(config)
    try:
        marks = kafka.watermarks(consumer, list(topics.windows.values()), retry=config.retry,
                                 timeout_s=10)
    finally:
        consumer.close()
    return sum(high - low for low, high in marks.values())


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
    exit_on_sigterm()  # the finally blocks stop the workers this started
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--threads", type=int, default=40)
    parser.add_argument("--assistant-tokens", type=int, default=120)
    parser.add_argument("--chunk-tokens", type=int, default=64,
                        help="tokens per RouteObservationChunk (0: one record per token)")
    parser.add_argument("--no-worker", action="store_true", help="skip the faust worker figure")
    parser.add_argument("--no-two-workers", action="store_true",
                        help="skip the two-worker figure (two_worker_speedup)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="run the worker under cProfile and write its stats here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bootstrap = bootstrap_servers(args.bootstrap_servers)
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    capture = Capture(args.threads, args.assistant_tokens, args.chunk_tokens)
    topics = StreamTopics.from_prefix(prefix)
    create_topics(bootstrap, catalogue(prefix))
    grant_catalogue(bootstrap, prefix)  # the streams worker runs as the streams role
    try:
        capture.produce(bootstrap, topics)
        n_obs = capture.observations
        names = [topics.transcripts, topics.observations]
        _, raw_s, raw_cpu = consume_all(bootstrap, names, raw_decoder())
        pipeline, feeder = pipeline_feeder(topics)
        consume_all(bootstrap, [topics.identities], feeder)  # the worker loads them at start
        _, proc_s, proc_cpu = consume_all(bootstrap, names, feeder)
        raw_rate, proc_rate = n_obs / raw_s, n_obs / proc_s
        geometry = {"layers": 48, "top_k": 10, "experts": 512, "observations": n_obs,
                    "records": capture.records, "chunk_tokens": args.chunk_tokens}
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
            rate, cpu_rate = bench_worker(bootstrap, f"{prefix}w.", capture,
                                          len(pipeline.windows), args.profile)
            emit("faust_to_raw_ratio", rate / raw_rate, "ratio", goal=">= 0.5")
            emit("faust_to_raw_cpu_ratio", cpu_rate / (n_obs / raw_cpu), "ratio",
                 note="per CPU second of each process (the machine may be shared)")
            emit("goal_30k_worker_observations_per_s_met", float(rate >= 30_000), "bool")
        if not args.no_worker and not args.no_two_workers:
            rate2, _ = bench_worker(bootstrap, f"{prefix}w2.", capture,
                                    len(pipeline.windows), None, workers=2)
            same = _same_windows(bootstrap, [f"{prefix}w.", f"{prefix}w2."])
            emit("two_worker_speedup", rate2 / rate, "ratio", goal=">= 1.5",
                 same_windows=same, cpu_count=os.cpu_count(),
                 note="two workers of one app id against one, same records, one run")
            if not same:
                raise SystemExit("two workers wrote another set of windows than one worker")
    finally:
        cleanup(bootstrap, prefix)


def cleanup(bootstrap: str, prefix: str) -> None:
    names = [n for n in describe_topics(bootstrap) if n.startswith(prefix)]
    delete_topics(bootstrap, names)


if __name__ == "__main__":
    main()
