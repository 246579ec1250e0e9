"""Soak: does one streams worker's memory stay flat while fresh owners keep coming?

Publishes ``--observations`` token-observations (RouteObservation records, one per
decoded token, plus each thread's turns) from ``--owners`` fresh owners, one thread per
owner, through the real :class:`~streams.publisher.RuntimePublisher` (pseudonymize,
seal, idempotent producer) to uuid-prefixed topics, while one real ``streams worker``
subprocess (faust, RocksDB tables) consumes them. Every ``--sample-s`` seconds it reads
the worker's resident set size (``/proc/<pid>/status`` VmRSS) and the token-observations
the worker has applied (its counters: the publisher sends chunks, so one record carries
many), and prints one JSON line per sample. Once the worker has caught up (or after
``--max-seconds``) it prints the least-squares slope of RSS over applied observations,
for the samples after warm-up, in MiB per million observations::

    {"figure": "rss_growth_mib_per_million_obs", "value": ..., "goal": "<= 5", ...}

Warm-up ends at the later of ``--warmup-fraction`` of the observations and the first
sample at which the worker's bounded caches are full (RocksDB's shared block cache,
memtables charged to it, at 95 % of ``PROCESS_ROCKSDB_BYTES``): until then the resident
set grows towards a bound set in the configuration, by design. The slope after a fixed
``--warmup-fraction`` alone is printed beside it (``fixed_warmup_mib_per_million_obs``).

The default soak is 4,000,000 observations from 40,000 owners (about 5 minutes on a
2-core machine). The issue asks for at least 2 million, but the worker's caches now fill
only after 1.1 to 1.9 million observations, which left a 2 million run 3 to 8 samples to
fit a slope to (measured: -227.7, -38.8 and 21.6 on three runs of the same code whose
4 million run gave -2.58); a figure from fewer than :data:`MIN_SAMPLES` samples after
warm-up is refused ("run longer"). The size that ran is printed with the figure. Usage::

    python bench/soak.py [--observations 4000000] [--owners 40000] [--sample-s 10]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Run by path, sys.path[0] is bench/: the repository root makes tests.support importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.privacy.keystore import OWNER_KEYS_ENV
from hebrus_flywheel.core.processes import exit_on_sigterm
from hebrus_flywheel.core.settings import bootstrap_servers
from hebrus_flywheel.streams.acls import grant_catalogue
from hebrus_flywheel.streams.processors.dedup import DedupConfig
from hebrus_flywheel.streams.processors.state_store import PROCESS_ROCKSDB_BYTES
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.topics import catalogue, create_topics, delete_topics, describe_topics
from tests.support.consent import grant_owners
from tests.support.streams_harness import WorkerProcess, last_logged
from tests.support.streams_synthetic import (
    ProducerClock,
    ThreadSpec,
    make_identity,
    thread_messages,
)

APP_ID = "flywheel-streams"
FLAGS = {"runtime_holdout_fraction": 0.1, "idle_timeout_s": 30.0}
MIB = 1024 * 1024
MIN_SAMPLES = 10
"""Samples after warm-up below which no slope is printed (its noise would be the figure)."""


def emit(figure: str, value: float, **extra: Any) -> None:
    print(json.dumps({"bench": "soak", "figure": figure, "value": round(value, 3), **extra}),
          flush=True)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def specs(owners: int, tokens_per_thread: int, run: str, step_ms: int = 1_000
          ) -> Iterator[ThreadSpec]:
    """One short thread per fresh owner: a user turn, an assistant turn of the tokens."""
    for i in range(owners):
        yield ThreadSpec(owner=f"soak-{run}-{i:06d}", thread=f"t-{i:06d}",
                         turns=(("user", 6), ("assistant", tokens_per_thread)), seed=i,
                         start_ms=1_767_225_600_000 + step_ms * i)


def event_step_ms(args: argparse.Namespace) -> int:
    """Event time between two owners' threads. The dedup index remembers kept threads for
    its declared horizon (``DedupConfig.horizon_ms``, 7 days of event time), so state is
    bounded by the threads of one horizon: by default the threads are spread so that
    the horizon is crossed by the ``--horizon-at`` fraction of the owners planned, and
    the samples after warm-up see the steady state (each new thread expires an old one);
    ``--event-step-s`` sets the spacing instead (1 s: all threads in one horizon)."""
    if args.event_step_s is not None:
        return int(args.event_step_s * 1000)
    return max(1_000, int(DedupConfig().horizon_ms / max(1.0, args.horizon_at * args.owners)))


def publish(bootstrap: str, topics: StreamTopics, identity: dict[str, Any],
            threads: Iterator[ThreadSpec], done: threading.Event) -> None:
    publisher = RuntimePublisher(PublisherConfig(
        bootstrap_servers=bootstrap, identities_topic=topics.identities,
        transcripts_topic=topics.transcripts, observations_topic=topics.observations,
        consent_topic=topics.consent,
        max_block_ms=120_000.0))  # a bench pushing flat out waits for room, never drops
    try:
        assert publisher.publish_identity(identity)
        clock = ProducerClock(producer_id="soak-runtime")
        for spec in threads:
            for kind, _, record in thread_messages(spec, identity, clock, raw_ids=True):
                send = publisher.publish_turn if kind == "transcripts" \
                    else publisher.publish_observation
                if not send(record):
                    raise SystemExit(f"the publisher refused a {kind} record")
        publisher.flush()
    finally:
        publisher.close()
        done.set()


def committed_observations(probe: kafka.LagProbe, topic: str) -> tuple[int, int]:
    """(committed, end) over the observations topic's partitions."""
    ends, committed = probe.read()
    mine = [tp for tp in ends if tp[0] == topic]
    return (sum(max(0, committed.get(tp, 0) - ends[tp][0]) for tp in mine),
            sum(ends[tp][1] - ends[tp][0] for tp in mine))


