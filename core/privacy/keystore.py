"""The owner key store: the pseudonym HMAC key and one data key per owner.

Everything a record says about a person is sealed under that person's data key
(:mod:`.envelope`), and every id is a pseudonym under the HMAC key
(:mod:`.pseudonyms`). Erasing an owner is destroying their data key: every sealed copy
anywhere (capture, window, changelog and quarantine topics, files) becomes unreadable.

:class:`OwnerKeyStore` is the interface; it has the shape of Vault transit (``/hmac``,
a named key per owner, key deletion) and of a cloud KMS (generate data key, schedule
key deletion). The default, :class:`LocalOwnerKeyStore`, keeps keys in private files:

``$FLYWHEEL_HOME/keys/owners/`` (``$FLYWHEEL_OWNER_KEYS`` overrides), mode 0700::

    pseudonym-key.json          the HMAC key (0600)
    <owner>.json                the owner's live data key and its generation (0600)
    <owner>.erased.json         tombstone: generations destroyed and when (no key)

Writers (the runtime publisher) create keys; readers never do, so a reader on another
machine without the store gets :class:`KeyStoreError`, not a fresh empty key. Readers
cache a key for at most ``max_age_s`` seconds, so a running worker stops using a
destroyed key within that time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac as _hmac
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hebrus_flywheel.core.privacy.envelope import DataKey
from hebrus_flywheel.core.privacy.errors import (
    KeyStoreError,
    OwnerKeyDestroyedError,
    OwnerKeyMissingError,
)
from hebrus_flywheel.core.privacy.pseudonyms import OWNER, is_pseudonym
from hebrus_flywheel.core.settings import flywheel_home

OWNER_KEYS_ENV = "FLYWHEEL_OWNER_KEYS"
KEY_FORMAT = "hebrus-flywheel-owner-key/v1"
PSEUDONYM_FILE = "pseudonym-key.json"


@dataclass(frozen=True, kw_only=True)
class Destruction:
    """What :meth:`OwnerKeyStore.destroy` did; safe to log (no key material)."""

    owner: str
    generations: tuple[int, ...]
    """Every generation of the owner's key that is now destroyed (earlier ones too)."""
    destroyed_at_ms: int
    already_destroyed: bool
    """True when no live key existed (a repeated or resumed erasure)."""


@runtime_checkable
class OwnerKeyStore(Protocol):
    """Pseudonym HMAC and per-owner data keys; never reveals the HMAC key."""

    @property
    def name(self) -> str: ...

    def hmac(self, message: bytes) -> bytes: ...

    def data_key(self, owner: str, *, generation: int | None = None,
                 create: bool = False) -> DataKey: ...

    def destroy(self, owner: str) -> Destruction: ...

    def destroyed_generations(self, owner: str) -> tuple[int, ...]: ...


KEY_CACHE_ENTRIES = 4096
"""Most data keys a :class:`LocalOwnerKeyStore` keeps loaded (each is re-read from its
file after ``max_age_s`` anyway); the oldest loaded goes first."""


def default_owner_keys_dir() -> Path:
    """``$FLYWHEEL_OWNER_KEYS``, else ``$FLYWHEEL_HOME/keys/owners``."""
    override = os.environ.get(OWNER_KEYS_ENV)
    return Path(override) if override else flywheel_home() / "keys" / "owners"


