"""Sealed capture through the real broker and a real streams worker: the capture and
quarantine topics hold no raw id and no plaintext token; an erased owner's records are
quarantined metadata-only; an old runtime's unsealed records are refused."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.quarantine import SCHEMA as QUARANTINE_SCHEMA
from hebrus_flywheel.streams.topics import CONSENT_TOPIC, TRANSCRIPTS_TOPIC
from tests.support.consent import grant_owners
from tests.support.sealing import CANARY, hits, owner_pseudonym, session_keys
from tests.support.streams_harness import WorkerProcess, produce, producer, read_windows, wait_until
from tests.support.streams_synthetic import (
    ProducerClock,
    ThreadSpec,
    encode_message,
    identity_message,
    make_identity,
    thread_messages,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDENTITY = make_identity(layers=4, experts=64, top_k=4)


def _spec(owner: str, tokens: tuple[int, ...] = CANARY) -> ThreadSpec:
    return ThreadSpec(owner=owner, thread="thread-c", turns=(("user", 4), ("assistant", 4)),
                      tokens=(tokens, tokens))


def _publish(bootstrap: str, topics: StreamTopics, specs: list[ThreadSpec]) -> None:
    config = PublisherConfig(bootstrap_servers=bootstrap, identities_topic=topics.identities,
                             transcripts_topic=topics.transcripts,
                             observations_topic=topics.observations,
                             consent_topic=topics.transcripts.removesuffix(TRANSCRIPTS_TOPIC)
                             + CONSENT_TOPIC)
    with RuntimePublisher(config, identity=IDENTITY) as publisher:
        assert publisher.publish_identity(IDENTITY)
        clock = ProducerClock(producer_id="runtime-sealed")
        for spec in specs:
            for kind, _, record in thread_messages(spec, IDENTITY, clock, raw_ids=True):
                publish = (publisher.publish_turn if kind == "transcripts"
                           else publisher.publish_observation)
                assert publish(record)
        assert publisher.flush(60) == 0


def _all_bytes(bootstrap: str, topic: str) -> tuple[bytes, list[Any]]:
    messages = list(read_topic(bootstrap, topic))
    data = b"".join((m.key() or b"") + (m.value() or b"")
                    + b"".join(k.encode() + (v or b"") for k, v in m.headers() or ())
                    for m in messages)
    return data, messages


def test_sealed_capture_through_a_worker(topic_factory: Any, tmp_path: Path) -> None:
    pytest.importorskip("cramjam", reason="aiokafka needs cramjam to read lz4 batches")
    bootstrap = topic_factory.bootstrap
    prefix, topics = topic_factory.streams_namespace("sealed", "flywheel-streams")
    kept, erased, old = (f"owner-{uuid.uuid4().hex[:8]}" for _ in range(3))
    grant_owners(bootstrap, [kept, erased, old], prefix=prefix)  # only sealing refuses here
    _publish(bootstrap, topics, [_spec(kept), _spec(erased)])
    session_keys().destroy(owner_pseudonym(erased))  # erased after capture, before processing
    # an old runtime: unsealed v1/v2 records with raw ids (other tokens: it is plaintext)
    old_msgs = list(thread_messages(_spec(old, (11, 12, 13, 14)), IDENTITY,
                                    ProducerClock(producer_id="old-runtime"), raw_ids=True))
    prod = producer(bootstrap)
    produce(prod, topics, [identity_message(IDENTITY)])
    for kind, key, record in old_msgs:
        value, headers = encode_message(kind, record, seal=False)
        prod.produce(topics.capture_kinds()[kind], key=key, value=value, headers=headers)
    prod.flush(30)

    worker = WorkerProcess(bootstrap=bootstrap, prefix=prefix, app_id="flywheel-streams",
                           log_path=tmp_path / "worker.log", home=tmp_path / "home").start()
    # every record of the erased thread (2 turns, 1 chunk of its 5 tokens) and of the old
    # runtime (2 turns, 5 per-token observations)
    expected_quarantine = 3 + 7
    try:
        wait_until(lambda: len(read_windows(bootstrap, topics)) >= 1 and len(
            list(read_topic(bootstrap, topics.quarantine))) >= expected_quarantine,
            timeout_s=180, what="the kept owner's window and every refused record")
    finally:
        worker.stop()

    (window,) = read_windows(bootstrap, topics)
    assert window["owner"] == owner_pseudonym(kept)
    for topic, count in ((topics.transcripts, 3 * 2), (topics.observations, 2 * 1 + 5)):
        data, messages = _all_bytes(bootstrap, topic)
        assert len(messages) == count
        assert hits(data) == [] and kept.encode() not in data and erased.encode() not in data
    data, messages = _all_bytes(bootstrap, topics.quarantine)
    assert hits(data) == [] and old.encode() not in data
    records = [codec.decode_message(m.value(), m.headers())[1] for m in messages]
    assert all(codec.writer_entry(m.value()).short_name == QUARANTINE_SCHEMA for m in messages)
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for q in records:
        by_reason.setdefault(q["reason"], []).append(q)
    assert sorted((r, len(qs)) for r, qs in by_reason.items()) == [
        ("owner_erased", 3), ("unsealed_capture", 7)]
    for q in records:
        assert q["value"] == b"" and q["reference_only"]
    assert {q["owner"] for q in by_reason["owner_erased"]} == {owner_pseudonym(erased)}
    assert {q["owner"] for q in by_reason["unsealed_capture"]} == {None}
