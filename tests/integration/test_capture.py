"""Capture end to end on the real broker, read back by an independent Avro reader.

The reference runtime decodes synthetic threads with a KV cache and publishes; the
test consumes the three capture topics with a plain confluent-kafka consumer, decodes
the bodies with the Apache ``avro`` library (not the fastavro codec that wrote them)
and checks keys, per-thread order, identities, and that every captured route equals
what ONE plain prefill forward of the same model reports at the same position.
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import avro.io
import avro.schema
import numpy as np
import pytest
import torch

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.identity import compute_identity_id
from hebrus_flywheel.core.privacy import is_pseudonym
from hebrus_flywheel.replay.capture import CaptureConfig
from hebrus_flywheel.replay.capture_cli import run_capture
from hebrus_flywheel.replay.synthetic import generate_threads
from hebrus_flywheel.replay.teacher import load_teacher
from hebrus_flywheel.schemas.registry import HEADER_SIZE, default_registry
from hebrus_flywheel.streams import topics
from hebrus_flywheel.streams.sealing import CaptureOpener
from tests.support.sealing import session_keys

pytestmark = pytest.mark.integration

THREADS = 4


def _reference_readers() -> dict[bytes, avro.io.DatumReader]:
    """Writer schemas by fingerprint, parsed by the reference library from the .avsc files."""
    readers = {}
    for entry in default_registry():
        schema = avro.schema.parse(Path(entry.path).read_text())
        readers[entry.fingerprint] = avro.io.DatumReader(schema)
    return readers


def _consume_all(bootstrap: str, topic: str, expected: int) -> list[Any]:
    consumer = kafka.make_consumer(kafka.client_config(bootstrap),
                                   group_id=f"flywheel-reader-check-{topic}",
                                   settings={"auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    messages: list[Any] = []
    idle = 0
    try:
        while len(messages) < expected and idle < 30:
            batch = consumer.consume(500, timeout=1.0)
            idle = 0 if batch else idle + 1
            for msg in batch:
                if msg.error():
                    raise AssertionError(f"consumer error on {topic}: {msg.error()}")
                messages.append(msg)
    finally:
        consumer.close()
    return messages


def _decode(readers: dict[bytes, avro.io.DatumReader], value: bytes) -> dict[str, Any]:
    assert value[:2] == b"\xc3\x01", "single-object marker"
    reader = readers[value[2:HEADER_SIZE]]
    return reader.read(avro.io.BinaryDecoder(io.BytesIO(value[HEADER_SIZE:])))


def _opened(readers: dict[bytes, avro.io.DatumReader], value: bytes) -> list[dict[str, Any]]:
    """The record as the reference Avro library reads it, sealed fields opened as the
    stream workers open them (pseudonymous ids stay); a chunk unrolled into its tokens."""
    record = _decode(readers, value)
    schema = str(default_registry().by_fingerprint(value[2:HEADER_SIZE]).key)
    if "Identity" in schema:
        return [record]
    opener = CaptureOpener(session_keys())
    return opener.open_chunk(record) if "Chunk" in schema else [opener.open(schema, record)]


@pytest.fixture(scope="module")
def captured(kafka_bootstrap: str, teacher_dir: Path, topic_factory: Any) -> dict[str, Any]:
    topic_factory.catalogue()
    prefix = topic_factory.prefix
    threads = list(generate_threads(THREADS, seed=7))
    topic_factory.grant_consent({t.owner for t in threads})
    summary = run_capture(
        teacher_dir=teacher_dir, threads=threads,
        config=CaptureConfig(mode="forced", interleave=2), bootstrap=kafka_bootstrap,
        topic_prefix=prefix, create_topics=False,
    )
    readers = _reference_readers()
    out: dict[str, Any] = {"summary": summary}
    # observations travel in chunks: every delivered record that is no identity or turn
    counts = {"identities": 1, "transcripts": summary["turns"],
              "observations": summary["delivered"] - 1 - summary["turns"]}
    for name, topic in (("identities", topics.IDENTITIES_TOPIC),
                        ("transcripts", topics.TRANSCRIPTS_TOPIC),
                        ("observations", topics.OBSERVATIONS_TOPIC)):
        msgs = _consume_all(kafka_bootstrap, prefix + topic, counts[name])
        out[name] = [(m.key().decode(), m.partition(), m.offset(), record)
                     for m in msgs for record in _opened(readers, m.value())]
        out[f"{name}_fingerprints"] = {m.value()[2:HEADER_SIZE] for m in msgs}
    return out


def test_everything_published_was_delivered(captured: dict[str, Any]) -> None:
    summary = captured["summary"]
    assert summary["threads"] == THREADS
    assert summary["failed"] == 0 and summary["dropped"] == 0
    assert summary["refused_no_consent"] == 0
    assert summary["decoded_tokens"] == summary["observations"] > 0
    assert len(captured["transcripts"]) == summary["turns"]
    assert len(captured["observations"]) == summary["observations"]


def test_capture_is_published_pseudonymous_and_sealed(captured: dict[str, Any]) -> None:
    chunk = default_registry().get("RouteObservationChunk.v1")
    assert captured["observations_fingerprints"] == {chunk.fingerprint}
    v2 = default_registry().get("TranscriptTurn.v2")
    assert captured["transcripts_fingerprints"] == {v2.fingerprint}
    for kind in ("observations", "transcripts"):
        for key, _, _, record in captured[kind]:
            assert is_pseudonym(record["owner"], "o") and is_pseudonym(record["thread"], "t")
            assert is_pseudonym(record["sequence_id"], "s") and "owner-" not in key


def test_identity_is_pinned_and_digest_recomputes(captured: dict[str, Any]) -> None:
    [(key, _, _, identity)] = captured["identities"]
    assert key == identity["identity_id"] == compute_identity_id(identity)
    assert identity["expert_count"] == 512 and identity["top_k"] == 10
    ids = {r["identity_id"] for _, _, _, r in captured["transcripts"] + captured["observations"]}
    assert ids == {identity["identity_id"]}


def test_keys_and_per_thread_order(captured: dict[str, Any]) -> None:
    partition_of: dict[str, int] = {}
    last_ordinal: dict[str, int] = defaultdict(lambda: -1)
    last_turn: dict[str, int] = defaultdict(lambda: -1)
    for kind in ("observations", "transcripts"):
        for key, partition, _, record in sorted(captured[kind], key=lambda m: (m[1], m[2])):
            assert key == f"{record['owner']}/{record['thread']}"
            assert partition_of.setdefault(f"{kind}:{key}", partition) == partition
            if kind == "observations":
                assert record["token_ordinal"] > last_ordinal[key]
                last_ordinal[key] = record["token_ordinal"]
            else:
                assert record["turn_index"] == last_turn[key] + 1
                last_turn[key] = record["turn_index"]
    closing = [r for _, _, _, r in captured["transcripts"] if r["closes_thread"]]
    assert len(closing) == THREADS


def _thread_tokens(turns: list[dict[str, Any]]) -> list[int]:
    tokens: list[int] = []
    for turn in sorted(turns, key=lambda r: r["turn_index"]):
        assert turn["token_offset"] == len(tokens), "turns tile the canonical sequence"
        tokens.extend(turn["token_ids"])
    return tokens


def test_captured_routes_equal_a_plain_prefill_forward(
    captured: dict[str, Any], teacher_dir: Path
) -> None:
    teacher = load_teacher(teacher_dir)
    turns_by_thread: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for key, _, _, record in captured["transcripts"]:
        turns_by_thread[key].append(record)
    obs_by_thread: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for key, _, _, record in captured["observations"]:
        obs_by_thread[key].append(record)
    checked = 0
    for key, turns in turns_by_thread.items():
        tokens = _thread_tokens(turns)
        routes = teacher.forward_routes(torch.tensor([tokens]))
        ids_TLK, weights_TLK = teacher.route(routes.router_logits_BTLE[0])
        for obs in obs_by_thread[key]:
            p = obs["token_ordinal"]
            assert tokens[p] == obs["token_id"]
            layers, k = len(obs["layers"]), obs["top_k"]
            assert obs["layers"] == list(range(layers)) and obs["stages"] == [0] * layers
            # RouteObservation.v2: uint16 / float32 little-endian, [layers, top_k], rank 0 first
            got_ids = np.frombuffer(obs["expert_ids"], dtype="<u2").reshape(layers, k)
            got_w = np.frombuffer(obs["weights"], dtype="<f4").reshape(layers, k)
            np.testing.assert_array_equal(got_ids, ids_TLK[p].numpy())
            np.testing.assert_allclose(got_w, weights_TLK[p].numpy(), rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked == len(captured["observations"])


def test_transcript_segments_mark_decoded_tokens(captured: dict[str, Any]) -> None:
    generated_by_turn: dict[tuple[str, int], int] = {}
    for key, _, _, turn in captured["transcripts"]:
        n = sum(s["end"] - s["start"] for s in turn["segments"] if s["generated"])
        generated_by_turn[(key, turn["turn_index"])] = n
        assert turn["role"] == "assistant" or n == 0
        json.dumps(turn["sampling"])
    observed: dict[tuple[str, int], int] = defaultdict(int)
    for key, _, _, obs in captured["observations"]:
        observed[(key, obs["turn_index"])] += 1
    assert {k: v for k, v in generated_by_turn.items() if v} == dict(observed)
