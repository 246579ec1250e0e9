"""The runtime publisher's chunks, without a broker: the drain thread hands records to a
list instead of librdkafka, so what would go on the wire can be read back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.schemas.codec import decode_message
from hebrus_flywheel.streams.exceptions import PublishValidationError
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.sealing import CaptureOpener
from tests.support.consent import ledger_allowing
from tests.support.sealing import session_keys
from tests.unit.test_publisher import IDENTITY, LAYERS, K, packed_observation

UNREACHABLE = "127.0.0.1:1"


def _capturing(**change: Any) -> tuple[RuntimePublisher, list[Any]]:
    config = PublisherConfig(bootstrap_servers=UNREACHABLE, close_timeout_s=0.5,
                             **{"chunk_max_ms": 60_000.0, **change})
    pub = RuntimePublisher(config, identity=IDENTITY, consent=ledger_allowing(["o1"]))
    sent: list[Any] = []
    pub._send = sent.append  # type: ignore[method-assign]
    return pub, sent


@pytest.fixture
def capturing() -> Iterator[tuple[RuntimePublisher, list[Any]]]:
    pub, sent = _capturing(chunk_max_tokens=4)
    yield pub, sent
    pub.close(timeout_s=0.5)


def _decoded(sent: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for item in sent:
        key, record = decode_message(item.value, item.headers)
        out.append((key.name.rsplit(".", 1)[-1] + f".v{key.version}", record))
    return out


def test_close_publishes_every_open_chunk_and_nothing_twice() -> None:
    pub, sent = _capturing(chunk_max_tokens=64)
    for ordinal in range(10):
        assert pub.publish_observation(packed_observation(ordinal))
    assert pub.stats().tokens_buffered == 10 and sent == []  # nothing due yet
    pub.close()
    ((schema, chunk),) = _decoded(sent)
    assert schema == "RouteObservationChunk.v1" and chunk["token_count"] == 10
    opened = CaptureOpener(session_keys()).open_chunk(chunk)
    assert [r["token_ordinal"] for r in opened] == list(range(10))
    stats = pub.stats()
    assert stats.tokens_buffered == 0 and stats.chunk_tokens_enqueued == 10
    assert stats.chunks_enqueued == stats.enqueued == 1 and stats.failed == 0


def test_chunks_split_at_max_tokens_with_increasing_counters(
        capturing: tuple[RuntimePublisher, list[Any]]) -> None:
    pub, sent = capturing
    for ordinal in range(10):
        pub.publish_observation(packed_observation(ordinal))
    assert pub.flush(5.0) == 0
    decoded = _decoded(sent)
    assert [c["token_count"] for _, c in decoded] == [4, 4, 2]
    assert [c["first_ordinal"] for _, c in decoded] == [0, 4, 8]
    counters = [c["counter"] for _, c in decoded]
    assert counters == sorted(set(counters))


def test_a_speculative_token_goes_alone_after_the_threads_open_chunk(
        capturing: tuple[RuntimePublisher, list[Any]]) -> None:
    pub, sent = capturing
    pub.publish_observation(packed_observation(0))
    pub.publish_observation(packed_observation(1))
    spec = {"proposal_id": "p1", "proposal_generation": 0, "candidate_position": 0,
            "accepted_prefix_digest": "d", "verifier_generation": 0, "accepted": True}
    pub.publish_observation(packed_observation(2, speculative=spec))
    assert pub.flush(5.0) == 0
    assert [s for s, _ in _decoded(sent)] == ["RouteObservationChunk.v1",
                                                "RouteObservation.v3"]


def test_a_chunk_is_published_max_ms_after_its_first_token_without_more_calls() -> None:
    pub, sent = _capturing(chunk_max_tokens=64, chunk_max_ms=20.0)
    try:
        pub.publish_observation(packed_observation(0))
        pub.publish_observation(packed_observation(1))
        deadline = time.monotonic() + 10.0
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        ((_, chunk),) = _decoded(sent)
        assert chunk["token_count"] == 2 and pub.stats().tokens_buffered == 0
    finally:
        pub.close(timeout_s=0.5)


def test_an_ordinal_gap_starts_a_new_chunk(
        capturing: tuple[RuntimePublisher, list[Any]]) -> None:
    pub, sent = capturing
    for ordinal in (0, 1, 5, 6):
        pub.publish_observation(packed_observation(ordinal))
    pub.flush(5.0)
    assert [(c["first_ordinal"], c["token_count"]) for _, c in _decoded(sent)] == [(0, 2), (5, 2)]


def test_end_thread_publishes_its_chunk_now(
        capturing: tuple[RuntimePublisher, list[Any]]) -> None:
    pub, sent = capturing
    pub.publish_observation(packed_observation(0))
    assert pub.end_thread("o1", "t1") and not pub.end_thread("o1", "t1")
    assert pub.stats().chunks_enqueued == 1
    assert pub.flush(5.0) == 0 and len(sent) == 1


@pytest.mark.parametrize(("change", "field"), [
    ({"chunk_max_tokens": 0}, "chunk_max_tokens"),
    ({"chunk_max_tokens": 5000}, "chunk_max_tokens"),
    ({"chunk_max_ms": -1}, "chunk_max_ms"),
])
def test_chunk_config_errors_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        PublisherConfig(bootstrap_servers=UNREACHABLE, **change)


# -- publish_run: a decoded run of tokens at once ------------------------------------------


def _arrays(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    one = packed_observation(0)
    ids = np.frombuffer(one["expert_ids"], "<u2").reshape(LAYERS, K)
    weights = np.frombuffer(one["weights"], "<f4").reshape(LAYERS, K)
    return (np.arange(n) + 40, np.repeat(ids[None], n, axis=0).copy(),
            np.repeat(weights[None], n, axis=0).copy())


BASE = {"owner": "o1", "thread": "t1", "generation": 0, "sequence_id": "r1", "turn_index": 0,
        "identity_id": IDENTITY["identity_id"]}


def test_a_run_chunks_exactly_like_the_same_tokens_one_by_one() -> None:
    tokens, ids, weights = _arrays(10)
    by_run, sent_run = _capturing(chunk_max_tokens=4)
    by_token, sent_token = _capturing(chunk_max_tokens=4)
    assert by_run.publish_run(BASE, first_ordinal=0, token_ids=tokens, expert_ids_TLK=ids,
                              weights_TLK=weights) == 10
    for i in range(10):
        by_token.publish_observation(packed_observation(i, token_id=int(tokens[i])))
    for pub in (by_run, by_token):
        pub.close()
    opener = CaptureOpener(session_keys())
    runs = [opener.open_chunk(c) for _, c in _decoded(sent_run)]
    singles = [opener.open_chunk(c) for _, c in _decoded(sent_token)]
    assert [len(r) for r in runs] == [4, 4, 2]
    fields = ("token_ordinal", "token_id", "expert_ids", "weights", "layers", "stages")
    assert [[{f: t[f] for f in fields} for t in r] for r in runs] == \
        [[{f: t[f] for f in fields} for t in r] for r in singles]


@pytest.mark.parametrize(("mutate", "reason", "token"), [
    (lambda ids, w, t: ids.__setitem__((3, 1, 2), ids[3, 1, 0]), "duplicate_expert_id", 3),
    (lambda ids, w, t: ids.__setitem__((5, 0, 0), 999), "expert_id_out_of_range", 5),
    (lambda ids, w, t: w.__setitem__((2, 3, 3), 0.9), "rank_order_violation", 2),
    (lambda ids, w, t: w.__setitem__((1, 0, 0), np.nan), "non_finite_weight", 1),
    (lambda ids, w, t: t.__setitem__(4, -1), "token_id_out_of_range", None),
])
def test_a_bad_token_refuses_the_whole_run_naming_it(mutate: Any, reason: str,
                                                     token: int | None) -> None:
    tokens, ids, weights = _arrays(8)
    mutate(ids, weights, tokens)
    pub, sent = _capturing()
    try:
        with pytest.raises(PublishValidationError) as info:
            pub.publish_run(BASE, first_ordinal=0, token_ids=tokens, expert_ids_TLK=ids,
                            weights_TLK=weights)
        assert info.value.reason == reason
        if token is not None:
            assert f"token {token}," in str(info.value)
        assert pub.stats().tokens_buffered == 0 and pub.stats().rejected_invalid == {reason: 1}
    finally:
        pub.close(timeout_s=0.5)
    assert sent == []


def test_a_run_must_continue_after_the_last_published_ordinal() -> None:
    tokens, ids, weights = _arrays(4)
    pub, _ = _capturing()
    try:
        pub.publish_run(BASE, first_ordinal=10, token_ids=tokens, expert_ids_TLK=ids,
                        weights_TLK=weights)
        with pytest.raises(PublishValidationError) as info:
            pub.publish_run(BASE, first_ordinal=12, token_ids=tokens, expert_ids_TLK=ids,
                            weights_TLK=weights)
        assert info.value.reason in ("ordinal_not_increasing", "duplicate_ordinal")
    finally:
        pub.close(timeout_s=0.5)
