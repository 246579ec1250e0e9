"""Stream-processor throughput at the 48-layer, top-10 geometry; one JSON line per figure.

Publishes synthetic capture threads (RouteObservation: 48 layers x top-10 of 512) to
uuid-prefixed topics on the broker, then, in the same run:

1. ``raw``: confluent-kafka consume of the transcripts and observations topics + fastavro
   decode of every record (the floor any Python consumer pays);
2. ``processed``: the same consume feeding validate → assemble → split → dedup → window
   (the stage objects the faust worker runs), in one process;
3. ``faust_worker``: a real ``streams worker`` subprocess draining a backlog: every record
   is produced before it starts, and the clock runs from the first capture record it
   handled (its log line) to the last window on the broker (faust, table changelogs and
   Kafka round trips included; start-up, printed as ``startup_seconds``, is not; with two
   workers ``last_worker_began_s`` after the first, and the rebalance, are included);
   ``faust_worker_live``: the same worker joined first, from the first record produced
   to the last window, the bench's producer sharing the machine meanwhile;
4. ``two_worker_speedup``: two worker processes of one app id (each its own data
   directory) against the one worker, both on a backlog (``two_worker_live_speedup``:
   both live), and whether all four runs wrote the same set of windows as each other and
   as the in-process pipeline (``--no-two-workers`` skips them).

``--exact-copies N`` makes N threads exact copies of the thread before them (their
tokens and routes, their own owner and thread ids): dedup keeps one member of each pair
by the order the two complete in, so ``same_windows`` then tests that order dependence
(the synthetic threads hold no duplicates otherwise). The window count is then not
known in advance: a run ends when the workers' counters (logged every second) show every
thread decided and every window sent on the broker.

Rates count token-observations (one per decoded token) per wall second, however they
are carried; ``cpu_rate`` is the same count per CPU second of the process that did the
work (this process for raw and processed, the worker subprocess for the worker: less
sensitive to other load on the machine). Capture is published as the runtime publisher
sends it: runs of up to ``--chunk-tokens`` observations of one request as one
``RouteObservationChunk.v1`` (``--chunk-tokens 0``: one ``RouteObservation.v3`` per
token). The figures ``faust_to_raw_ratio`` (wall) and ``faust_to_raw_cpu_ratio`` compare
the worker on its backlog with the raw floor of the same run, which reads a backlog too.
``--profile FILE`` runs the backlog worker under cProfile (CPU time), stats to FILE.
``--event-loop asyncio`` runs the workers and the floor on the standard library's loop
instead of uvloop (the worker's default), for an A/B of the loop.
``broker_cpu_s``: the CPU seconds of the brokers this ``$FLYWHEEL_HOME`` started, over the
same window (the broker shares the machine). The bench and its worker share one fresh
owner key store (``$FLYWHEEL_OWNER_KEYS``, a temporary directory). Usage::

    python bench/streams.py [--threads 40] [--assistant-tokens 120] [--chunk-tokens 64]
                            [--no-worker] [--no-two-workers] [--profile FILE]
                            [--event-loop uvloop|asyncio] [--exact-copies N]
    python -m bench.streams ...   # the same
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

# Run by path, sys.path[0] is bench/: the repository root makes tests.support importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# One fresh owner key store for this run, set before anything opens one: the bench seals
# its capture with it and the worker subprocess (its own FLYWHEEL_HOME) opens with it.
# Without it the worker has no key store to open sealed capture ("no owner key store").
os.environ.setdefault("FLYWHEEL_OWNER_KEYS",
                      os.path.join(tempfile.mkdtemp(prefix="flywheel-bench-"), "owner-keys"))

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from confluent_kafka.admin import OffsetSpec
from fastavro import schemaless_reader

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.processes import exit_on_sigterm
from hebrus_flywheel.core.settings import bootstrap_servers, flywheel_home
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.registry import HEADER_SIZE, default_registry
from hebrus_flywheel.streams.acls import grant_catalogue
from hebrus_flywheel.streams.broker import (
    BrokerConfig,
    EmbeddedBroker,
    LocalCluster,
    read_layout,
)
from hebrus_flywheel.streams.processors.event_loop import DEFAULT_EVENT_LOOP, EVENT_LOOPS
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline
from hebrus_flywheel.streams.processors.runs import group_members
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.topics import (
    admin_client,
    catalogue,
    create_topics,
    delete_topics,
    describe_topics,
)
from tests.support.chunks import chunked
from tests.support.process_cpu import THREAD_KINDS, CpuSampler, thread_cpu, total_cpu
from tests.support.streams_harness import (
    WorkerProcess,
    grant_for,
    last_logged,
    producer,
    read_windows,
    streams_role_env,
    wait_until,
    window_pairs,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    ThreadSpec,
    encode_message,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

APP_ID = "flywheel-streams"
FLAGS = {"runtime_holdout_fraction": 0.2}
FIRST_CAPTURE = re.compile(r"first capture record \S+ handled at unix time ([0-9.]+)")
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


def pipeline_feeder(topics: StreamTopics, partitions: int,
                    flags: dict[str, Any] | None = None) -> tuple[LocalPipeline, Any]:
    """The in-process chain, deciding in event-time order as the worker does (over the
    capture topics' ``partitions``), and its consume handler."""
    pipeline = LocalPipeline(worker_processor_config(flags or FLAGS), prefix=topics.prefix,
                             event_order=partitions)
    kinds = {v: k for k, v in topics.capture_kinds().items()}

    def handle(msg: Any) -> None:
        pipeline.feed(
            kinds[msg.topic()], msg.partition(), msg.offset(), msg.key(), msg.value(), msg.headers()
        )

    return pipeline, handle


def with_exact_copies(specs: list[ThreadSpec], copies: int) -> list[ThreadSpec]:
    """``specs`` with ``copies`` of them, spread evenly, made exact copies of the thread
    before them (its tokens and routes, under their own owner and thread ids): pairs the
    dedup stage decides by the order the two threads complete in."""
    if copies < 0 or 2 * copies > len(specs):
        raise SystemExit(f"--exact-copies must be between 0 and half of --threads, got {copies}")
    out = list(specs)
    step = len(specs) // copies if copies else 0
    for n in range(copies):
        j = n * step + 1
        source = out[j - 1]
        out[j] = ThreadSpec(**{**source.__dict__, "owner": out[j].owner,
                               "thread": out[j].thread, "start_ms": out[j].start_ms})
    return out


class Capture:
    """The bench's capture records, encoded once: ``messages`` (kind, key, record) as the
    stream sees them, ``encoded`` (kind, key, value, headers) as they are produced, with
    each run of up to ``chunk_tokens`` observations of one request as one
    ``RouteObservationChunk.v1`` (0: one ``RouteObservation.v3`` per token)."""

    def __init__(self, threads: int, assistant_tokens: int, chunk_tokens: int,
                 exact_copies: int = 0) -> None:
        identity = make_identity(layers=48, experts=512, top_k=10)
        clock = ProducerClock()
        self.messages = [identity_message(identity)]
        for spec in with_exact_copies(random_specs(threads, n_owners=16, seed=7,
                                                   assistant_tokens=assistant_tokens),
                                      exact_copies):
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
        self.threads = threads
        self.exact_copies = exact_copies

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


class Timing(NamedTuple):
    """What one :class:`WorkerRun` measured (``extra``: mode-specific fields to print)."""

    observations: int
    elapsed: float
    cpu_s: float
    broker_cpu_s: float
    extra: dict[str, float]

    @property
    def rate(self) -> float:
        return self.observations / self.elapsed

    @property
    def cpu_rate(self) -> float:
        return self.observations / self.cpu_s


class WorkerRun:
    """One timed run of ``workers`` worker processes of one app id (each its own home)
    over the bench's capture, in ``prefix``'s namespace.

    ``backlog``: every capture record is produced and acknowledged before any worker
    starts, and the clock runs from the first capture record a worker handled (its
    ``first capture record`` log line) to the last window on the broker: the worker's
    drain rate, measured as the raw floor is (a backlog read to its end). Otherwise
    (``live``) the workers join first and the clock runs from the first record produced,
    so the figure also holds the bench's own producer, which shares the machine.
    """

    def __init__(self, bootstrap: str, prefix: str, capture: Capture, expected: int, *,
                 workers: int, backlog: bool, profile: Path | None = None,
                 event_loop: str = DEFAULT_EVENT_LOOP, dedup_bands: bool = False,
                 standby_replicas: int = 1, flags: dict[str, Any] | None = None) -> None:
        self.bootstrap, self.capture, self.expected = bootstrap, capture, expected
        self.flags = flags or FLAGS
        self.event_loop, self.dedup_bands = event_loop, dedup_bands
        self.standby_replicas = standby_replicas
        self.topics = StreamTopics.from_prefix(prefix)
        self.prefix, self.workers, self.backlog, self.profile = prefix, workers, backlog, profile

    def run(self) -> Timing:
        """Run, print the figure, return what was measured."""
        create_topics(self.bootstrap, catalogue(self.prefix))
        grant_catalogue(self.bootstrap, self.prefix)  # the worker runs as the streams role
        if self.backlog:
            self.capture.produce(self.bootstrap, self.topics)
        with tempfile.TemporaryDirectory() as tmp:
            procs = [WorkerProcess(bootstrap=self.bootstrap, prefix=self.prefix,
                                   app_id=APP_ID, log_path=Path(tmp) / f"worker-{i}.log",
                                   flags=self.flags, home=Path(tmp) / f"home-{i}",
                                   extra=["--event-loop", self.event_loop,
                                          "--standby-replicas", str(self.standby_replicas),
                                          *(["--dedup-bands"] if self.dedup_bands else [])])
                     for i in range(self.workers)]
            if self.profile is not None:  # CPU time, not wall: the machine may be shared
                procs[0].args[1:3] = ["-c", PROFILED_WORKER.format(path=str(self.profile))]
            for worker in procs:
                worker.start()
            try:
                timing = self._drain(procs) if self.backlog else self._live(procs)
                timing.extra.update(agent_cpu([w.log_path for w in procs]))
            except BaseException:
                for worker in procs:
                    print(worker.log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
                raise
            finally:
                for worker in procs:
                    worker.stop()
        self._emit(timing)
        return timing

    def _live(self, procs: list[WorkerProcess]) -> Timing:
        # join the group and finish (empty) recovery before data arrives
        wait_until(lambda: group_members(self.bootstrap, self.prefix + APP_ID) >= len(procs),
                   timeout_s=120, interval_s=0.5, what="every worker in the group")
        time.sleep(10)
        pids, brokers = [_pid(w) for w in procs], _broker_pids()
        cpu_start, broker_start = total_cpu(pids), total_cpu(brokers)
        start = time.perf_counter()
        self.capture.produce(self.bootstrap, self.topics)
        produced_s = time.perf_counter() - start
        self._wait_for_windows(interval_s=0.5, procs=procs)
        elapsed = time.perf_counter() - start
        cpu_s, broker_s = total_cpu(pids) - cpu_start, total_cpu(brokers) - broker_start
        return Timing(self.capture.observations, elapsed, cpu_s, broker_s,
                      {"produce_seconds": round(produced_s, 2)})

    def _drain(self, procs: list[WorkerProcess]) -> Timing:
        started = time.time()
        pids, brokers = [_pid(w) for w in procs], _broker_pids()
        # the process totals, and their threads by kind (tests/support/process_cpu.py)
        threads = CpuSampler(lambda: {"total": total_cpu(pids), **thread_cpu(pids)})
        broker = CpuSampler(lambda: total_cpu(brokers))
        for sampler in (threads, broker):
            sampler.start()
        try:
            self._wait_for_windows(interval_s=0.1, procs=procs)
            end = time.time()
        finally:
            for sampler in (threads, broker):
                sampler.stop()
        first = [t for w in procs if (t := _first_capture_s(w.log_path)) is not None]
        if not first:
            raise SystemExit("no worker logged its first capture record (log level?)")
        t0 = min(first)
        by_kind = {kind: threads.at(end)[kind] - threads.at(t0)[kind]
                   for kind in ("total", *THREAD_KINDS)}
        return Timing(self.capture.observations, end - t0, by_kind.pop("total"),
                      broker.at(end) - broker.at(t0),
                      {"startup_seconds": round(t0 - started, 2),
                       "last_worker_began_s": round(max(first) - t0, 2),
                       **{f"worker_{kind}_cpu_s": round(cpu, 2)
                          for kind, cpu in by_kind.items()}})

    def _wait_for_windows(self, interval_s: float, procs: list[WorkerProcess]) -> None:
        with WindowWatch(self.bootstrap, self.topics) as watch:
            if not self.capture.exact_copies:
                wait_until(lambda: watch.published() >= self.expected, timeout_s=900,
                           interval_s=interval_s, what="the worker's windows")
                return
            # which member of a copied pair is kept decides the window count. Decided in
            # event-time order, the workers write the in-process pipeline's count; one
            # that decided some pair otherwise ends when every thread is decided and
            # every window the counters say was sent is on the broker (the workers log
            # their counters every second: that end is known to about 1 s)
            wait_until(lambda: watch.published() >= self.expected
                       or self._all_decided(procs, watch), timeout_s=900,
                       interval_s=interval_s, what="every thread decided and windowed")

    def _all_decided(self, procs: list[WorkerProcess], watch: WindowWatch) -> bool:
        counts: Counter[str] = Counter()
        for worker in procs:
            counts.update(last_counters(worker.log_path))
        return (summed(counts, "split/") >= self.capture.threads
                and summed(counts, "window/threads_") >= counts["dedup/unique"]
                and watch.published() >= summed(counts, "window/windows_"))

    def _emit(self, t: Timing) -> None:
        base = "faust_worker" if self.workers == 1 else f"faust_{self.workers}_workers"
        name = f"{base}_observations_per_s" if self.backlog else \
            f"{base}_live_observations_per_s"
        emit(name, t.rate, "obs/s", mode="backlog" if self.backlog else "live",
             seconds=round(t.elapsed, 2), workers=self.workers, **t.extra,
             broker_cpu_s=round(t.broker_cpu_s, 2), worker_cpu_s=round(t.cpu_s, 2),
             cpu_rate=round(t.cpu_rate, 1), observations=t.observations,
             records=self.capture.records, event_loop=self.event_loop,
             dedup="bands" if self.dedup_bands else "one-partition",
             standby_replicas=self.standby_replicas, exact_copies=self.capture.exact_copies,
             runtime_holdout_fraction=self.flags["runtime_holdout_fraction"],
             note=f"{self.workers} worker process(es), " + (
                 "first capture record handled -> last window, records produced before "
                 "the workers started" if self.backlog else
                 "first record produced -> last window, the bench producing meanwhile"))


AGENTS = ("capture", "dedup", "bands", "window")


def agent_cpu(log_paths: list[Path]) -> dict[str, float]:
    """Each agent's CPU seconds (``cpu/<agent>_us``) and the threads decided (``split/*``)
    of the workers' last counters lines, summed over workers, read once the counters
    logged after the drain are in (the workers log them every second)."""
    time.sleep(1.5)
    totals: dict[str, float] = {f"{agent}_agent_cpu_s": 0.0 for agent in AGENTS}
    totals["threads_decided"] = totals["late_summaries"] = totals["summaries_waited"] = 0
    for path in log_paths:
        counts = last_counters(path)
        for agent in AGENTS:
            totals[f"{agent}_agent_cpu_s"] += counts.get(f"cpu/{agent}_us", 0) / 1e6
        totals["threads_decided"] += summed(counts, "split/")
        # decided out of event-time order / held for their turn (decision_order)
        totals["late_summaries"] += counts.get("dedup/late_summaries", 0)
        totals["summaries_waited"] += counts.get("dedup/summaries_waited", 0)
    return {k: round(v, 3) for k, v in totals.items()}


def last_counters(log_path: Path) -> dict[str, int]:
    """The last ``streams counters`` line a worker logged ({} before its first)."""
    return last_logged(log_path, "streams counters ")


def summed(counts: dict[str, int], prefix: str) -> int:
    """The sum of the counters named ``prefix…`` (``split/``: the threads decided)."""
    return sum(v for k, v in counts.items() if k.startswith(prefix))


def emit_dedup_share(one: Timing) -> None:
    """How much of one worker the dedup agent takes, the one stage that does not spread
    over workers (its table has one partition), and what that alone would allow two."""
    dedup_s = one.extra.get("dedup_agent_cpu_s", 0.0)
    if not dedup_s or not one.cpu_s:
        print("no dedup agent CPU in the worker's counters: dedup share not measured",
              file=sys.stderr)
        return
    share = dedup_s / one.cpu_s
    emit("dedup_agent_cpu_share", share, "ratio", dedup_agent_cpu_s=dedup_s,
         worker_cpu_s=round(one.cpu_s, 2), note="the dedup agent's CPU (its handlers and "
         "table flushes) over the one worker's whole CPU in the timed drain")
    emit("dedup_agent_threads_per_cpu_s", one.extra["threads_decided"] / dedup_s,
         "threads/s", note="thread decisions per CPU second of the dedup agent: the rate "
         "at which that one partition would hold up every worker")
    emit("dedup_bound_two_worker_speedup", 1 / (share + (1 - share) / 2), "ratio",
         note="Amdahl's bound on two workers if the dedup agent were the only work that "
         "does not spread (two free cores, no broker on them)")


def _broker_pids() -> list[int]:
    """The running brokers of this ``$FLYWHEEL_HOME`` (``flywheel broker up``, one node or
    the recorded cluster): their CPU is printed as ``broker_cpu_s``; none for a broker
    elsewhere."""
    home = flywheel_home()
    layout = read_layout(home)
    nodes = LocalCluster(layout).nodes.values() if layout is not None \
        else [EmbeddedBroker(BrokerConfig(home=home))]
    return [pid for node in nodes if (pid := node.pid()) is not None]


def _first_capture_s(log_path: Path) -> float | None:
    """The unix time of a worker's ``first capture record`` log line, if it wrote one."""
    match = FIRST_CAPTURE.search(log_path.read_text(errors="replace"))
    return float(match.group(1)) if match else None


def _pid(worker: WorkerProcess) -> int:
    assert worker.proc is not None
    return worker.proc.pid


def _same_windows(bootstrap: str, prefixes: list[str], expected: Any = None) -> bool:
    """Whether the namespaces' window topics hold the same set of windows (and the same
    as ``expected``, the in-process pipeline's, when given); prints which differ."""
    sets = [window_pairs(read_windows(bootstrap, StreamTopics.from_prefix(p)))
            for p in prefixes]
    named = dict(zip(prefixes, sets, strict=True))
    if expected is not None:
        named["in-process"] = expected
    first = next(iter(named.values()))
    differ = {name: len(s ^ first) for name, s in named.items() if s != first}
    if differ:
        print(f"window sets differ from {next(iter(named))}: {differ} windows not shared",
              file=sys.stderr)
    return not differ and bool(first)


class WindowWatch:
    """How many windows the worker has published, read from the window topics' high
    watermarks while it drains (polled every 0.1 s). The low watermarks and partitions
    are read once; each poll is then one ListOffsets request (the admin client's, all
    partitions at once). Per-partition watermark queries sent two requests per window and
    quarantine partition per poll, over a thousand a second: a tenth of the broker's CPU
    samples during a drain went to answering them (async-profiler, 2026-12-06), on the
    cores the worker being timed runs on. The first quarantined record stops the wait
    (clean bench data is refused by nothing, so the expected windows would never come)."""

    def __init__(self, bootstrap: str, topics: StreamTopics) -> None:
        self.bootstrap, self.topics = bootstrap, topics
        self.config = kafka.client_config(bootstrap)
        consumer = kafka.make_consumer(self.config)
        try:
            self.low = kafka.watermarks(consumer, [*topics.windows.values(), topics.quarantine],
                                        retry=self.config.retry, timeout_s=10)
        finally:
            consumer.close()
        self.admin = admin_client(bootstrap)
        self.latest = {TopicPartition(t, p): OffsetSpec.latest() for t, p in self.low}

    def __enter__(self) -> WindowWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def published(self) -> int:
        high = self.config.retry.call(self._high, what="the window topics' high watermarks")
        if any(high[tp] > low for tp, (low, _) in self.low.items()
               if tp[0] == self.topics.quarantine):
            self._refuse()
        return sum(high[tp] - low for tp, (low, _) in self.low.items()
                   if tp[0] != self.topics.quarantine)

    def _high(self) -> dict[tuple[str, int], int]:
        futures = self.admin.list_offsets(self.latest, request_timeout=10)
        return {(tp.topic, tp.partition): fut.result().offset for tp, fut in futures.items()}

    def _refuse(self) -> None:
        reasons = Counter(
            dict(msg.headers() or []).get("reason", b"?").decode()
            for msg in read_topic(self.bootstrap, self.topics.quarantine)
        )
        raise SystemExit(f"the faust worker quarantined bench records: {dict(reasons)}")


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
    parser.add_argument("--event-loop", default=DEFAULT_EVENT_LOOP, choices=EVENT_LOOPS,
                        help="the workers' (and the faust floor's) event loop")
    parser.add_argument("--dedup-bands", action="store_true",
                        help="workers run the band-partitioned dedup (streams worker "
                        "--dedup-bands)")
    parser.add_argument("--standby-replicas", type=int, default=1,
                        help="the workers' standby replicas (streams worker "
                        "--standby-replicas; 1 is the worker's default)")
    parser.add_argument("--runtime-holdout-fraction", type=float,
                        default=FLAGS["runtime_holdout_fraction"],
                        help="share of threads held out with their captured routes (the "
                        "worker keeps these route payloads in its state until the window; "
                        "the worker's default is 0.05)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="run the worker under cProfile and write its stats here")
    parser.add_argument("--exact-copies", type=int, default=0,
                        help="make this many threads exact copies of the thread before "
                        "them (dedup decides each pair by completion order)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bootstrap = bootstrap_servers(args.bootstrap_servers)
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    capture = Capture(args.threads, args.assistant_tokens, args.chunk_tokens,
                      args.exact_copies)
    topics = StreamTopics.from_prefix(prefix)
    create_topics(bootstrap, catalogue(prefix))
    grant_catalogue(bootstrap, prefix)  # the streams worker runs as the streams role
    try:
        capture.produce(bootstrap, topics)
        n_obs = capture.observations
        names = [topics.transcripts, topics.observations]
        _, raw_s, raw_cpu = consume_all(bootstrap, names, raw_decoder())
        partitions = describe_topics(bootstrap, [topics.transcripts])[
            topics.transcripts].partitions
        pipeline, feeder = pipeline_feeder(topics, partitions, flags_of(args))
        consume_all(bootstrap, [topics.identities], feeder)  # the worker loads them at start
        _, proc_s, proc_cpu = consume_all(bootstrap, names, feeder)
        flushed, flushed_cpu = time.perf_counter(), time.process_time()
        pipeline.flush()  # every partition caught up: what still waits is decided
        proc_s += time.perf_counter() - flushed
        proc_cpu += time.process_time() - flushed_cpu
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
            bench_workers(bootstrap, prefix, capture, len(pipeline.windows), args,
                          raw_rate=raw_rate, raw_cpu_rate=n_obs / raw_cpu,
                          pipeline_windows=window_pairs(pipeline.windows))
    finally:
        cleanup(bootstrap, prefix)


def flags_of(args: argparse.Namespace) -> dict[str, Any]:
    """The worker flags this run uses (``FLAGS`` with the command line's holdout share)."""
    return {**FLAGS, "runtime_holdout_fraction": args.runtime_holdout_fraction}


def bench_workers(bootstrap: str, prefix: str, capture: Capture, expected: int,
                  args: argparse.Namespace, *, raw_rate: float, raw_cpu_rate: float,
                  pipeline_windows: Any) -> None:
    """The worker figures: one worker on a backlog and live, then two workers of one app
    id the same two ways (unless ``--no-two-workers``), and the ratios between them."""
    loop = args.event_loop
    kinds = {"event_loop": loop, "dedup_bands": args.dedup_bands,
             "standby_replicas": args.standby_replicas, "flags": flags_of(args)}
    one = WorkerRun(bootstrap, f"{prefix}w.", capture, expected, workers=1, backlog=True,
                    profile=args.profile, **kinds).run()
    live = WorkerRun(bootstrap, f"{prefix}l.", capture, expected, workers=1, backlog=False,
                     **kinds).run()
    emit("faust_to_raw_ratio", one.rate / raw_rate, "ratio", goal=">= 0.5",
         note="both read a backlog of the same records in this run")
    emit("faust_to_raw_cpu_ratio", one.cpu_rate / raw_cpu_rate, "ratio",
         note="per CPU second of each process (the machine may be shared)")
    emit("faust_live_to_raw_ratio", live.rate / raw_rate, "ratio",
         note="the worker while the bench produces (shares the machine with the producer)")
    emit("goal_30k_worker_observations_per_s_met", float(one.rate >= 30_000), "bool")
    emit_dedup_share(one)
    floor = faust_floor(bootstrap, f"{prefix}w.", capture, loop)
    emit("faust_passthrough_observations_per_s", floor.rate, "obs/s", seconds=round(
         floor.elapsed, 2), cpu_s=round(floor.cpu_s, 2), cpu_rate=round(floor.cpu_rate, 1),
         note="a faust agent that only counts the same backlog (bench/faust_floor.py): "
         "what any faust worker's consumer reaches here")
    emit("faust_passthrough_to_raw_ratio", floor.rate / raw_rate, "ratio")
    emit("faust_worker_to_passthrough_ratio", one.rate / floor.rate, "ratio")
    aio = faust_floor(bootstrap, f"{prefix}w.", capture, loop, through="aiokafka")
    emit("faust_aiokafka_passthrough_observations_per_s", aio.rate, "obs/s",
         seconds=round(aio.elapsed, 2), cpu_s=round(aio.cpu_s, 2),
         cpu_rate=round(aio.cpu_rate, 1), note="the same faust agent reading the capture "
         "topics through aiokafka, as workers did before 2026-12-06")
    emit("capture_librdkafka_to_aiokafka_passthrough_ratio", floor.rate / aio.rate, "ratio")
    if args.no_two_workers:
        return
    two = WorkerRun(bootstrap, f"{prefix}w2.", capture, expected, workers=2, backlog=True,
                    **kinds).run()
    live2 = WorkerRun(bootstrap, f"{prefix}l2.", capture, expected, workers=2, backlog=False,
                      **kinds).run()
    same = _same_windows(bootstrap, [f"{prefix}{n}." for n in ("w", "l", "w2", "l2")],
                         expected=pipeline_windows)
    cores = os.cpu_count() or 1
    emit("two_worker_speedup", two.rate / one.rate, "ratio", goal=">= 1.5", same_windows=same,
         cpu_count=cores, note="two workers of one app id against one, each draining a "
         "backlog of the same records, one run")
    emit("two_worker_speedup_cpu_bound", one.elapsed / (two.cpu_s + two.broker_cpu_s) * cores,
         "ratio", cpu_count=cores, note="the speedup if the CPU seconds the two workers and "
         "the broker took were spread evenly over this machine's cores: what two_worker_"
         "speedup cannot pass here")
    emit("two_worker_speedup_ideal_bound", one.elapsed / (one.cpu_s + one.broker_cpu_s) * cores,
         "ratio", cpu_count=cores, note="the most two workers could give here with no "
         "overhead at all: this machine's cores over the cores the one-worker drain "
         "already kept busy (its worker and the broker)")
    emit("two_worker_live_speedup", live2.rate / live.rate, "ratio", same_windows=same,
         note="the same while the bench produces")
    if not same:
        raise SystemExit("two workers wrote another set of windows than one worker")


def faust_floor(bootstrap: str, prefix: str, capture: Capture, event_loop: str, *,
                through: str = "librdkafka") -> Timing:
    """``bench/faust_floor.py`` on ``prefix``'s capture backlog, as the worker's role,
    reading the capture topics ``through`` librdkafka (as the worker) or aiokafka."""
    records = sum(1 for kind, *_ in capture.encoded if kind != "identities")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("faust_floor.py")),
             "--bootstrap-servers", bootstrap, "--prefix", prefix, "--app-id", APP_ID,
             "--records", str(records), "--event-loop", event_loop,
             "--capture-through", through],
            env=streams_role_env(bootstrap, Path(tmp)), capture_output=True, text=True,
            timeout=600, check=False)
    # faust's terminal spinner writes control codes before the line: keep from its "{"
    lines = [line[line.index("{"):] for line in done.stdout.splitlines() if "{" in line]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"bench/faust_floor.py failed ({done.returncode}): "
                         f"{done.stderr[-2000:]}")
    report = json.loads(lines[-1])
    return Timing(capture.observations, report["seconds"], report["cpu_s"], 0.0, {})


def cleanup(bootstrap: str, prefix: str) -> None:
    names = [n for n in describe_topics(bootstrap) if n.startswith(prefix)]
    delete_topics(bootstrap, names)


if __name__ == "__main__":
    main()
