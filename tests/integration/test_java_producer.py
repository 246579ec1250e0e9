"""Another language can publish (issue 16): the Java capture producer (``runtimes/java``)
writes, through the real broker with the runtime role's SCRAM credentials, records that a
real stream worker accepts and windows exactly as it windows the Python publisher's; it
pseudonymizes and seals like the Python publisher and refuses owners without consent.

Skipped, with the reason, where ``java`` or ``mvn`` is missing (see
``tests/support/java_runtime.py``)."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.core.kafka.security import acting_as
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.acls import grant_catalogue
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.sealing import CaptureOpener
from tests.support.consent import grant_owners
from tests.support.java_runtime import java_skip_reason, run_java_producer
from tests.support.sealing import CANARY, hits, owner_pseudonym, session_keys, thread_key
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
    ThreadSpec,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(java_skip_reason() is not None, reason=java_skip_reason() or ""),
]

IDENTITY = make_identity(layers=8, experts=64, top_k=4, name="java-runtime")
FLAGS = {"validation_fraction": 0.3, "runtime_holdout_fraction": 0.3, "stress_rate": 0.0}
APP_ID = "flywheel-streams"


def _messages(specs: list[ThreadSpec], *, raw_ids: bool) -> list[Any]:
    clock = ProducerClock(producer_id="java-runtime")
    out: list[Any] = [identity_message(IDENTITY)]
    for spec in specs:
        out.extend(thread_messages(spec, IDENTITY, clock, raw_ids=raw_ids))
    return out


def _namespace(topic_factory: Any, name: str) -> tuple[str, StreamTopics]:
    """A fresh catalogue copy with every role's ACLs on it: the Java producer connects as
    the ``runtime`` role (write capture, read consent), not as the test's admin."""
    prefix, topics = topic_factory.streams_namespace(f"{name}{uuid.uuid4().hex[:4]}", APP_ID)
    grant_catalogue(topic_factory.bootstrap, prefix)
    return prefix, topics


def _capture(bootstrap: str, topic: str) -> list[Any]:
    return list(read_topic(bootstrap, topic))


def _publish_python(bootstrap: str, topics: StreamTopics, raw: list[Any]) -> None:
    """The same raw records through the Python publisher (as the runtime role)."""
    config = PublisherConfig(bootstrap_servers=bootstrap, identities_topic=topics.identities,
                             transcripts_topic=topics.transcripts,
                             observations_topic=topics.observations,
                             consent_topic=topics.consent,
                             chunk_max_tokens=1)  # per token, like the Java producer
    with acting_as("runtime"), RuntimePublisher(config) as publisher:
        for kind, _, record in raw:
            publish = {"identities": publisher.publish_identity,
                       "transcripts": publisher.publish_turn,
                       "observations": publisher.publish_observation}[kind]
            assert publish(record)
        assert publisher.flush(60) == 0
        assert publisher.stats().delivered == len(raw)


def _worker(bootstrap: str, prefix: str, tmp_path: Path, tag: str) -> WorkerProcess:
    return WorkerProcess(bootstrap=bootstrap, prefix=prefix, app_id=APP_ID,
                         log_path=tmp_path / f"worker-{tag}.log", flags=FLAGS,
                         home=tmp_path / f"home-{tag}").start()


