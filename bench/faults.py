"""Capture -> streams -> replay -> seal on a 3-node cluster, without and with kill -9s.

Starts its own local KRaft cluster (``LocalCluster``, 3 nodes, secure like ``flywheel
broker up --nodes 3``) in a fresh ``FLYWHEEL_HOME`` and runs the selftest's pipeline
twice on a tiny teacher, each on its own topic namespace, with the same synthetic
threads (those without a near duplicate: which of a pair survives dedup follows arrival
order, which faults change), split salt and owner keys:

* ``baseline``: no faults;
* ``faults``: half of the threads is captured, and once the stream worker has written
  a window of them it is killed (SIGKILL); the other half is captured and the worker
  restarted on the same data directory; then one broker node is killed
  and restarted while the new worker runs; then the epoch's seal is requested and,
  once the replay worker has written a shard of it, the replay worker is killed and
  restarted on the same dataset while the seal waits.

Then the two sealed snapshots are compared row by row (key: window id and token
ordinal; content: expert ids, weights, margins, features). Figures, one JSON line each:

* ``lost_rows``: baseline rows missing from the faulted snapshot (must be 0);
* ``duplicated_rows``: rows of the faulted snapshot beyond one per key (must be 0);
* ``changed_rows``: rows present in both whose content differs (must be 0);
* ``shards_byte_identical``: whether every shard's plaintext digest is equal, and
  ``row_identical`` with the reason when they are not (the lineage columns name each
  run's own topics and offsets, so shards of two namespaces cannot be byte-identical).

    .venv/bin/python bench/faults.py [--threads 8] [--base-port 19750] [--keep DIR]

Exit status 1 when a figure that must be 0 is not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY = ("window_id", "token_ordinal")
CONTENT = ("expert_ids", "weights_u8", "weights_f16", "margins", "features")
LINEAGE = ("source_topic", "source_partition", "source_offset")


def emit(figure: str, value: Any, **extra: Any) -> None:
    print(json.dumps({"figure": figure, "value": value, **extra}, default=str), flush=True)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench/faults.py: timed out after {timeout_s:.0f} s waiting "
                             f"for {what}")
        time.sleep(0.5)


class Arm:
    """One pipeline run on its own namespace (the selftest's stages up to capture)."""

    def __init__(self, name: str, teacher: Path, bootstrap: str, work: Path,
                 threads: int) -> None:
        from hebrus_flywheel.selftest import SelftestConfig, _Run, private_namespace

        config = SelftestConfig(teacher=teacher, bootstrap=bootstrap, work_dir=work / name,
                                namespace=private_namespace(f"faults-{name}."),
                                threads=threads, stage_timeout_s=1200.0, keep_topics=True)
        config.work_dir.mkdir(parents=True, exist_ok=True)
        self.name, self.run = name, _Run(config=config, emit=lambda line: None)

    @property
    def config(self) -> Any:
        return self.run.config

    def prepare(self) -> None:
        from hebrus_flywheel import selftest
        from hebrus_flywheel.core.kafka.security import acting_as

        for stage in (selftest._stage_topics, selftest._stage_consent):
            with acting_as("admin"):
                stage(self.run)

    def capture(self, part: slice = slice(None)) -> None:
        """Capture ``part`` of the selftest's synthetic threads (forced decode)."""
        from hebrus_flywheel.core.kafka.security import acting_as
        from hebrus_flywheel.replay.capture import CaptureConfig, load_threads
        from hebrus_flywheel.replay.capture_cli import run_capture
        from hebrus_flywheel.salts import distinct_threads

        # only threads without a near duplicate: which of a pair the dedup stage keeps
        # follows arrival order, which a fault may legitimately change (the two arms
        # would then differ by one thread's rows for no loss at all)
        threads = distinct_threads(list(load_threads(None, self.config.threads,
                                                     seed=self.config.seed)),
                                   self.config.teacher)[part]
        with acting_as("runtime"):
            summary = run_capture(
                teacher_dir=self.config.teacher, threads=threads, create_topics=False,
                config=CaptureConfig(mode="forced", seed=self.config.seed, interleave=4),
                bootstrap=self.config.bootstrap, topic_prefix=self.config.namespace,
                execution=self.config.execution)
        if summary["failed"] or summary["dropped"] or sum(summary["rejected"].values()):
            raise SystemExit(f"capture of {self.name} lost records: {summary}")

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "hebrus_flywheel.cli", *args]

    def spawn(self, log_name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.config.work_dir / f"{log_name}.log").open("ab")
        return subprocess.Popen(self.command(*args), stdout=log, stderr=subprocess.STDOUT)

    def streams_args(self) -> list[str]:
        from hebrus_flywheel.selftest import (
            RUNTIME_HOLDOUT_FRACTION,
            VALIDATION_FRACTION,
            split_salt,
        )

        return ["streams", "worker", "--drain", "--bootstrap-servers", self.config.bootstrap,
                "--prefix", self.config.namespace, "--salt", split_salt(self.run),
                "--validation-fraction", str(VALIDATION_FRACTION),
                "--runtime-holdout-fraction", str(RUNTIME_HOLDOUT_FRACTION),
                "--stress-rate", "0.0", "--drain-timeout-s", "1200"]

    def replay_args(self) -> list[str]:
        return ["replay", "worker", "--teacher", str(self.config.teacher), "--dataset",
                str(self.run.dataset), "--bootstrap-servers", self.config.bootstrap,
                "--prefix", self.config.namespace, "--drain"]

    def windows_written(self) -> int:
        from hebrus_flywheel.core.kafka.security import acting_as
        from hebrus_flywheel.streams.processors.inspect import read_topic
        from hebrus_flywheel.streams.topics import SPLITS, window_topic

        with acting_as("admin"):
            return sum(1 for s in SPLITS for _ in read_topic(
                self.config.bootstrap, self.config.namespace + window_topic(s)))

    def shards_written(self) -> int:
        return len(list(self.run.dataset.glob("**/*.parquet")))

    def seal(self) -> dict[str, Any]:
        from hebrus_flywheel.selftest import _json_tail

        out = subprocess.run(self.command(
            "seal", "--epoch", "0", "--dataset", str(self.run.dataset), "--bootstrap-servers",
            self.config.bootstrap, "--json", "--timeout-s", "1200"),
            capture_output=True, text=True, check=False)
        # whole, in the kept work directory: a refusal logs the full parity result
        (self.config.work_dir / "seal.log").write_text(out.stdout + out.stderr,
                                                       encoding="utf-8")
        if out.returncode != 0:
            raise SystemExit(f"seal of {self.name} exited {out.returncode} (its output: "
                             f"{self.config.work_dir / 'seal.log'}): "
                             f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
        summary = _json_tail(out.stdout.splitlines())
        self.run.snapshot = Path(summary["manifest"]).parent
        return summary


def finish(proc: subprocess.Popen[bytes], what: str, timeout_s: float = 1500.0) -> None:
    try:
        status = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"{what} ran past {timeout_s:.0f} s") from None
    if status != 0:
        raise SystemExit(f"{what} exited {status}")


