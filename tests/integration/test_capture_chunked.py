"""Chunked capture through the real broker and a real streams worker: the same threads
published one record per token and in chunks give the same windows (ids and contents),
and both equal what the in-process chain computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.topics import CONSENT_TOPIC, TRANSCRIPTS_TOPIC
from tests.support.consent import grant_owners
from tests.support.streams_harness import (
    WorkerProcess,
    expected_pipeline,
    read_windows,
    wait_until,
    window_pairs,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDENTITY = make_identity(layers=4, experts=64, top_k=4)
SPECS = random_specs(4, n_owners=2, seed=11, assistant_tokens=20)
TOKENS = sum(kind == "observations" for spec in SPECS
             for kind, _, _ in thread_messages(spec, IDENTITY, ProducerClock()))


def _publish(bootstrap: str, topics: Any, chunk_max_tokens: int) -> Any:
    config = PublisherConfig(bootstrap_servers=bootstrap, identities_topic=topics.identities,
                             transcripts_topic=topics.transcripts,
                             observations_topic=topics.observations,
                             consent_topic=topics.transcripts.removesuffix(TRANSCRIPTS_TOPIC)
                             + CONSENT_TOPIC, chunk_max_tokens=chunk_max_tokens,
                             chunk_max_ms=60_000)
    with RuntimePublisher(config, identity=IDENTITY) as publisher:
        assert publisher.publish_identity(IDENTITY)
        clock = ProducerClock(producer_id="runtime-chunked")
        for spec in SPECS:
            for kind, _, record in thread_messages(spec, IDENTITY, clock, raw_ids=True):
                publish = (publisher.publish_turn if kind == "transcripts"
                           else publisher.publish_observation)
                assert publish(record)
        assert publisher.flush(60) == 0
        return publisher.stats()


def _worker_windows(topic_factory: Any, tmp_path: Path, name: str, chunk_max_tokens: int,
                    expected: int) -> tuple[set[tuple[str, str]], list[str]]:
    bootstrap = topic_factory.bootstrap
    prefix, topics = topic_factory.streams_namespace(name, "flywheel-streams")
    grant_owners(bootstrap, {s.owner for s in SPECS}, prefix=prefix)
    stats = _publish(bootstrap, topics, chunk_max_tokens)
    assert stats.failed == 0 and stats.dropped_queue_full == 0
    schemas = [codec.writer_entry(m.value()).short_name
               for m in read_topic(bootstrap, topics.observations)]
    worker = WorkerProcess(bootstrap=bootstrap, prefix=prefix, app_id="flywheel-streams",
                           log_path=tmp_path / f"{name}.log", home=tmp_path / name).start()
    try:
        wait_until(lambda: len(read_windows(bootstrap, topics)) >= expected, timeout_s=240,
                   what=f"{expected} windows of the {name} capture")
    finally:
        worker.stop()
    return window_pairs(read_windows(bootstrap, topics)), schemas


def test_chunked_and_per_token_capture_give_the_same_windows(topic_factory: Any,
                                                             tmp_path: Path) -> None:
    pytest.importorskip("cramjam", reason="aiokafka needs cramjam to read lz4 batches")
    messages = [identity_message(IDENTITY)]
    clock = ProducerClock(producer_id="runtime-chunked")
    for spec in SPECS:
        messages.extend(thread_messages(spec, IDENTITY, clock))
    reference = expected_pipeline(messages, worker_processor_config({}))
    assert reference.quarantined == [] and len(reference.windows) >= len(SPECS)
    want = window_pairs(reference.windows)

    per_token, token_schemas = _worker_windows(topic_factory, tmp_path, "tokens", 1, len(want))
    chunked, chunk_schemas = _worker_windows(topic_factory, tmp_path, "chunks", 8, len(want))
    assert token_schemas == ["RouteObservation"] * TOKENS
    assert set(chunk_schemas) == {"RouteObservationChunk"} and len(chunk_schemas) < TOKENS
    assert per_token == want
    assert chunked == want
