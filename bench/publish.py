"""Capture-plane benchmark: the publisher side by side with Kafka's own ProducerPerformance.

Figures (one JSON line each, never asserted anywhere):

* ``publisher_records_per_s`` / ``kafka_producer_perf_records_per_s`` — records/s of the
  real :class:`RuntimePublisher` (validate + consent + pseudonymize + chunk + seal +
  encode + idempotent produce, until every record is acknowledged) and of Kafka's
  ``org.apache.kafka.tools.ProducerPerformance`` (kafka-tools of the broker's release,
  pinned in ``streams/kafka/jars.sha256``) on the same broker, in the same run: same
  record count, same value sizes (the payload file holds one line per publisher record:
  that record's value bytes, base64-encoded and cut to the value's length, since the
  tool reads its payload file as UTF-8 text split on newlines), the same producer
  settings (acks=all, idempotence, lz4, ``linger.ms``, ``batch.size``), over SASL_SSL as
  the ``runtime`` role (SCRAM credentials and CA of the embedded broker).
* ``publisher_to_kafka_perf_ratio`` — the two records/s figures divided (counted in
  records; every record has the same value size on both sides, so the bytes ratio is
  the same but for the publisher's keys and headers, which the tool does not send).
* ``token_observations_per_s`` — decoded tokens (RouteObservations) per second through
  the publisher in that run (a chunk carries ``--chunk-tokens`` of them).
* ``wire_bytes_per_token`` — key + value + header bytes per token before compression.
* ``capture_tokens_per_s`` — the reference runtime's KV-cache decode with route capture
  and publishing, for the default teacher and the 48-layer preset, on this CPU.

Needs the broker (``make broker-up``) and Java. Usage: ``python bench/publish.py
[--tokens N] [--chunk-tokens N] [--profile FILE]`` (or ``python -m bench.publish``).
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

# Run by path, sys.path[0] is bench/: the repository root makes tests.support importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from hebrus_flywheel.core.files import atomic_write_bytes, atomic_write_text
from hebrus_flywheel.core.identity import with_identity_id
from hebrus_flywheel.core.kafka.security import acting_as, insecure_plaintext
from hebrus_flywheel.core.settings import bootstrap_servers
from hebrus_flywheel.streams.acls import grant_catalogue
from hebrus_flywheel.streams.broker import LOG4J2_PATH, BrokerConfig, find_java
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.routes import pack_routes
from hebrus_flywheel.streams.security import SecurityFiles
from hebrus_flywheel.streams.topics import (
    OBSERVATIONS_TOPIC,
    catalogue,
    create_topics,
    delete_topics,
)
from tests.support.consent import grant_owners, ledger_allowing

LAYERS, TOP_K, EXPERTS = 48, 10, 512
DESIGN_NOTE_BYTES_PER_TOKEN = 3840  # 10 × (4 B id + 4 B weight) × 48 layers
LINGER_MS, BATCH_BYTES = 5, 1_000_000
PERF_TOOL = "org.apache.kafka.tools.ProducerPerformance"


def emit(figure: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"bench": "publish", "figure": figure, "value": value, "unit": unit,
                      **extra}), flush=True)


def _identity() -> dict[str, Any]:
    return with_identity_id({
        "model_family": "qwen3_next", "model_artifact_digest": "0" * 64,
        "tokenizer_digest": "1" * 64, "chat_template_digest": "2" * 64, "dtype": "bfloat16",
        "quantization": "none", "routed_layer_count": LAYERS, "expert_count": EXPERTS,
        "top_k": TOP_K, "tie_break_rule": "score_desc_then_expert_id_asc",
        "weight_rule": "softmax_topk_renormalized", "hidden_size": 2048,
        "routed_intermediate_size": 640, "runtime_name": "bench", "runtime_version": "0",
    })


def _observations(count: int, identity_id: str, threads: int = 16) -> list[dict[str, Any]]:
    """RouteObservation.v2 records as a runtime builds them: routes packed from arrays."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        ids = (rng.integers(0, EXPERTS, LAYERS)[:, None] + 37 * np.arange(TOP_K)) % EXPERTS
        raw = np.sort(rng.random((LAYERS, TOP_K)), axis=1)[:, ::-1]
        weights = (raw / raw.sum(axis=1, keepdims=True)).astype(np.float32)
        thread = i % threads
        out.append({"owner": f"owner-{thread % 4:04d}", "thread": f"thread-{thread:04d}",
                    "generation": 0, "sequence_id": f"seq-{thread}", "turn_index": 1,
                    "token_ordinal": i // threads, "token_id": int(rng.integers(4096)),
                    "identity_id": identity_id, "speculative": None,
                    **pack_routes(ids.astype(np.uint16), weights)})
    return out


