"""Pseudonymous, sealed capture: what the publisher lets out, and what workers do with it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, is_pseudonym
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams import quarantine
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.sealing import CaptureOpener, SealingError
from tests.support.sealing import CANARY, hits, owner_pseudonym, session_keys, thread_key
from tests.support.streams_synthetic import Scenario, ThreadSpec, encode_message, make_identity

IDENTITY = make_identity(layers=4, experts=64, top_k=4)


def canary_spec(owner: str, **kw: Any) -> ThreadSpec:
    return ThreadSpec(owner=owner, thread="thread-c", turns=(("user", 4), ("assistant", 4)),
                      tokens=(CANARY, CANARY), **kw)


def fresh_owner() -> str:
    """A raw owner id no other test uses (tests destroy keys of the session's store)."""
    return f"owner-{uuid.uuid4().hex[:8]}"


# -- the publisher ------------------------------------------------------------------------


class _AllowEveryone:
    """A consent ledger that grants everyone (consent is tested in test_publisher_consent)."""

    def allows(self, owner: str, scope: str, at_ms: int) -> bool:
        return True


@pytest.fixture
def capturing() -> Iterator[tuple[RuntimePublisher, list[Any]]]:
    """A publisher whose drain thread hands records to a list instead of librdkafka."""
    pub = RuntimePublisher(PublisherConfig(bootstrap_servers="127.0.0.1:1",
                                           close_timeout_s=0.1), identity=IDENTITY,
                           consent=_AllowEveryone())
    sent: list[Any] = []
    pub._send = sent.append  # type: ignore[method-assign]
    yield pub, sent
    pub.close(timeout_s=0.1)


def test_publisher_lets_out_no_raw_id_and_no_plaintext_token(
        capturing: tuple[RuntimePublisher, list[Any]]) -> None:
    pub, sent = capturing
    owner = fresh_owner()
    sc = Scenario(LocalPipeline(), identity=IDENTITY)
    for kind, _, record in sc.messages(canary_spec(owner)):
        raw = {**record, "owner": owner, "thread": "thread-c", "sequence_id": f"{owner}#req"}
        (pub.publish_turn if kind == "transcripts" else pub.publish_observation)(raw)
    assert pub.flush(5.0) == 0
    # two turns and one chunk of the five generated tokens (4 canary + footer), which the
    # assistant turn closed: user turn, chunk, assistant turn
    assert len(sent) == 3 and [item.tokens for item in sent] == [1, 5, 1]
    assert b"RouteObservationChunk" in dict(sent[1].headers)["schema"]
    for item in sent:
        wire = item.key + item.value + b"".join(k.encode() + v for k, v in item.headers)
        assert owner.encode() not in wire and b"thread-c" not in wire
        assert hits(wire) == []
        for token in CANARY:  # no single canary token either, in any form
            assert hits(wire, (token,)) == []
        _, record = codec.decode(item.value)
        assert is_pseudonym(record["owner"], "o") and is_pseudonym(record["thread"], "t")
        assert is_pseudonym(record["sequence_id"], "s")
        assert item.key == f"{record['owner']}/{record['thread']}".encode()
    assert sent[0].key == thread_key(owner, "thread-c")


def test_what_the_publisher_seals_the_worker_opens(
        capturing: tuple[RuntimePublisher, list[Any]]) -> None:
    pub, sent = capturing
    owner = fresh_owner()
    sc = Scenario(LocalPipeline(), identity=IDENTITY)
    sc.publish_identity()
    for kind, _, record in sc.messages(canary_spec(owner)):
        raw = {**record, "owner": owner, "thread": "thread-c"}
        (pub.publish_turn if kind == "transcripts" else pub.publish_observation)(raw)
    pub.flush(5.0)
    for item in sent:
        kind = "transcripts" if "TranscriptTurn" in item.headers[0][1].decode() else \
            "observations"
        sc.send(kind, item.key, value=item.value)
    assert sc.pipeline.quarantined == []
    (window,) = sc.pipeline.windows
    assert window["owner"] == owner_pseudonym(owner)


# -- the stream workers -------------------------------------------------------------------


def scenario() -> Scenario:
    sc = Scenario(LocalPipeline(), identity=IDENTITY)
    sc.publish_identity()
    return sc


def test_worker_opens_sealed_records_and_windows_carry_pseudonyms() -> None:
    sc = scenario()
    owner = fresh_owner()
    sc.send_thread(canary_spec(owner))
    assert sc.pipeline.quarantined == []
    (window,) = sc.pipeline.windows
    assert window["owner"] == owner_pseudonym(owner)
    assert is_pseudonym(window["thread"], "t")


def test_destroyed_owner_key_quarantines_metadata_only_as_owner_erased() -> None:
    sc = scenario()
    owner = fresh_owner()
    messages = sc.messages(canary_spec(owner))
    encoded = [(kind, key, encode_message(kind, record)[0]) for kind, key, record in messages]
    session_keys().destroy(owner_pseudonym(owner))
    for kind, key, value in encoded:
        sc.send(kind, key, value=value)
    assert sc.pipeline.windows == []
    assert {q["reason"] for q in sc.pipeline.quarantined} == {"owner_erased"}
    for q in sc.pipeline.quarantined:
        assert q["value"] == b"" and q["reference_only"] and q["value_size"] > 0
        assert q["owner"] == owner_pseudonym(owner) and "destroyed" in q["detail"]
        assert hits(quarantine.encode(q).value) == []


def test_sealed_bytes_moved_to_another_record_do_not_open() -> None:
    sc = scenario()
    owner = fresh_owner()
    turns = [r for k, _, r in sc.messages(canary_spec(owner)) if k == "transcripts"]
    sealed = [encode_message("transcripts", t)[0] for t in turns]
    first = codec.decode(sealed[0])[1]
    second = codec.decode(sealed[1])[1]
    forged = {**second, "sealed_token_ids": first["sealed_token_ids"]}  # same owner, same key
    opener = CaptureOpener(session_keys())
    with pytest.raises(SealingError) as info:
        opener.open("hebrus.flywheel.v1.TranscriptTurn.v2", forged)
    assert info.value.reason == "sealed_field_invalid"
    key = f"{first['owner']}/{first['thread']}".encode()
    sc.send("transcripts", key, value=codec.encode("TranscriptTurn.v2", forged))
    (q,) = sc.pipeline.quarantined
    assert q["reason"] == "sealed_field_invalid" and "does not open" in q["detail"]
    assert hits(quarantine.encode(q).value) == []


def test_damaged_sealed_bytes_are_refused() -> None:
    sc = scenario()
    owner = fresh_owner()
    kind, key, record = next(m for m in sc.messages(canary_spec(owner)) if m[0] == "observations")
    value = encode_message(kind, record)[0]
    _, sealed = codec.decode(value)
    damaged = bytearray(sealed["sealed_routes"])
    damaged[-1] ^= 1
    sc.send(kind, key, value=codec.encode("RouteObservation.v3",
                                          {**sealed, "sealed_routes": bytes(damaged)}))
    assert [q["reason"] for q in sc.pipeline.quarantined] == ["sealed_field_invalid"]


def test_unsealed_old_versions_are_quarantined_metadata_only() -> None:
    sc = scenario()
    raw_owner = fresh_owner()
    for kind, _, record in sc.messages(canary_spec(raw_owner)):
        raw = {**record, "owner": raw_owner, "thread": "thread-c"}  # an old runtime: raw ids
        value, _ = encode_message(kind, raw, seal=False)
        sc.send(kind, f"{raw_owner}/thread-c".encode(), value=value)
    assert {q["reason"] for q in sc.pipeline.quarantined} == {"unsealed_capture"}
    assert sc.pipeline.windows == []
    for q in sc.pipeline.quarantined:
        assert "upgrade the runtime publisher" in q["detail"]
        out = quarantine.encode(q)
        assert q["value"] == b"" and q["owner"] is None and q["source_key"] is None
        assert raw_owner.encode() not in out.value + out.key and hits(out.value) == []


def test_a_record_of_an_owner_unknown_to_the_key_store_is_owner_key_missing(
        tmp_path: Path) -> None:
    other = LocalOwnerKeyStore(tmp_path / "keys", create=True)  # another, empty key store
    sc = Scenario(LocalPipeline(keys=other), identity=IDENTITY)
    sc.publish_identity()
    kind, key, record = next(m for m in sc.messages(canary_spec(fresh_owner())))
    sc.send(kind, key, record)
    (q,) = sc.pipeline.quarantined
    assert q["reason"] == "owner_key_missing" and "FLYWHEEL_OWNER_KEYS" in q["detail"]
    assert q["value"]  # still sealed: kept for when the right key store is found


def test_a_worker_without_a_key_store_stops_instead_of_quarantining(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sc = scenario()
    kind, key, record = next(m for m in sc.messages(canary_spec(fresh_owner())))
    value = encode_message(kind, record)[0]
    monkeypatch.setenv("FLYWHEEL_OWNER_KEYS", str(tmp_path / "nowhere"))
    stage = LocalPipeline().capture
    with pytest.raises(Exception, match="no owner key store"):
        stage.process_safely(topic=stage.topics["transcripts"], partition=0, offset=0,
                             key=key, value=value)


def test_refusal_details_do_not_repeat_token_ids() -> None:
    sc = scenario()
    messages = sc.messages(canary_spec(fresh_owner()))
    first_obs = next(i for i, m in enumerate(messages) if m[0] == "observations")
    kind, key, record = messages[first_obs]
    messages[first_obs] = (kind, key, {**record, "token_id": 2222222})  # not what was said
    for message in messages:
        sc.send(*message)
    (q,) = sc.pipeline.quarantined
    assert q["reason"] == "token_mismatch"
    out = quarantine.encode(q).value
    assert hits(out) == [] and hits(out, (2222222,)) == [] and hits(out, CANARY[:1]) == []