def _by_id(windows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {w["window_id"]: w for w in windows}


def test_java_records_become_the_python_publishers_windows(topic_factory: Any,
                                                           tmp_path: Path) -> None:
    """The same synthetic threads published by the Java producer (one namespace) and by
    the Python publisher (another) become the same windows, record for record, in two
    real stream workers: the set the in-process chain predicts, nothing quarantined."""
    pytest.importorskip("cramjam", reason="aiokafka needs cramjam to read lz4 batches")
    bootstrap = topic_factory.bootstrap
    java_prefix, java_topics = _namespace(topic_factory, "java")
    py_prefix, py_topics = _namespace(topic_factory, "jpy")
    specs = random_specs(6, n_owners=4, seed=16, assistant_tokens=20)
    expected = window_pairs(expected_pipeline(_messages(specs, raw_ids=False),
                                              worker_processor_config(FLAGS)).windows)
    raw = _messages(specs, raw_ids=True)
    for prefix in (java_prefix, py_prefix):
        grant_owners(bootstrap, {s.owner for s in specs}, prefix=prefix)

    stats = run_java_producer(bootstrap, java_prefix, raw, tmp_path)
    assert stats == {"enqueued": len(raw), "delivered": len(raw), "failed": 0,
                     "refused_no_consent": 0, "first_error": None}
    _publish_python(bootstrap, py_topics, raw)

    workers = [_worker(bootstrap, java_prefix, tmp_path, "java"),
               _worker(bootstrap, py_prefix, tmp_path, "python")]
    try:
        for topics in (java_topics, py_topics):
            wait_until(lambda t=topics: window_pairs(read_windows(bootstrap, t)) >= expected,
                       timeout_s=180, what=f"every expected window on {topics.prefix}")
    finally:
        for worker in workers:
            worker.stop()
    java_windows = read_windows(bootstrap, java_topics)
    assert window_pairs(java_windows) == expected and len(expected) >= len(specs)
    assert _by_id(java_windows) == _by_id(read_windows(bootstrap, py_topics))
    for topics in (java_topics, py_topics):
        assert _capture(bootstrap, topics.quarantine) == []


def test_java_wire_format_matches_the_python_codec(topic_factory: Any, tmp_path: Path) -> None:
    """Headers, keys, fingerprints and seals as the Python publisher writes them: the
    Python codec decodes every record (headers agree with the body's fingerprint), keys
    are the pseudonymous thread keys, no raw id or plaintext token is on the wire, and the
    stream workers' opener opens every sealed field back to the runtime's plaintext."""
    bootstrap = topic_factory.bootstrap
    prefix, topics = _namespace(topic_factory, "javaw")
    owner = f"owner-{uuid.uuid4().hex[:8]}"
    spec = ThreadSpec(owner=owner, thread="thread-j", turns=(("user", 4), ("assistant", 4)),
                      tokens=(CANARY, CANARY))
    raw = _messages([spec], raw_ids=True)
    grant_owners(bootstrap, [owner], prefix=prefix)
    assert run_java_producer(bootstrap, prefix, raw, tmp_path)["delivered"] == len(raw)

    plain = {(r["turn_index"], r.get("token_ordinal")): r
             for kind, _, r in _messages([spec], raw_ids=False) if kind != "identities"}
    opener = CaptureOpener(session_keys())
    seen: Counter[str] = Counter()
    for kind, topic in topics.capture_kinds().items():
        for msg in _capture(bootstrap, topic):
            schema, record = codec.decode_message(msg.value(), msg.headers())
            seen[kind] += 1
            wire = msg.value() + msg.key() + b"".join(v for _, v in msg.headers())
            assert owner.encode() not in wire and hits(wire) == []
            if kind == "identities":
                assert str(schema) == "hebrus.flywheel.v1.RuntimeIdentity.v3"
                assert msg.key() == IDENTITY["identity_id"].encode() and record == {
                    "routed_layers": [], "layer_count": 0, "kernel_path": "", **IDENTITY}
                continue
            assert msg.key() == thread_key(owner, "thread-j")
            opened = opener.open(str(schema), record)
            expected = plain[(record["turn_index"], record.get("token_ordinal"))]
            assert opened == expected
    assert seen == Counter(kind for kind, _, _ in raw) and seen["observations"] == 5
    assert {str(codec.writer_entry(m.value()).key) for t in (topics.transcripts,
            topics.observations) for m in _capture(bootstrap, t)} == {
        "hebrus.flywheel.v1.TranscriptTurn.v2", "hebrus.flywheel.v1.RouteObservation.v3"}


def test_java_producer_refuses_owners_without_consent(topic_factory: Any,
                                                      tmp_path: Path) -> None:
    """Fail closed: an owner with no grant, or with a grant that does not cover the
    records' wall time, is not published at all; a granted owner is."""
    bootstrap = topic_factory.bootstrap
    prefix, topics = _namespace(topic_factory, "javac")
    granted, ungranted, lapsed = (f"owner-{uuid.uuid4().hex[:8]}" for _ in range(3))
    specs = [ThreadSpec(owner=o, thread="t", turns=(("user", 3), ("assistant", 3)))
             for o in (granted, ungranted, lapsed)]
    grant_owners(bootstrap, [granted], prefix=prefix)
    grant_owners(bootstrap, [lapsed], prefix=prefix, expires_at_ms=specs[2].start_ms)
    raw = _messages(specs, raw_ids=True)
    per_thread = (len(raw) - 1) // 3
    stats = run_java_producer(bootstrap, prefix, raw, tmp_path)
    assert stats["refused_no_consent"] == 2 * per_thread
    assert stats["delivered"] == 1 + per_thread and stats["failed"] == 0
    keys = {m.key() for t in (topics.transcripts, topics.observations)
            for m in _capture(bootstrap, t)}
    assert keys == {thread_key(granted, "t")}


def test_java_producer_follows_the_key_store_contract(topic_factory: Any, tmp_path: Path) -> None:
    """The Java producer shares the Python key store: after an erasure's tombstone it
    seals under a fresh generation (highest destroyed + 1), never the destroyed one, and
    what it seals opens with the key the Python store reads back."""
    bootstrap = topic_factory.bootstrap
    prefix, topics = _namespace(topic_factory, "javak")
    owner = f"owner-{uuid.uuid4().hex[:8]}"
    store = session_keys()
    pseudonym = owner_pseudonym(owner)
    assert store.data_key(pseudonym, create=True).generation == 0
    assert store.destroy(pseudonym).generations == (0,)
    spec = ThreadSpec(owner=owner, thread="t", turns=(("user", 3), ("assistant", 3)))
    raw = _messages([spec], raw_ids=True)
    grant_owners(bootstrap, [owner], prefix=prefix)
    assert run_java_producer(bootstrap, prefix, raw, tmp_path)["delivered"] == len(raw)
    generations = {codec.decode_message(m.value(), m.headers())[1]["key_generation"]
                   for t in (topics.transcripts, topics.observations)
                   for m in _capture(bootstrap, t)}
    assert generations == {1}
    assert store.data_key(pseudonym).generation == 1
    assert store.destroyed_generations(pseudonym) == (0,)
    opener = CaptureOpener(store)
    for m in _capture(bootstrap, topics.transcripts):
        schema, record = codec.decode_message(m.value(), m.headers())
        assert opener.open(str(schema), record)["owner"] == pseudonym