class _Recording:
    """Wraps the publisher's ``_send`` to keep each record's value bytes (for the tool's
    payload file) without changing what is produced."""

    def __init__(self, publisher: RuntimePublisher) -> None:
        self.values: list[int] = []
        self.sample: list[bytes] = []
        send = publisher._send

        def recording(item: Any) -> None:
            self.values.append(len(item.value))
            if len(self.sample) < 64:
                self.sample.append(item.value)
            send(item)

        publisher._send = recording  # type: ignore[method-assign]


def _runs(count: int, identity_id: str, run_tokens: int, threads: int = 16) -> list[Any]:
    """``(base, first_ordinal, token_ids, ids_TLK, weights_TLK)``: decoded runs of
    ``run_tokens`` tokens, threads interleaved, as a runtime's decode loop hands them over."""
    rng = np.random.default_rng(0)
    out, ordinals = [], [0] * threads
    for i in range(-(-count // run_tokens)):
        thread, n = i % threads, min(run_tokens, count - i * run_tokens)
        ids = (rng.integers(0, EXPERTS, (n, LAYERS))[..., None] + 37 * np.arange(TOP_K)) % EXPERTS
        raw = np.sort(rng.random((n, LAYERS, TOP_K)), axis=2)[..., ::-1]
        weights = (raw / raw.sum(axis=2, keepdims=True)).astype(np.float32)
        base = {"owner": f"owner-{thread % 4:04d}", "thread": f"thread-{thread:04d}",
                "generation": 0, "sequence_id": f"seq-{thread}", "turn_index": 1,
                "identity_id": identity_id}
        out.append((base, ordinals[thread], rng.integers(4096, size=n),
                    ids.astype(np.uint16), weights))
        ordinals[thread] += n
    return out


def _publish_all(publisher: RuntimePublisher, work: list[Any], api: str) -> None:
    if api == "token":
        for obs in work:
            publisher.publish_observation(obs)
        return
    for base, first, tokens, ids, weights in work:
        publisher.publish_run(base, first_ordinal=first, token_ids=tokens, expert_ids_TLK=ids,
                              weights_TLK=weights)


def run_publisher(bootstrap: str, topic: str, tokens: int, args: argparse.Namespace
                  ) -> dict[str, Any]:
    identity = _identity()
    config = PublisherConfig(
        bootstrap_servers=bootstrap, observations_topic=topic, identities_topic=topic,
        queue_capacity=tokens + 10, full_policy="block_then_raise",
        max_block_ms=10_000, linger_ms=LINGER_MS, chunk_max_tokens=args.chunk_tokens,
        chunk_max_ms=60_000, producer_overrides={"batch.size": BATCH_BYTES})
    warm = _observations(1, identity["identity_id"])
    work = (_observations(tokens, identity["identity_id"]) if args.api == "token"
            else _runs(tokens, identity["identity_id"], args.run_tokens))
    owners = {f"owner-{i:04d}" for i in range(4)}
    profiler = cProfile.Profile() if args.profile is not None else None
    with acting_as("runtime"), RuntimePublisher(config, identity=identity,
                                                consent=ledger_allowing(owners)) as publisher:
        publisher.publish_observation({**warm[0], "thread": "warm-up"})
        assert publisher.flush(60) == 0  # connected, producer id acquired
        recording = _Recording(publisher)
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        _publish_all(publisher, work, args.api)
        outstanding = publisher.flush(120)
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(args.profile))
        stats = publisher.stats()
    return {"elapsed": elapsed, "records": stats.delivered - 1, "tokens": tokens,
            "failed": stats.failed, "outstanding": outstanding,
            "bytes": stats.bytes_on_wire.get(topic, 0), "value_sizes": recording.values,
            "samples": recording.sample}


def _payload_file(path: Path, sizes: list[int], samples: list[bytes]) -> None:
    """One line per record: a publisher value's bytes, base64, cut to that record's size."""
    lines = []
    for i, size in enumerate(sizes):
        text = base64.b64encode(samples[i % len(samples)] * 2).decode("ascii")
        lines.append(text[:size])
    atomic_write_bytes(path, "\n".join(lines).encode("ascii"))


def _java_client_properties(path: Path, home: Path) -> None:
    """The runtime role's SASL_SSL client properties for Kafka's Java tools (0640); none
    for an ``--insecure-plaintext`` home (bench/transport.py's plaintext leg)."""
    if insecure_plaintext(home):
        atomic_write_text(path, "security.protocol=PLAINTEXT\n")
        return
    files = SecurityFiles.of(home)
    jaas = ("org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="runtime" password="{files.password("runtime")}";')
    atomic_write_text(path, "".join(f"{k}={v}\n" for k, v in {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.jaas.config": jaas, "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(files.ca_cert)}.items()))


def run_kafka_perf(bootstrap: str, topic: str, sizes: list[int], samples: list[bytes],
                   workdir: Path) -> dict[str, Any]:
    broker = BrokerConfig()
    # the publisher is timed connected and warm: the tool gets warm-up records too (its
    # JVM, TLS handshake and producer id are not measured), then the same N records
    warmup = max(32, len(sizes) // 4)
    payload, props = workdir / "payload.txt", workdir / "runtime-java.properties"
    _payload_file(payload, sizes, samples)
    _java_client_properties(props, broker.home)
    cmd = [find_java(), f"-Dlog4j2.configurationFile={LOG4J2_PATH}",
           f"-Dkafka.logs.dir={workdir}", "-cp", f"{broker.jars_dir}{os.sep}*", PERF_TOOL,
           "--topic", topic, "--num-records", str(len(sizes) + warmup), "--throughput", "-1",
           "--warmup-records", str(warmup),
           "--payload-file", str(payload), "--command-config", str(props),
           "--producer-props", f"bootstrap.servers={bootstrap}", "acks=all",
           "enable.idempotence=true", "compression.type=lz4", f"linger.ms={LINGER_MS}",
           f"batch.size={BATCH_BYTES}", f"max.request.size={16 * 1024 * 1024}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    summary = [line for line in done.stdout.splitlines() if "steady state" in line
               and "records sent" in line]
    if done.returncode != 0 or not summary:
        raise SystemExit(f"ProducerPerformance failed ({done.returncode}):\n{done.stdout[-2000:]}"
                         f"\n{done.stderr[-2000:]}")
    match = re.search(r"(\d+) steady state records sent, ([\d.]+) records/sec "
                      r"\(([\d.]+) MB/sec\)",
                      summary[-1])
    if match is None:
        raise SystemExit(f"cannot read ProducerPerformance's summary: {summary[-1]}")
    return {"records": int(match[1]), "records_per_s": float(match[2]),
            "mb_per_s": float(match[3]), "summary": summary[-1].strip(), "warmup": warmup}


def bench_side_by_side(bootstrap: str, tokens: int, args: argparse.Namespace) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    specs = [s for s in catalogue(prefix) if s.name.endswith(OBSERVATIONS_TOPIC)]
    topic = specs[0].name
    create_topics(bootstrap, specs)
    grant_catalogue(bootstrap, prefix)  # the runtime role writes the capture topics
    try:
        pub = run_publisher(bootstrap, topic, tokens, args)
        with tempfile.TemporaryDirectory() as tmp:
            perf = run_kafka_perf(bootstrap, topic, pub["value_sizes"], pub["samples"],
                                  Path(tmp))
    finally:
        delete_topics(bootstrap, [topic])
    pub_rate = pub["records"] / pub["elapsed"]
    mean_value = sum(pub["value_sizes"]) / max(len(pub["value_sizes"]), 1)
    common = {"records": pub["records"], "mean_value_bytes": round(mean_value),
              "chunk_tokens": args.chunk_tokens, "api": args.api, "acks": "all",
              "idempotence": True,
              "compression": "lz4", "linger_ms": LINGER_MS, "batch_bytes": BATCH_BYTES,
              "security": "SASL_SSL runtime role"}
    emit("publisher_records_per_s", round(pub_rate, 1), "records/s", failed=pub["failed"],
         outstanding=pub["outstanding"], **common)
    emit("kafka_producer_perf_records_per_s", perf["records_per_s"], "records/s",
         mb_per_s=perf["mb_per_s"], tool=PERF_TOOL, summary=perf["summary"],
         warmup_records=perf["warmup"], **common)
    emit("publisher_to_kafka_perf_ratio", round(pub_rate / perf["records_per_s"], 3), "ratio",
         counted_in="records (same count and value sizes on both sides)", goal=">= 0.9")
    emit("token_observations_per_s", round(pub["tokens"] / pub["elapsed"]), "tokens/s",
         tokens=pub["tokens"], layers=LAYERS, top_k=TOP_K, experts=EXPERTS)
    per_token = pub["bytes"] / max(pub["tokens"], 1)
    emit("wire_bytes_per_token", round(per_token, 1), "bytes/token",
         design_note_label_bytes_per_token=DESIGN_NOTE_BYTES_PER_TOKEN,
         ratio_to_design_note=round(per_token / DESIGN_NOTE_BYTES_PER_TOKEN, 3),
         note="key+value+headers before Kafka batch compression (lz4 on the wire)")


def bench_capture(bootstrap: str, preset: str, threads: int) -> None:
    import torch

    from hebrus_flywheel.replay.capture import CaptureConfig
    from hebrus_flywheel.replay.capture_cli import run_capture
    from hebrus_flywheel.replay.synthetic import generate_threads
    from hebrus_flywheel.replay.teacher import init_teacher
    from hebrus_flywheel.streams.topics import catalogue

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    with tempfile.TemporaryDirectory() as tmp:
        teacher_dir = Path(tmp) / preset
        init_teacher(teacher_dir, preset=preset, seed=0)
        source = list(generate_threads(threads, seed=3))
        try:
            create_topics(bootstrap, [s for s in catalogue(prefix) if "consent" in s.name])
            grant_owners(bootstrap, {t.owner for t in source}, prefix=prefix)
            summary = run_capture(
                teacher_dir=teacher_dir, threads=source,
                config=CaptureConfig(mode="forced", interleave=2), bootstrap=bootstrap,
                topic_prefix=prefix,
            )
        finally:
            delete_topics(bootstrap, [s.name for s in catalogue(prefix)])
    wall_rate = summary["decoded_tokens"] / summary["wall_seconds"]
    emit("capture_tokens_per_s", round(wall_rate, 1), "tokens/s", preset=preset,
         decode_step_tokens_per_s=summary["decode_tokens_per_s"],
         decoded_tokens=summary["decoded_tokens"], threads=summary["threads"],
         note="wall rate includes render, prefill of each prompt, route capture, publish")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40_000)
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--api", choices=("run", "token"), default="run",
                        help="publish_run per decoded run (the reference runtime's path) or "
                        "publish_observation per token")
    parser.add_argument("--run-tokens", type=int, default=32,
                        help="tokens per decoded run handed to publish_run")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write the publisher's cProfile stats here")
    parser.add_argument("--skip-capture", action="store_true")
    parser.add_argument("--threads", type=int, default=3, help="synthetic threads per preset")
    parser.add_argument("--presets", nargs="*", default=["tiny-qwen3-next", "tiny-qwen3-next-48l"])
    parser.add_argument("--bootstrap-servers", default=None)
    args = parser.parse_args()
    bootstrap = bootstrap_servers(args.bootstrap_servers)
    bench_side_by_side(bootstrap, args.tokens, args)
    for preset in [] if args.skip_capture else args.presets:
        bench_capture(bootstrap, preset, args.threads)


if __name__ == "__main__":
    main()
