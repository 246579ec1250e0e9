"""Sealed windows (Window.v2), sealed internal-topic fields and sealed table values:
round trips, determinism, no plaintext, erasure reads as erased, other failures refuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer, seal_deterministic
from hebrus_flywheel.core.privacy.envelope import open_sealed
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.owner_seal import (
    Erased,
    OwnerSealer,
    RawOwnerError,
    SealOpenError,
    open_fields,
    seal_fields,
)
from hebrus_flywheel.streams.processors.common import header_key, instance_id, turn_key
from hebrus_flywheel.streams.processors.state_codec import SealedState, dumps, loads
from hebrus_flywheel.streams.processors.state_seal import StateSealer, owner_of_key
from hebrus_flywheel.streams.processors.window_seal import (
    SealedBytesError,
    encode_window,
    open_window,
    readable_window,
    seal_window,
)
from tests.support.windows import make_window

CANARY = [9_100_001 + i * 7 for i in range(16)]  # token ids that occur nowhere else


@pytest.fixture
def keys(tmp_path: Path) -> LocalOwnerKeyStore:
    return LocalOwnerKeyStore(tmp_path / "owners", create=True, max_age_s=0)


@pytest.fixture
def owner(keys: LocalOwnerKeyStore) -> str:
    pseudonym = Pseudonymizer(keys).owner("alice")
    keys.data_key(pseudonym, create=True)
    return pseudonym


def _sealer(keys: LocalOwnerKeyStore) -> OwnerSealer:
    reader = LocalOwnerKeyStore(keys.directory, max_age_s=0)
    return OwnerSealer(lambda: reader)


def _window(owner: str) -> dict[str, Any]:
    return make_window(token_ids=CANARY, anchors=[14, 15], identity_id="i" * 64,
                       owner=owner, thread="t" + "0" * 32)


def _plaintext_forms(tokens: list[int]) -> list[bytes]:
    """The canary as int32 LE, as Avro zigzag varints, and as decimal text."""
    def zigzag(n: int) -> bytes:
        z, out = (n << 1) ^ (n >> 63), bytearray()
        while z > 0x7F:
            out.append((z & 0x7F) | 0x80)
            z >>= 7
        out.append(z)
        return bytes(out)

    return [b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[:4]),
            b"".join(zigzag(t) for t in tokens[:4]),
            ",".join(map(str, tokens[:4])).encode(), str(tokens[0]).encode()]


def test_sealed_window_round_trips_and_holds_no_plaintext(keys, owner):
    sealer = _sealer(keys)
    plain = _window(owner)
    value, record = encode_window(plain, sealer)
    assert not any(form in value for form in _plaintext_forms(CANARY))
    schema, decoded = codec.decode(value)
    assert schema.version == 2 and decoded == record
    opened = readable_window(2, decoded, sealer)
    assert opened["token_ids"] == CANARY
    assert {k: v for k, v in opened.items() if k not in ("window_id", "content_digest",
                                                         "thread_digest")} == {
        k: v for k, v in plain.items() if k not in ("window_id", "content_digest",
                                                    "thread_digest")}
    assert record["thread_digest"] != plain["thread_digest"]  # keyed, not the plain SHA-256


def test_sealing_is_deterministic_per_key_and_differs_across_owners(keys, owner):
    sealer = _sealer(keys)
    first, again = encode_window(_window(owner), sealer), encode_window(_window(owner), sealer)
    assert first[0] == again[0]  # a repeat (or a rebuild) is byte-identical
    other = Pseudonymizer(keys).owner("bob")
    keys.data_key(other, create=True)
    theirs = encode_window(_window(other), sealer)[1]
    assert theirs["window_id"] != first[1]["window_id"]
    assert theirs["thread_digest"] != first[1]["thread_digest"]


def test_siv_nonce_depends_on_content_and_context(keys, owner):
    key = keys.data_key(owner)
    a = seal_deterministic(key, b"abc", field_name="f", context=b"1")
    assert a == seal_deterministic(key, b"abc", field_name="f", context=b"1")
    assert a[1:13] != seal_deterministic(key, b"abd", field_name="f", context=b"1")[1:13]
    assert a[1:13] != seal_deterministic(key, b"abc", field_name="f", context=b"2")[1:13]
    assert open_sealed(key, a, field_name="f", context=b"1") == b"abc"


def test_erased_owner_window_reads_as_erased_and_damage_is_refused(keys, owner):
    sealer = _sealer(keys)
    record = seal_window(_window(owner), keys.data_key(owner))
    sealed = record["token_ids_sealed"]
    # flip bits rather than overwrite: the last byte may already be any value
    damaged = {**record, "token_ids_sealed": sealed[:-1] + bytes([sealed[-1] ^ 0xFF])}
    with pytest.raises(SealedBytesError):
        open_window(damaged, sealer)
    keys.destroy(owner)
    assert isinstance(open_window(record, sealer), Erased)


def test_missing_key_store_is_refused_not_erased(tmp_path, keys, owner):
    record = seal_window(_window(owner), keys.data_key(owner))
    nowhere = OwnerSealer(lambda: LocalOwnerKeyStore(tmp_path / "absent"))
    with pytest.raises(SealOpenError, match="key store"):
        open_window(record, nowhere)
    elsewhere = LocalOwnerKeyStore(tmp_path / "other", create=True)
    with pytest.raises(SealOpenError):
        open_window(record, OwnerSealer(lambda: elsewhere))


def test_raw_owners_are_refused(keys):
    with pytest.raises(RawOwnerError, match="pseudonym"):
        encode_window(_window("owner-1"), _sealer(keys))
    with pytest.raises(RawOwnerError, match="pseudonym"):
        seal_fields({"owner": "owner-1", "digest": "ab"}, ["digest"], _sealer(keys),
                    context="x")


def test_internal_topic_fields_seal_and_open(keys, owner):
    sealer = _sealer(keys)
    summary = {"iid": "x", "owner": owner, "digest": "ab" * 32, "minhash": CANARY, "split": "t"}
    wire = seal_fields(summary, ("digest", "minhash"), sealer, context="x")
    text = json.dumps(wire).encode()
    assert b"abab" not in text and not any(f in text for f in _plaintext_forms(CANARY)[2:])
    assert open_fields(json.loads(text), sealer, context="x") == summary
    with pytest.raises(SealOpenError):
        open_fields(json.loads(text), sealer, context="y")  # moved to another thread
    keys.destroy(owner)
    assert isinstance(open_fields(json.loads(text), sealer, context="x"), Erased)


def test_table_values_of_owners_are_sealed_others_stay_plain(keys, owner):
    state = StateSealer(_sealer(keys), "capture-state")
    iid = instance_id(owner, "t" + "1" * 32, 0)
    tkey, hkey = turn_key(iid, 0), header_key(iid)
    assert owner_of_key(tkey) == owner and owner_of_key("n\x1fseq") is None
    assert owner_of_key("s\x1f" + owner + "/thread") == owner
    value = {"token_ids": CANARY, "segments": [("text", 0, 16, True)]}
    sealed = state.seal(tkey, value)
    assert isinstance(sealed, SealedState)
    wire = dumps(sealed)
    assert not any(form in wire for form in _plaintext_forms(CANARY))
    restored = loads(wire)
    assert restored == sealed and state.open(tkey, restored) == value
    with pytest.raises(SealOpenError):
        state.open(hkey, restored)  # a value moved to another key does not open
    assert state.seal("n\x1fseq", 7) == 7 and state.seal(tkey, None) is None
    keys.destroy(owner)
    assert isinstance(state.open(tkey, restored), Erased)
    assert state.seal(tkey, value) is None  # never plaintext: a tombstone


def test_a_restored_value_is_checked_as_it_would_open_without_decoding(keys, owner):
    state = StateSealer(_sealer(keys), "capture-state")
    iid = instance_id(owner, "t" + "1" * 32, 0)
    tkey, hkey = turn_key(iid, 0), header_key(iid)
    sealed = loads(dumps(state.seal(tkey, {"token_ids": CANARY})))
    assert state.check(tkey, sealed) is None
    with pytest.raises(SealOpenError):
        state.check(hkey, sealed)  # moved to another key
    damaged = SealedState(owner=sealed.owner, generation=sealed.generation,
                          body=sealed.body[:-1] + bytes([sealed.body[-1] ^ 1]))
    with pytest.raises(SealOpenError):
        state.check(tkey, damaged)
    keys.destroy(owner)
    assert isinstance(state.check(tkey, sealed), Erased)


def test_window_of_erased_owner_is_quarantined_metadata_only(keys, owner, monkeypatch):
    from hebrus_flywheel.consumers.intake import classify, quarantine_record
    from hebrus_flywheel.consumers.labels import SourceRef

    sealer = _sealer(keys)
    value, record = encode_window(_window(owner), sealer)
    headers = codec.kafka_headers(codec.default_registry().get("Window.v2"))
    key = f"{owner}/{record['thread']}".encode()
    ok = classify(value, headers, key, split="train", identity_id="i" * 64,
                  vocab_size=10**8, opener=sealer)
    assert ok.accepted and ok.window is not None and ok.window["token_ids"] == CANARY
    keys.destroy(owner)
    verdict = classify(value, headers, key, split="train", identity_id="i" * 64,
                       vocab_size=10**8, opener=sealer)
    assert verdict.reason == "owner_erased"
    rec = quarantine_record(verdict, SourceRef(topic="w", partition=0, offset=3), value=value,
                            key=key, headers=headers, max_value_bytes=1 << 20)
    assert rec["reference_only"] is True and rec["value"] == b"" and rec["owner"] is None
    assert rec["source_key"] is None and rec["value_size"] == len(value)


def test_rebuild_from_capture_regenerates_sealed_windows_byte_identical(keys, owner):
    from hebrus_flywheel.consumers.capture_check import CaptureCheck, FreshWindows

    sealer = _sealer(keys)
    on_topic, _ = encode_window(_window(owner), sealer)  # what the worker wrote
    fresh = FreshWindows(capture_end_offsets={}, config_digests={"0" * 64}, sealer=sealer)
    fresh.add(_window(owner))  # what the in-process chain cuts again, in plaintext
    check = CaptureCheck(fresh=fresh)
    check.observe("w/0@0", on_topic)
    assert (check.regenerated, check.bytes_identical, check.missing) == (1, 1, [])
    keys.destroy(owner)
    erased = FreshWindows(capture_end_offsets={}, config_digests=set(), sealer=sealer)
    erased.add(_window(owner))
    assert erased.erased == 1 and erased.windows == {}


def test_accounting_reads_sealed_headers_and_an_erased_owner_has_no_open_state(
        keys, owner, monkeypatch):
    from hebrus_flywheel.streams.processors.accounting import CAPTURE_STATE, apply_changelog

    monkeypatch.setenv("FLYWHEEL_OWNER_KEYS", str(keys.directory))
    state = StateSealer(_sealer(keys), CAPTURE_STATE)
    iid = instance_id(owner, "t" + "2" * 32, 0)
    header = {"status": "open", "owner": owner, "thread": "t" + "2" * 32, "generation": 0}
    value = dumps(state.seal(header_key(iid), header))
    key = json.dumps(header_key(iid)).encode()
    in_state: dict[str, Any] = {}
    assert apply_changelog(in_state, key, value) is True
    assert in_state == {iid: (owner, "t" + "2" * 32, 0)}
    keys.destroy(owner)
    from hebrus_flywheel.streams.processors import window_seal

    monkeypatch.setattr(window_seal, "_DEFAULT", {})  # a new process: no key cached
    assert apply_changelog(in_state, key, value) is True and in_state == {}


def test_a_window_cut_without_its_plaintext_digest_seals_to_the_same_bytes(keys, owner):
    """The worker's window stage leaves the plaintext ``content_digest`` empty
    (``WindowStage(sealed=True)``): sealing gives the record its own digest, so the bytes
    written are those of the fully digested window."""
    sealer = _sealer(keys)
    digested = _window(owner)
    undigested = {**digested, "content_digest": ""}
    assert encode_window(undigested, sealer)[0] == encode_window(digested, sealer)[0]
