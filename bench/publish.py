"""Capture-plane benchmark: publisher throughput, wire size, reference-runtime capture rate.

Figures (one JSON line each, never asserted anywhere):

* ``publish_observations_per_s`` — RouteObservation records/s through the real
  :class:`RuntimePublisher` (validate + pseudonymize + seal + encode + idempotent
  produce) until every record is acknowledged by the broker, at the full 48-layer,
  top-10-of-512 geometry.
* ``wire_bytes_per_token`` — key + value + header bytes per observation (one decoded
  token, ``RouteObservation.v3``: uint16 ids + float32 weights, sealed), before Kafka
  batch compression; next to the design note's 3,840 bytes per token of uncompressed
  top-10 labels.
* ``capture_tokens_per_s`` — the reference runtime's KV-cache decode with route capture
  and publishing, for the default teacher and the 48-layer preset, on this CPU.

Needs the broker (``make broker-up``). Usage: ``python bench/publish.py [--records N]``
(or ``python -m bench.publish``).
"""

from __future__ import annotations

import argparse
import json
import os
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

from hebrus_flywheel.core.identity import with_identity_id
from hebrus_flywheel.core.settings import bootstrap_servers
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.routes import pack_routes
from hebrus_flywheel.streams.topics import TopicSpec, create_topics, delete_topics
from tests.support.consent import grant_owners, ledger_allowing

LAYERS, TOP_K, EXPERTS = 48, 10, 512
DESIGN_NOTE_BYTES_PER_TOKEN = 3840  # 10 × (4 B id + 4 B weight) × 48 layers


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


def bench_publisher(bootstrap: str, records: int) -> None:
    identity = _identity()
    topic = f"bench.publish.{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, [TopicSpec(name=topic, partitions=4, doc="bench")])
    observations = _observations(records, identity["identity_id"])
    config = PublisherConfig(bootstrap_servers=bootstrap, observations_topic=topic,
                             identities_topic=topic, queue_capacity=records + 10,
                             full_policy="block_then_raise", max_block_ms=10_000)
    # the consent check runs on every record (from memory: this measures its cost, not a
    # ledger read)
    owners = {obs["owner"] for obs in observations}
    try:
        with RuntimePublisher(config, identity=identity,
                              consent=ledger_allowing(owners)) as publisher:
            start = time.perf_counter()
            for obs in observations:
                publisher.publish_observation(obs)
            publisher.flush(120)
            elapsed = time.perf_counter() - start
            stats = publisher.stats()
    finally:
        delete_topics(bootstrap, [topic])
    emit("publish_observations_per_s", round(stats.delivered / elapsed), "records/s",
         records=records, delivered=stats.delivered, failed=stats.failed,
         layers=LAYERS, top_k=TOP_K, experts=EXPERTS)
    per_token = stats.bytes_on_wire.get(topic, 0) / max(stats.delivered, 1)
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
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--threads", type=int, default=3, help="synthetic threads per preset")
    parser.add_argument("--presets", nargs="*", default=["tiny-qwen3-next", "tiny-qwen3-next-48l"])
    parser.add_argument("--bootstrap-servers", default=None)
    args = parser.parse_args()
    bootstrap = bootstrap_servers(args.bootstrap_servers)
    bench_publisher(bootstrap, args.records)
    for preset in args.presets:
        bench_capture(bootstrap, preset, args.threads)


if __name__ == "__main__":
    main()