def worker_observations(log_path: Path) -> int:
    """Token-observations the worker applied so far (``assemble/applied_observations`` of
    its last counters line): a chunk record carries many, so offsets do not count them."""
    counts = last_logged(log_path, "streams counters ")
    return int(counts.get("assemble/applied_observations", 0))


def memory_mib(log_path: Path) -> dict[str, float]:
    """The worker's last memory gauges (state_store.memory_gauges), bytes in MiB."""
    return {name.replace("_bytes", "_mib"): round(value / MIB, 1) if name.endswith("_bytes")
            else value for name, value in last_logged(log_path, "streams memory ").items()}


def slope_mib_per_million(samples: list[tuple[int, int]]) -> float:
    obs = np.array([s[0] for s in samples], dtype=float)
    rss = np.array([s[1] for s in samples], dtype=float) / MIB
    slope = np.polyfit(obs, rss, 1)[0]
    return float(slope * 1_000_000)


def soak(args: argparse.Namespace, bootstrap: str, prefix: str, home: Path) -> None:
    topics = StreamTopics.from_prefix(prefix)
    create_topics(bootstrap, catalogue(prefix))
    grant_catalogue(bootstrap, prefix)  # the streams worker runs as the streams role
    run = uuid.uuid4().hex[:6]
    tokens = max(4, args.observations // args.owners)
    total = tokens * args.owners
    grant_owners(bootstrap, [s.owner for s in specs(args.owners, tokens, run)], prefix=prefix)
    step_ms = event_step_ms(args)
    identity = make_identity(layers=8, experts=64, top_k=4)
    worker = WorkerProcess(bootstrap=bootstrap, prefix=prefix, app_id=APP_ID,
                           log_path=home / "worker.log", flags=FLAGS, home=home,
                           extra=["--dedup-bands"] if args.dedup_bands else []).start()
    assert worker.proc is not None
    done = threading.Event()
    publisher = threading.Thread(
        target=publish,
        args=(bootstrap, topics, identity, specs(args.owners, tokens, run, step_ms), done),
        daemon=True)
    probe = kafka.LagProbe(kafka.client_config(bootstrap), prefix + APP_ID, [topics.observations])
    samples: list[tuple[int, int]] = []
    cache_mib: list[float] = []  # the worker's RocksDB cache gauge at each sample
    started = time.monotonic()
    try:
        time.sleep(10)  # join the group and restore (empty) state before data arrives
        publisher.start()
        while True:
            time.sleep(args.sample_s)
            if not worker.alive():
                raise SystemExit("the worker stopped: see " + str(worker.log_path))
            processed, end = committed_observations(probe, topics.observations)
            rss, applied = rss_bytes(worker.proc.pid), worker_observations(worker.log_path)
            samples.append((applied, rss))
            gauges = memory_mib(worker.log_path)
            cache_mib.append(float(gauges.get("rocksdb_cache_mib", 0.0)))
            emit("rss_sample_mib", rss / MIB, t_s=round(time.monotonic() - started, 1),
                 observations_applied=applied, records_committed=processed,
                 records_published=end, **gauges)
            # every record published is committed and every observation applied (end
            # and processed count records: a chunk carries many observations)
            if done.is_set() and processed >= end and applied >= total:
                break
            if args.max_seconds and time.monotonic() - started > args.max_seconds:
                print(f"soak: --max-seconds {args.max_seconds:g} reached with {applied} of "
                      f"{total} observations applied; the figure covers those",
                      file=sys.stderr, flush=True)
                break
        if not args.max_seconds:
            emit_held_drain(worker.log_path, timeout_s=args.held_drain_s)
    except BaseException:
        print(worker.log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        probe.close()
        worker.stop()
    pushed = samples[-1][0] if samples else 0
    fixed = [s for s in samples if s[0] >= args.warmup_fraction * pushed]
    full_at = caches_full_at(samples, cache_mib)
    warm = [s for s in fixed if full_at is not None and s[0] >= full_at]
    if len(warm) < MIN_SAMPLES:
        raise SystemExit(f"only {len(warm)} samples after warm-up (caches full at "
                         f"{full_at} observations), {MIN_SAMPLES} needed for a slope: run "
                         "longer (--observations)")
    late = [s for s in samples if s[0] >= 0.5 * pushed]
    emit("rss_growth_mib_per_million_obs", slope_mib_per_million(warm), goal="<= 5",
         warmup_ends_at_observations=warm[0][0], caches_full_at_observations=full_at,
         fixed_warmup_mib_per_million_obs=round(slope_mib_per_million(fixed), 3),
         # the same slope over the second half: whether growth after the warm-up is a
         # fill that ends (RocksDB's cache, the C heap's free lists) or keeps going
         second_half_mib_per_million_obs=round(slope_mib_per_million(late), 3)
         if len(late) >= 3 else None,
         observations=pushed, observations_planned=total, owners_planned=args.owners,
         tokens_per_thread=tokens, event_step_ms=step_ms,
         samples_after_warmup=len(warm), warmup_fraction=args.warmup_fraction,
         dedup="bands" if args.dedup_bands else "one-partition",
         rss_first_mib=round(warm[0][1] / MIB, 1), rss_last_mib=round(warm[-1][1] / MIB, 1),
         seconds=round(time.monotonic() - started, 1))


def emit_held_drain(log_path: Path, *, timeout_s: float) -> None:
    """Once every record is committed, the generations the dedup still holds for their
    turn must be decided as the caught-up partitions' marks pass them: wait for the
    worker's ``dedup_held`` gauge to reach 0 (printed, not part of the RSS figure)."""
    started = time.monotonic()
    held = memory_mib(log_path).get("dedup_held", 0)
    while held and time.monotonic() - started < timeout_s:
        time.sleep(1.0)  # the worker logs its gauges every stats interval (1 s)
        held = memory_mib(log_path).get("dedup_held", 0)
    emit("dedup_held_after_drain", held, waited_s=round(time.monotonic() - started, 1),
         timeout_s=timeout_s, note="generations still held for their dedup turn after "
         "every record was committed (0: all decided)")


def caches_full_at(samples: list[tuple[int, int]], cache_mib: list[float]) -> int | None:
    """Observations applied at the first sample whose RocksDB cache gauge reached 95 % of
    the process bound (None: never, or the worker logged no gauge)."""
    bound = 0.95 * PROCESS_ROCKSDB_BYTES / MIB
    return next((s[0] for s, mib in zip(samples, cache_mib, strict=True) if mib >= bound),
                None)


def main() -> None:
    exit_on_sigterm()  # the finally blocks stop the workers this started
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--observations", type=int, default=4_000_000)
    parser.add_argument("--owners", type=int, default=40_000)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--horizon-at", type=float, default=0.05,
                        help="fraction of --owners after which event time has crossed the "
                             "dedup horizon (see event_step_ms)")
    parser.add_argument("--event-step-s", type=float, default=None,
                        help="event time between two owners' threads (overrides --horizon-at)")
    parser.add_argument("--dedup-bands", action="store_true",
                        help="the worker runs the band-partitioned dedup")
    parser.add_argument("--held-drain-s", type=float, default=180.0,
                        help="after every record is committed, wait this long at most for "
                             "the dedup to decide what it still holds")
    parser.add_argument("--max-seconds", type=float, default=0.0,
                        help="stop sampling after this long (0: when all is committed); the "
                             "figure then covers the observations committed so far")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    bootstrap = bootstrap_servers(args.bootstrap_servers)
    prefix = f"soak-{uuid.uuid4().hex[:8]}."
    try:
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            # one owner key store for the publisher and the worker (fresh: soak owners
            # never reach the operator's store)
            os.environ[OWNER_KEYS_ENV] = str(Path(tmp) / "owner-keys")
            soak(args, bootstrap, prefix, Path(tmp))
    finally:
        delete_topics(bootstrap, [n for n in describe_topics(bootstrap) if n.startswith(prefix)])


if __name__ == "__main__":
    main()
