"""Runtime publisher against the real broker: keys, headers, order, delivery counters."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Message

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.identity import with_identity_id
from hebrus_flywheel.core.privacy import is_pseudonym
from hebrus_flywheel.schemas.codec import decode_message, kafka_headers
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.routes import pack_routes, route_arrays
from hebrus_flywheel.streams.sealing import CaptureOpener
from tests.support.sealing import session_keys

pytestmark = pytest.mark.integration

LAYERS, EXPERTS, K = 6, 32, 4
THREADS = [("alice", "t-1"), ("alice", "t-2"), ("bob", "t-1")]
TOKENS = 40

IDENTITY = with_identity_id({
    "model_family": "qwen3_next", "model_artifact_digest": "a" * 64,
    "tokenizer_digest": "b" * 64, "chat_template_digest": "c" * 64, "dtype": "float32",
    "quantization": "none", "routed_layer_count": LAYERS, "expert_count": EXPERTS, "top_k": K,
    "tie_break_rule": "score_desc_then_expert_id_asc",
    "weight_rule": "softmax_topk_renormalized", "hidden_size": 64,
    "routed_intermediate_size": 32, "runtime_name": "hebrus", "runtime_version": "0.1",
    "routed_layers": list(range(LAYERS)), "layer_count": LAYERS,
})


def turn(owner: str, thread: str, index: int) -> dict[str, Any]:
    return {
        "owner": owner, "thread": thread, "turn_index": index, "generation": 0,
        "sequence_id": f"{thread}-r{index}", "role": "user" if index == 0 else "assistant",
        "token_offset": index * 4, "token_ids": [1, 2, 3, 4],
        "segments": [{"kind": "content", "start": 0, "end": 4, "generated": index > 0}],
        "sampling": {"mode": "forced", "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                     "seed": 0, "max_new_tokens": 4},
        "identity_id": IDENTITY["identity_id"], "domain_tags": ["test"],
        "closes_thread": index == 1,
    }


def observation(owner: str, thread: str, ordinal: int) -> dict[str, Any]:
    """Packed routes (what a runtime publishes), except bob's: v1 per-layer lists, which
    the publisher packs into the same v2 record."""
    ids = (ordinal + np.arange(LAYERS)[:, None] + np.arange(K)[None, :]) % EXPERTS
    weights = np.tile(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32), (LAYERS, 1))
    record: dict[str, Any] = {
        "owner": owner, "thread": thread, "generation": 0, "sequence_id": f"{thread}-r1",
        "turn_index": 1, "token_ordinal": ordinal, "token_id": ordinal % 100,
        "identity_id": IDENTITY["identity_id"], "speculative": None,
    }
    if owner == "bob":
        record["layers"] = [{"stage": 0, "layer": layer, "expert_ids": ids[layer].tolist(),
                             "weights": weights[layer].tolist()} for layer in range(LAYERS)]
    else:
        record.update(pack_routes(ids.astype(np.uint16), weights))
    return record


def consume(bootstrap: str, topics: list[str], expected: int, timeout_s: float = 60.0
            ) -> list[Message]:
    consumer = kafka.make_consumer(kafka.client_config(bootstrap),
                                   group_id=f"flywheel-reader-{uuid.uuid4().hex}",
                                   settings={"auto.offset.reset": "earliest"})
    consumer.subscribe(topics)
    messages: list[Message] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(messages) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            messages.append(msg)
    finally:
        consumer.close()
    return messages


@pytest.mark.parametrize("chunk_max_tokens", [1, 16])
def test_publish_and_consume_back(kafka_bootstrap: str, topic_factory: Any,
                                  chunk_max_tokens: int) -> None:
    """One ``RouteObservation.v3`` per token, or chunks of up to 16 tokens per thread
    (40 tokens: 16 + 16 + 8); every token arrives once, in order."""
    topics = {name: topic_factory(name, partitions=3)
              for name in ("identities", "transcripts", "observations")}
    consent_topic = topic_factory.grant_consent({owner for owner, _ in THREADS})
    config = PublisherConfig(
        bootstrap_servers=kafka_bootstrap, identities_topic=topics["identities"],
        transcripts_topic=topics["transcripts"], observations_topic=topics["observations"],
        producer_id=f"test-{uuid.uuid4().hex[:8]}", queue_capacity=1000, max_block_ms=1000,
        consent_topic=consent_topic, chunk_max_tokens=chunk_max_tokens, chunk_max_ms=60_000)
    with RuntimePublisher(config, identity=IDENTITY) as pub:
        assert pub.publish_identity(IDENTITY)
        for owner, thread in THREADS:
            assert pub.publish_turn(turn(owner, thread, 0))
        for ordinal in range(TOKENS):  # interleave the threads, as a batched runtime does
            for owner, thread in THREADS:
                assert pub.publish_observation(observation(owner, thread, ordinal))
        for owner, thread in THREADS:
            assert pub.publish_turn(turn(owner, thread, 1))
        assert pub.flush(30.0) == 0
        stats = pub.stats()
    per_thread = -(-TOKENS // chunk_max_tokens)
    total = 1 + len(THREADS) * (per_thread + 2)
    assert stats.enqueued == stats.delivered == total
    assert stats.failed == 0 and stats.dropped_queue_full == 0 and not stats.rejected_invalid
    assert stats.delivered_by_topic == {topics["identities"]: 1,
                                        topics["transcripts"]: 2 * len(THREADS),
                                        topics["observations"]: per_thread * len(THREADS)}
    chunked = chunk_max_tokens > 1
    assert stats.chunk_tokens_enqueued == (TOKENS * len(THREADS) if chunked else 0)
    assert set(stats.bytes_on_wire) == set(topics.values())
    assert stats.first_error is None
    assert stats.refused_no_consent == 0 and stats.consent_checked

    messages = consume(kafka_bootstrap, list(topics.values()), total)
    assert len(messages) == total
    check_messages(messages, topics, config.producer_id, chunked=chunked)


def test_close_publishes_open_chunks_once(kafka_bootstrap: str, topic_factory: Any) -> None:
    """Nothing due, nothing flushed: ``close`` alone publishes every open chunk, and each
    token reaches the topic exactly once (idempotent producer, acks=all)."""
    topics = {name: topic_factory(name, partitions=3)
              for name in ("identities", "transcripts", "observations")}
    consent_topic = topic_factory.grant_consent({owner for owner, _ in THREADS})
    config = PublisherConfig(
        bootstrap_servers=kafka_bootstrap, identities_topic=topics["identities"],
        transcripts_topic=topics["transcripts"], observations_topic=topics["observations"],
        consent_topic=consent_topic, chunk_max_tokens=256, chunk_max_ms=600_000)
    pub = RuntimePublisher(config, identity=IDENTITY)
    for ordinal in range(TOKENS):
        for owner, thread in THREADS:
            assert pub.publish_observation(observation(owner, thread, ordinal))
    assert pub.stats().tokens_buffered == TOKENS * len(THREADS)
    pub.close()
    stats = pub.stats()
    assert stats.tokens_buffered == 0 and stats.delivered == stats.enqueued == len(THREADS)
    messages = consume(kafka_bootstrap, [topics["observations"]], len(THREADS))
    opener = CaptureOpener(session_keys())
    ordinals: dict[bytes, list[int]] = defaultdict(list)
    for msg in messages:
        _, chunk = decode_message(msg.value(), msg.headers())
        ordinals[msg.key()].extend(r["token_ordinal"] for r in opener.open_chunk(chunk))
    assert sorted(ordinals.values()) == [list(range(TOKENS))] * len(THREADS)


def check_messages(messages: list[Message], topics: dict[str, str], producer_id: str, *,
                   chunked: bool = False) -> None:
    by_key: dict[tuple[str, bytes], list[dict[str, Any]]] = defaultdict(list)
    partitions: dict[tuple[str, bytes], set[int]] = defaultdict(set)
    for msg in messages:
        value, key, topic, partition = msg.value(), msg.key(), msg.topic(), msg.partition()
        assert value is not None and key is not None
        assert topic is not None and partition is not None
        schema, record = decode_message(value, msg.headers())
        assert msg.headers() == kafka_headers(schema)
        if topic == topics["observations"]:  # whatever shape came in
            assert str(schema).endswith("RouteObservationChunk.v1" if chunked
                                        else "RouteObservation.v3")
        if topic == topics["identities"]:
            assert key == IDENTITY["identity_id"].encode()
            assert record == {"kernel_path": "", **IDENTITY}  # RuntimeIdentity.v3
            continue
        assert is_pseudonym(record["owner"], "o") and is_pseudonym(record["thread"], "t")
        opener = CaptureOpener(session_keys())
        records = (opener.open_chunk(record) if schema.name.endswith("Chunk")
                   else [opener.open(str(schema), record)])
        for record in records:
            assert key == f"{record['owner']}/{record['thread']}".encode()
            assert record["producer_id"] == producer_id and record["wall_time_ms"] > 0
        by_key[(topic, key)].extend(records)
        partitions[(topic, key)].add(partition)
    assert all(len(p) == 1 for p in partitions.values())  # one key, one partition
    for (topic, _key), records in by_key.items():
        counters = [r["counter"] for r in records]  # a chunk's tokens share its counter
        assert counters == sorted(counters) and (chunked or len(set(counters)) == len(counters))
        if topic == topics["observations"]:
            assert [r["token_ordinal"] for r in records] == list(range(TOKENS))
            assert all(r["layers"] == list(range(LAYERS)) and r["top_k"] == K for r in records)
            arrays = route_arrays(records[3])
            assert arrays.expert_ids[2].tolist() == [(3 + 2 + j) % EXPERTS for j in range(K)]
            assert np.allclose(arrays.weights[2], [0.4, 0.3, 0.2, 0.1])
        else:
            assert [r["turn_index"] for r in records] == [0, 1]
