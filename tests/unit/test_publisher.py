"""Runtime publisher without a broker: queue-full policies, validation, lifecycle, config.

The producer points at 127.0.0.1:1, where nothing listens, and librdkafka's own buffer
is limited to one message, so nothing drains and the in-process queue fills up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.identity import with_identity_id
from hebrus_flywheel.schemas.codec import decode_message
from hebrus_flywheel.streams import routes
from hebrus_flywheel.streams.exceptions import (
    PublisherClosedError,
    PublishValidationError,
    QueueFullError,
)
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.sealing import CaptureOpener
from hebrus_flywheel.streams.topics import IDENTITIES_TOPIC, OBSERVATIONS_TOPIC, TRANSCRIPTS_TOPIC
from tests.support.consent import ledger_allowing
from tests.support.sealing import session_keys

UNREACHABLE = "127.0.0.1:1"
MAX_BLOCK_MS = 200.0
LAYERS, EXPERTS, K = 4, 64, 4

IDENTITY = with_identity_id({
    "model_family": "qwen3_next", "model_artifact_digest": "a" * 64,
    "tokenizer_digest": "b" * 64, "chat_template_digest": "c" * 64, "dtype": "float32",
    "quantization": "none", "routed_layer_count": LAYERS, "expert_count": EXPERTS, "top_k": K,
    "tie_break_rule": "score_desc_then_expert_id_asc",
    "weight_rule": "softmax_topk_renormalized", "hidden_size": 64,
    "routed_intermediate_size": 32, "runtime_name": "hebrus", "runtime_version": "0.1",
})


def observation(ordinal: int, **change: Any) -> dict[str, Any]:
    record = {
        "owner": "o1", "thread": "t1", "generation": 0, "sequence_id": "r1", "turn_index": 0,
        "token_ordinal": ordinal, "token_id": 42, "identity_id": IDENTITY["identity_id"],
        "speculative": None,
        "layers": [{"stage": 0, "layer": i, "expert_ids": [i, i + 1, i + 2, i + 3],
                    "weights": [0.4, 0.3, 0.2, 0.1]} for i in range(LAYERS)],
    }
    record.update(change)
    return record


def stalled(**change: Any) -> RuntimePublisher:
    """One record per token unless ``change`` says otherwise (queue tests count records;
    chunks: tests/unit/test_publisher_chunks.py)."""
    config = PublisherConfig(
        bootstrap_servers=UNREACHABLE, queue_capacity=2, max_block_ms=MAX_BLOCK_MS,
        producer_overrides={"queue.buffering.max.messages": 1},
        **{"chunk_max_tokens": 1, **change})
    return RuntimePublisher(config, identity=IDENTITY, consent=ledger_allowing(["o1"]))


@pytest.fixture
def publisher() -> Iterator[RuntimePublisher]:
    pub = stalled()
    yield pub
    pub.close(timeout_s=0.2)


def fill_until_full(pub: RuntimePublisher) -> tuple[int, float]:
    """Publish until one call does not enqueue; returns (its ordinal, its duration)."""
    for ordinal in range(20):
        start = time.monotonic()
        if not pub.publish_observation(observation(ordinal)):
            return ordinal, time.monotonic() - start
    raise AssertionError("the queue never filled")


def test_full_queue_drops_newest_after_max_block(publisher: RuntimePublisher) -> None:
    ordinal, took = fill_until_full(publisher)
    # It waited for room, and gave up after about max_block_ms (generous bound: a loaded
    # CI machine schedules threads late, but it must never block indefinitely).
    assert MAX_BLOCK_MS / 1000 * 0.9 <= took < MAX_BLOCK_MS / 1000 + 2.0
    stats = publisher.stats()
    assert stats.dropped_queue_full == 1
    assert stats.enqueued == ordinal
    assert stats.queue_depth == 2
    assert stats.delivered == 0


def test_block_then_raise_raises_and_counts() -> None:
    pub = stalled(full_policy="block_then_raise")
    try:
        with pytest.raises(QueueFullError, match="capacity 2"):
            for ordinal in range(20):
                pub.publish_observation(observation(ordinal))
        assert pub.stats().dropped_queue_full == 1
    finally:
        pub.close(timeout_s=0.2)


def test_validation_rejects_before_enqueue(publisher: RuntimePublisher) -> None:
    bad = observation(0)
    bad["layers"][1]["expert_ids"] = [1, 2, 3]
    bad["layers"][1]["weights"] = [0.5, 0.3, 0.2]
    with pytest.raises(PublishValidationError) as info:
        publisher.publish_observation(bad)
    assert info.value.reason == "wrong_k"
    with pytest.raises(PublishValidationError, match="unknown_identity"):
        publisher.publish_observation(observation(0, identity_id="f" * 64))
    with pytest.raises(PublishValidationError, match="identity_digest_mismatch"):
        publisher.publish_identity({**IDENTITY, "top_k": 3})
    assert publisher.publish_observation(observation(5))
    with pytest.raises(PublishValidationError, match="ordinal_not_increasing"):
        publisher.publish_observation(observation(4))
    stats = publisher.stats()
    assert stats.enqueued == 1
    assert stats.rejected_invalid == {"wrong_k": 1, "unknown_identity": 1,
                                      "identity_digest_mismatch": 1,
                                      "ordinal_not_increasing": 1}


@pytest.mark.parametrize("field", ["owner", "thread", "producer_id", "sequence_id"])
def test_overlong_field_is_refused_naming_field_and_limit(publisher: RuntimePublisher,
                                                          field: str) -> None:
    with pytest.raises(PublishValidationError) as info:
        publisher.publish_observation(observation(0, **{field: "x" * 900_000}))
    assert info.value.reason == "field_too_long" and info.value.field == field
    assert "900000 bytes; the limit is 256 UTF-8 bytes" in str(info.value)
    assert publisher.stats().rejected_invalid == {"field_too_long": 1}


def test_caller_record_is_not_mutated_and_identity_registers(
        publisher: RuntimePublisher) -> None:
    record = observation(0)
    before = dict(record)
    assert publisher.publish_observation(record)
    assert record == before  # producer_id, counter, wall_time_ms were stamped on a copy
    other = with_identity_id({**IDENTITY, "top_k": 2})
    publisher.publish_identity(other)
    two = observation(0, identity_id=other["identity_id"], sequence_id="r2")
    for route in two["layers"]:
        route["expert_ids"], route["weights"] = route["expert_ids"][:2], [0.6, 0.4]
    assert publisher.publish_observation(two)


def test_close_is_idempotent_bounded_and_accounts_for_everything() -> None:
    pub = stalled()
    fill_until_full(pub)
    start = time.monotonic()
    pub.close(timeout_s=0.3)
    assert time.monotonic() - start < 5.0
    pub.close()
    stats = pub.stats()
    assert stats.delivered == 0
    assert stats.enqueued == stats.failed + stats.dropped_on_close
    assert stats.queue_depth == 0 and stats.in_flight == 0
    assert stats.first_error is not None
    with pytest.raises(PublisherClosedError):
        pub.publish_observation(observation(100))


def test_context_manager_closes() -> None:
    with RuntimePublisher(PublisherConfig(bootstrap_servers=UNREACHABLE, close_timeout_s=0.1),
                          identity=IDENTITY) as pub:
        pass
    with pytest.raises(PublisherClosedError):
        pub.publish_identity(IDENTITY)


def test_default_topics_come_from_the_catalogue() -> None:
    config = PublisherConfig(bootstrap_servers=UNREACHABLE)
    assert (config.identities_topic, config.transcripts_topic, config.observations_topic) == (
        IDENTITIES_TOPIC, TRANSCRIPTS_TOPIC, OBSERVATIONS_TOPIC)
    settings = config.producer_settings()
    assert settings["enable.idempotence"] is True and settings["acks"] == "all"
    assert PublisherConfig(bootstrap_servers="x").producer_id != config.producer_id


@pytest.mark.parametrize(("change", "field"), [
    ({"queue_capacity": 0}, "queue_capacity"),
    ({"max_block_ms": -1}, "max_block_ms"),
    ({"full_policy": "drop_oldest"}, "full_policy"),
    ({"compression": "gzip"}, "compression"),
    ({"observations_topic": ""}, "observations_topic"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"producer_overrides": {"enable.idempotence": False}}, "producer_overrides"),
    ({"producer_overrides": {"acks": 1}}, "producer_overrides"),
])
def test_config_errors_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"PublisherConfig.{field}"):
        PublisherConfig(bootstrap_servers=UNREACHABLE, **change)


def test_bad_librdkafka_override_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="producer_overrides"):
        RuntimePublisher(PublisherConfig(bootstrap_servers=UNREACHABLE,
                                         producer_overrides={"no.such.setting": 1}))


def test_schema_violation_found_by_the_encoder_is_a_validation_error(
        publisher: RuntimePublisher) -> None:
    with pytest.raises(PublishValidationError) as info:
        publisher.publish_observation(observation(0, unexpected_field=1))
    assert info.value.reason == "schema_violation"
    assert info.value.field == "unexpected_field"
    assert publisher.stats().rejected_invalid == {"schema_violation": 1}
    assert publisher.publish_observation(observation(0))  # the ordinal was not consumed


def packed_observation(ordinal: int, **change: Any) -> dict[str, Any]:
    """What a runtime publishes: routes packed straight from its arrays (v2 fields)."""
    ids = np.arange(LAYERS, dtype=np.uint16)[:, None] + np.arange(K, dtype=np.uint16)[None, :]
    weights = np.tile(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32), (LAYERS, 1))
    record = {k: v for k, v in observation(ordinal).items() if k != "layers"}
    record.update(routes.pack_routes(ids, weights), **change)
    return record


@pytest.fixture
def capturing() -> Iterator[tuple[RuntimePublisher, list[Any]]]:
    """A publisher whose drain thread hands records to a list instead of librdkafka (one
    ``RouteObservation.v3`` per token)."""
    pub = RuntimePublisher(PublisherConfig(bootstrap_servers=UNREACHABLE, close_timeout_s=0.1,
                                           chunk_max_tokens=1),
                           identity=IDENTITY, consent=ledger_allowing(["o1"]))
    sent: list[Any] = []
    pub._send = sent.append  # type: ignore[method-assign]
    yield pub, sent
    pub.close(timeout_s=0.1)


def test_observations_go_out_sealed_whatever_shape_they_came_in(
        capturing: tuple[RuntimePublisher, list[Any]]) -> None:
    pub, sent = capturing
    assert pub.publish_observation(packed_observation(0))
    assert pub.publish_observation(observation(1))  # v1 per-layer routes, packed here
    assert pub.flush(5.0) == 0
    assert len(sent) == 2
    opener = CaptureOpener(session_keys())
    for item in sent:
        key, sealed = decode_message(item.value, item.headers)
        assert key.name.endswith("RouteObservation") and key.version == 3
        assert "expert_ids" not in sealed and "token_id" not in sealed
        record = opener.open(str(key), sealed)  # the packed v2 shape again
        assert record["layers"] == list(range(LAYERS)) and record["top_k"] == K
        arrays = routes.route_arrays(record)
        assert arrays.expert_ids[2].tolist() == [2, 3, 4, 5]
        assert np.allclose(arrays.weights[3], [0.4, 0.3, 0.2, 0.1])
    assert [decode_message(i.value, i.headers)[1]["token_ordinal"] for i in sent] == [0, 1]
    assert sent[0].key == f"{sealed['owner']}/{sealed['thread']}".encode()


def test_packed_records_are_checked_with_the_same_reason_codes(
        capturing: tuple[RuntimePublisher, list[Any]]) -> None:
    pub, sent = capturing
    good = packed_observation(0)
    cases = {
        "wrong_k": packed_observation(0, top_k=K - 1),
        "weights_ids_length_mismatch": packed_observation(0, weights=good["weights"][:-4]),
        "layer_count_mismatch": packed_observation(0, layers=[0, 1], stages=[0, 0]),
        "wrong_type": packed_observation(0, expert_ids=list(good["expert_ids"])),
    }
    for reason, record in cases.items():
        with pytest.raises(PublishValidationError) as info:
            pub.publish_observation(record)
        assert info.value.reason == reason
    assert pub.publish_observation(good)  # refused records consumed no ordinal
    pub.flush(5.0)
    assert len(sent) == 1
    assert pub.stats().rejected_invalid == dict.fromkeys(cases, 1)