def run_clean(arm: Arm) -> None:
    arm.prepare()
    arm.capture()
    finish(arm.spawn("streams", *arm.streams_args()), "the baseline stream worker")
    replay = arm.spawn("replay", *arm.replay_args())
    wait_for(lambda: (arm.run.dataset / "dataset.json").exists(), 1200, "the dataset")
    arm.seal()
    finish(replay, "the baseline replay worker")


def run_faulted(arm: Arm, cluster: Any, node: int) -> dict[str, Any]:
    """The faulted run; the first half of the threads is captured before the stream
    worker starts, the second only after its kill, so the kill is mid-stream."""
    arm.prepare()
    half = slice(None, arm.config.threads // 2)
    arm.capture(half)
    kills: dict[str, Any] = {}
    worker = arm.spawn("streams", *arm.streams_args())
    wait_for(lambda: arm.windows_written() >= 1 or worker.poll() is not None,
             1200, "the first window")
    kills["stream_worker_killed_at_windows"] = arm.windows_written()
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    arm.capture(slice(half.stop, None))
    worker = arm.spawn("streams", *arm.streams_args())
    pid = cluster.nodes[node].pid()
    if pid is None:
        raise SystemExit(f"broker node {node} is not running")
    os.kill(pid, signal.SIGKILL)
    kills["broker_node_killed"] = node
    time.sleep(10)  # the stream worker runs on two nodes meanwhile
    cluster.start_node(node)
    finish(worker, "the restarted stream worker")
    replay = arm.spawn("replay", *arm.replay_args())
    wait_for(lambda: (arm.run.dataset / "dataset.json").exists(), 1200, "the dataset")
    # the worker writes an epoch's shards once the seal asks for its boundary
    with ThreadPoolExecutor(max_workers=1) as pool:
        sealed = pool.submit(arm.seal)
        wait_for(lambda: arm.shards_written() >= 1 or replay.poll() is not None
                 or sealed.done(), 1200, "the first shard")
        kills["replay_worker_killed_at_shards"] = arm.shards_written()
        replay.send_signal(signal.SIGKILL)
        replay.wait()
        replay = arm.spawn("replay", *arm.replay_args())
        sealed.result()
    finish(replay, "the restarted replay worker")
    return kills


def snapshot_rows(snapshot: Path) -> tuple[list[tuple[Any, ...]], dict[tuple[Any, ...], str],
                                           list[str]]:
    """(keys of every row, content digest per key, plaintext digests of the shards)."""
    import hashlib

    from hebrus_flywheel.core.snapshot.read import open_snapshot

    snap = open_snapshot(snapshot, verify="full")
    keys: list[tuple[Any, ...]] = []
    content: dict[tuple[Any, ...], str] = {}
    for index in range(len(snap.manifest.shards)):
        table = snap.read_shard(index, None)
        names = [c for c in CONTENT if c in table.column_names]
        cols = {c: table.column(c).to_pylist() for c in (*KEY, *names)}
        for i in range(table.num_rows):
            key = tuple(cols[c][i] for c in KEY)
            keys.append(key)
            content[key] = hashlib.sha256(json.dumps(
                [cols[c][i] for c in names], default=str).encode()).hexdigest()
    return keys, content, sorted(s.plaintext_sha256 for s in snap.manifest.shards)


def compare(base: Path, faulted: Path) -> dict[str, Any]:
    base_keys, base_content, base_digests = snapshot_rows(base)
    keys, content, digests = snapshot_rows(faulted)
    counts = Counter(keys)
    lost = sum(1 for k in set(base_keys) if k not in counts)
    duplicated = sum(n - 1 for n in counts.values() if n > 1)
    changed = sum(1 for k, d in content.items() if k in base_content and base_content[k] != d)
    extra = sum(1 for k in counts if k not in base_content)
    return {"lost_rows": lost, "duplicated_rows": duplicated, "changed_rows": changed,
            "extra_rows": extra, "rows": len(base_keys),
            "shards_byte_identical": base_digests == digests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--base-port", type=int, default=19750)
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work directory to keep (default: a temporary one, removed)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="flywheel-faults-"))
    # the cluster is this home's local cluster: its clients take the home's role
    # credentials for the node ports FLYWHEEL_BROKER_PORT + 2i (read at import); a
    # client config, bootstrap, role or key store set for another broker (a test
    # session's, say) must not leak into this run or the commands it starts
    for inherited in ("FLYWHEEL_KAFKA_CONFIG", "FLYWHEEL_BOOTSTRAP_SERVERS", "FLYWHEEL_ROLE",
                      "FLYWHEEL_OWNER_KEYS"):
        os.environ.pop(inherited, None)
    os.environ["FLYWHEEL_HOME"] = str(work / "home")
    os.environ["FLYWHEEL_BROKER_PORT"] = str(args.base_port)
    from hebrus_flywheel.core.settings import BOOTSTRAP_ENV
    from hebrus_flywheel.replay.teacher import init_teacher
    from hebrus_flywheel.streams.broker import BrokerConfig, ClusterConfig, LocalCluster

    cluster = LocalCluster(ClusterConfig(home=work / "home", nodes=3, base_port=args.base_port,
                                         heap_mb=384, libs_dir=BrokerConfig().jars_dir,
                                         start_timeout_s=600.0))
    started = time.perf_counter()
    try:
        cluster.up()
        os.environ[BOOTSTRAP_ENV] = cluster.bootstrap
        teacher = work / "teacher"
        if not (teacher / "config.json").is_file():
            init_teacher(teacher, family=args.family, seed=2)
        base = Arm("baseline", teacher, cluster.bootstrap, work, args.threads)
        run_clean(base)
        total = base.windows_written()
        faulted = Arm("faults", teacher, cluster.bootstrap, work, args.threads)
        kills = run_faulted(faulted, cluster, node=2)
        assert base.run.snapshot is not None and faulted.run.snapshot is not None
        result = compare(base.run.snapshot, faulted.run.snapshot)
    finally:
        cluster.down()
    for name in ("lost_rows", "duplicated_rows", "changed_rows", "extra_rows"):
        emit(name, result[name], rows=result["rows"], **kills)
    emit("shards_byte_identical", result["shards_byte_identical"],
         row_identical=not any(result[n] for n in ("lost_rows", "duplicated_rows",
                                                   "changed_rows", "extra_rows")),
         reason=None if result["shards_byte_identical"] else
         "each run writes its own namespace's topic names and offsets into the lineage "
         "columns (source_topic, source_offset), so shards of two runs differ in bytes")
    emit("faults_bench_seconds", round(time.perf_counter() - started, 1), windows=total)
    bad = any(result[n] for n in ("lost_rows", "duplicated_rows", "changed_rows", "extra_rows"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
