"""Owner key store, pseudonyms and sealed fields (core.privacy)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from hebrus_flywheel.core.privacy import (
    KeyStoreError,
    LocalOwnerKeyStore,
    OwnerKeyDestroyedError,
    OwnerKeyMissingError,
    Pseudonymizer,
    SealedFieldError,
    fingerprint,
    is_pseudonym,
    keyed_digest,
    open_sealed,
    pack_int32,
    seal,
    unpack_int32,
)


@pytest.fixture()
def store(tmp_path: Path) -> LocalOwnerKeyStore:
    return LocalOwnerKeyStore(tmp_path / "owners", create=True, max_age_s=0)


def test_pseudonyms_are_keyed_stable_and_domain_separated(store, tmp_path):
    names = Pseudonymizer(store)
    owner = names.owner("alice")
    assert is_pseudonym(owner, "o") and "alice" not in owner
    assert names.owner("alice") == owner
    assert names.thread("alice", "t1") != names.thread("bob", "t1")
    assert names.thread("ab", "c") != names.thread("a", "bc")
    assert names.owner("x")[1:] != names.thread("x", "")[1:]
    other = LocalOwnerKeyStore(tmp_path / "elsewhere", create=True)
    assert Pseudonymizer(other).owner("alice") != owner
    assert fingerprint(store) != fingerprint(other)


def test_files_are_private(store):
    names = Pseudonymizer(store)
    store.data_key(names.owner("alice"), create=True)
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    for path in store.directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_readers_never_create(store, tmp_path):
    owner = Pseudonymizer(store).owner("alice")
    with pytest.raises(OwnerKeyMissingError):
        LocalOwnerKeyStore(store.directory).data_key(owner)
    with pytest.raises(KeyStoreError, match="no owner key store"):
        LocalOwnerKeyStore(tmp_path / "absent")


def test_seal_round_trip_and_binding(store):
    names = Pseudonymizer(store)
    alice = store.data_key(names.owner("alice"), create=True)
    bob = store.data_key(names.owner("bob"), create=True)
    sealed = seal(alice, pack_int32([7, -1, 2**31 - 1]), field_name="token_ids", context=b"t/0")
    assert unpack_int32(open_sealed(alice, sealed, field_name="token_ids", context=b"t/0")) \
        == [7, -1, 2**31 - 1]
    for key, name, ctx in ((bob, "token_ids", b"t/0"), (alice, "token_id", b"t/0"),
                           (alice, "token_ids", b"t/1")):
        with pytest.raises(SealedFieldError):
            open_sealed(key, sealed, field_name=name, context=ctx)
    flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(SealedFieldError):
        open_sealed(alice, flipped, field_name="token_ids", context=b"t/0")


def test_keyed_digest_depends_on_owner_key(store):
    names = Pseudonymizer(store)
    alice = store.data_key(names.owner("alice"), create=True)
    bob = store.data_key(names.owner("bob"), create=True)
    digest = keyed_digest(alice, b"abc", purpose="thread")
    assert digest == keyed_digest(alice, b"abc", purpose="thread")
    assert digest != keyed_digest(bob, b"abc", purpose="thread")
    assert digest != keyed_digest(alice, b"abc", purpose="other")


def test_destroy_makes_key_unreadable_everywhere_and_is_idempotent(store):
    owner = Pseudonymizer(store).owner("alice")
    key = store.data_key(owner, create=True)
    sealed = seal(key, b"canary", field_name="f")
    reader = LocalOwnerKeyStore(store.directory, max_age_s=0)
    assert open_sealed(reader.data_key(owner), sealed, field_name="f") == b"canary"
    first = store.destroy(owner)
    assert first.generations == (0,) and not first.already_destroyed
    assert not (store.directory / f"{owner}.json").exists()
    with pytest.raises(OwnerKeyDestroyedError):
        reader.data_key(owner)
    with pytest.raises(OwnerKeyDestroyedError):
        reader.data_key(owner, generation=0)
    assert store.destroy(owner).already_destroyed
    for path in store.directory.iterdir():
        assert key.secret not in path.read_bytes()


def test_new_generation_after_erasure_never_reopens_the_old(store):
    owner = Pseudonymizer(store).owner("alice")
    old = store.data_key(owner, create=True)
    store.destroy(owner)
    new = store.data_key(owner, create=True)
    assert (old.generation, new.generation) == (0, 1) and new.secret != old.secret
    assert store.data_key(owner, generation=1) == new
    with pytest.raises(OwnerKeyDestroyedError):
        store.data_key(owner, generation=0)


def test_half_finished_destroy_is_completed_on_read(store):
    owner = Pseudonymizer(store).owner("alice")
    store.data_key(owner, create=True)
    key_file = store.directory / f"{owner}.json"
    saved = key_file.read_bytes()
    store.destroy(owner)
    key_file.write_bytes(saved)  # as if the shred had not happened before a crash
    key_file.chmod(0o600)
    with pytest.raises(OwnerKeyDestroyedError):
        LocalOwnerKeyStore(store.directory, max_age_s=0).data_key(owner)
    assert not key_file.exists()


def test_owner_argument_must_be_a_pseudonym(store):
    with pytest.raises(ValueError, match="owner pseudonym"):
        store.data_key("alice", create=True)


def test_not_private_store_is_refused(store):
    store.directory.chmod(0o755)
    with pytest.raises(KeyStoreError, match="chmod 700"):
        LocalOwnerKeyStore(store.directory)


def test_loaded_keys_are_bounded_and_an_evicted_one_loads_again(tmp_path, monkeypatch):
    from hebrus_flywheel.core.privacy import keystore

    monkeypatch.setattr(keystore, "KEY_CACHE_ENTRIES", 3)
    cached = LocalOwnerKeyStore(tmp_path / "owners", create=True, max_age_s=60)
    names = Pseudonymizer(cached)
    owners = [names.owner(f"fresh-{i}") for i in range(5)]
    keys = [cached.data_key(owner, create=True) for owner in owners]
    assert len(cached._cache) == 3 and (owners[0], None) not in cached._cache
    # the first owner's key was evicted: read from its file again, the same key
    assert cached.data_key(owners[0]).generation == keys[0].generation
    assert cached.data_key(owners[0]).secret == keys[0].secret