def _write_private(path: Path, body: dict[str, object], *, replace: bool) -> bool:
    """Write ``body`` as JSON to ``path`` (0600) atomically; with ``replace=False`` the
    first writer wins and False says someone else's file was kept."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, json.dumps(body, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shred(path: Path) -> None:
    """Overwrite a key file with zeros, fsync, then unlink it."""
    try:
        size = path.stat().st_size
        with open(path, "r+b") as fh:
            fh.write(b"\0" * size)
            fh.flush()
            os.fsync(fh.fileno())
        path.unlink()
    except FileNotFoundError:
        return
    _fsync_dir(path.parent)


class LocalOwnerKeyStore:
    """The default key store: private files under one directory (see module doc)."""

    name = "local-file"

    def __init__(self, directory: Path | None = None, *, create: bool = False,
                 max_age_s: float = 5.0) -> None:
        self.directory = Path(directory) if directory is not None else default_owner_keys_dir()
        self.max_age_s = max_age_s
        self._cache: dict[tuple[str, int | None], tuple[float, DataKey]] = {}
        if create:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._check_directory()
        pseudonym_path = self.directory / PSEUDONYM_FILE
        if create and not pseudonym_path.exists():
            _write_private(pseudonym_path, {"format": KEY_FORMAT, "kind": "pseudonym",
                                            "key": _b64(os.urandom(32))}, replace=False)
        self._pseudonym_key = self._secret(self._read(pseudonym_path))

    # -- the interface ----------------------------------------------------------------

    def hmac(self, message: bytes) -> bytes:
        return _hmac.digest(self._pseudonym_key, message, "sha256")

    def data_key(self, owner: str, *, generation: int | None = None,
                 create: bool = False) -> DataKey:
        """The owner's live key (or the given generation); ``create`` makes a new
        generation when none is live (writers only)."""
        _check_owner(owner)
        cached = self._cache.get((owner, generation))
        if cached is not None and time.monotonic() - cached[0] < self.max_age_s:
            return cached[1]
        key = self._load(owner, generation, create=create)
        self._cache.pop((owner, generation), None)
        self._cache[(owner, generation)] = (time.monotonic(), key)
        if len(self._cache) > KEY_CACHE_ENTRIES:  # bounded: fresh owners keep coming
            del self._cache[next(iter(self._cache))]  # the longest unread (reloads if due)
        return key

    def destroy(self, owner: str) -> Destruction:
        _check_owner(owner)
        live = self._live_generation(owner)
        destroyed = set(self.destroyed_generations(owner))
        if live is not None:
            destroyed.add(live)
        now_ms = int(time.time() * 1000)
        # the tombstone first: a crash between the two steps leaves a key that the
        # tombstone already declares destroyed, and a rerun shreds it
        _write_private(self._tombstone_path(owner), {
            "format": KEY_FORMAT, "kind": "tombstone", "owner": owner,
            "generations": sorted(destroyed), "destroyed_at_ms": now_ms}, replace=True)
        _shred(self._key_path(owner))
        self._cache = {k: v for k, v in self._cache.items() if k[0] != owner}
        return Destruction(owner=owner, generations=tuple(sorted(destroyed)),
                           destroyed_at_ms=now_ms, already_destroyed=live is None)

    def destroyed_generations(self, owner: str) -> tuple[int, ...]:
        _check_owner(owner)
        path = self._tombstone_path(owner)
        if not path.exists():
            return ()
        return tuple(int(g) for g in self._read(path).get("generations", []))

    def owners(self) -> list[str]:
        """Pseudonyms of every owner with a live key."""
        return sorted(p.name[:-5] for p in self.directory.glob(f"{OWNER}*.json")
                      if is_pseudonym(p.name[:-5], OWNER))

    # -- files ------------------------------------------------------------------------

    def _key_path(self, owner: str) -> Path:
        return self.directory / f"{owner}.json"

    def _tombstone_path(self, owner: str) -> Path:
        return self.directory / f"{owner}.erased.json"

    def _load(self, owner: str, generation: int | None, *, create: bool) -> DataKey:
        destroyed = self.destroyed_generations(owner)
        path = self._key_path(owner)
        if not path.exists() and create and generation is None:
            fresh = max(destroyed, default=-1) + 1
            _write_private(path, {"format": KEY_FORMAT, "kind": "data", "owner": owner,
                                  "generation": fresh, "key": _b64(os.urandom(32))},
                           replace=False)
        if path.exists():
            body = self._read(path)
            key = DataKey(owner=owner, generation=int(body["generation"]),
                          secret=self._secret(body))
            if key.generation in destroyed:
                _shred(path)  # a destroy that crashed half-way: finish it
            elif generation is None or generation == key.generation:
                return key
        if (generation is None and destroyed) or generation in destroyed:
            which = generation if generation is not None else max(destroyed)
            raise OwnerKeyDestroyedError(
                f"owner {owner}'s data key (generation {which}) was destroyed by an erasure; "
                "what it sealed cannot be read")
        raise OwnerKeyMissingError(
            f"no data key for owner {owner} (generation {generation}) in {self.directory}; "
            f"point ${OWNER_KEYS_ENV} at the key store the data was captured with")

    def _live_generation(self, owner: str) -> int | None:
        path = self._key_path(owner)
        return int(self._read(path)["generation"]) if path.exists() else None

    def _check_directory(self) -> None:
        try:
            mode = stat.S_IMODE(self.directory.stat().st_mode)
        except FileNotFoundError as exc:
            raise KeyStoreError(
                f"no owner key store at {self.directory}: run the capture (which creates it) "
                f"on this machine, or point ${OWNER_KEYS_ENV} at the key store") from exc
        if mode & 0o077:
            raise KeyStoreError(f"the owner key store {self.directory} has mode {mode:04o}; it "
                                f"must be private: run `chmod 700 {self.directory}`")

    def _read(self, path: Path) -> dict[str, Any]:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
            body = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise KeyStoreError(f"the key store file {path} is missing; restore the owner key "
                                "store from its backup") from exc
        except (OSError, ValueError) as exc:
            raise KeyStoreError(f"the key store file {path} is unreadable ({exc!r})") from exc
        if mode & 0o077:
            raise KeyStoreError(f"the key store file {path} has mode {mode:04o}; it must be "
                                f"private: run `chmod 600 {path}`")
        if not isinstance(body, dict) or body.get("format") != KEY_FORMAT:
            raise KeyStoreError(f"the key store file {path} is not a {KEY_FORMAT} file")
        return body

    @staticmethod
    def _secret(body: dict[str, Any]) -> bytes:
        try:
            key = base64.b64decode(str(body["key"]), validate=True)
        except (KeyError, ValueError) as exc:
            raise KeyStoreError("a key store file holds no valid base64 key") from exc
        if len(key) != 32:
            raise KeyStoreError(f"a key store file holds a {len(key) * 8}-bit key, not 256")
        return key


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _check_owner(owner: str) -> None:
    if not is_pseudonym(owner, OWNER):
        raise ValueError(f"owner must be an owner pseudonym (o + 32 hex digits), got {owner!r}; "
                         "pseudonymize raw ids with Pseudonymizer(store).owner(raw)")


def fingerprint(store: OwnerKeyStore) -> str:
    """A short, stable id of the store's pseudonym key (not the key): two processes
    with the same fingerprint make the same pseudonyms."""
    return hashlib.sha256(store.hmac(b"hebrus-flywheel/keystore-fingerprint")).hexdigest()[:16]
