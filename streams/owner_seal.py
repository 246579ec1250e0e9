"""Sealing what the stream workers write, under each owner's data key (crypto-shredding).

The stream workers hold an owner's plaintext token ids in memory only. Everything they
write to Kafka that carries or fingerprints those tokens is sealed (AES-256-GCM,
:mod:`core.privacy.envelope`) or keyed (owner-keyed HMAC) under the owner's data key:

* window records (``Window.v2``, :mod:`streams.processors.window_seal`);
* the values of the processor tables' changelogs (:mod:`streams.processors.state_codec`);
* the content fingerprints on the internal topics: a completed thread's digest and
  MinHash signature on ``…-threads-v1``, the digest on ``…-decisions-v1``
  (:func:`seal_fields` / :func:`open_fields`).

Destroying an owner's key (``flywheel erase``) makes every one of those copies
unreadable: a reader treats them as erased (:class:`Erased`), never as a crash.

:class:`OwnerSealer` is the one place that turns an owner into a key. It opens the key
store as a *reader* (it never creates keys) and only when a first owner needs one, so a
worker or a replay of old ``Window.v1`` topics runs without a key store.

Raw owners (ids that are not pseudonyms) have no key. They are refused
(:class:`RawOwnerError`, the worker stops): there is no switch that writes an owner's
content unsealed. (The capture stage already quarantines capture records whose ids are
not pseudonyms, so a raw owner reaching a sealer is a bug.)
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.core.privacy import (
    DataKey,
    KeyStoreError,
    LocalOwnerKeyStore,
    OwnerKeyDestroyedError,
    OwnerKeyStore,
    PrivacyError,
    is_pseudonym,
    open_sealed,
    seal,
)

SEALED_TAG = "$sealed"


class RawOwnerError(FlywheelError):
    """A value of an owner that is not a pseudonym was about to be written unsealed."""


class SealOpenError(FlywheelError):
    """A sealed value does not open for a reason other than an erasure: a missing key
    store or key, damaged bytes, bytes moved to another record. Fail closed."""


class Erased:
    """What a sealed value of an erased owner (destroyed key) reads back as."""

    __slots__ = ("generation", "owner")

    def __init__(self, owner: str, generation: int) -> None:
        self.owner, self.generation = owner, generation

    def __repr__(self) -> str:
        return f"Erased(owner={self.owner!r}, generation={self.generation})"


class OwnerSealer:
    """Data keys of owners for sealing and opening, from a reader key store.

    ``store_factory`` builds the key store on first use (default: the local store of
    ``$FLYWHEEL_OWNER_KEYS`` / ``$FLYWHEEL_HOME``, as a reader).
    """

    def __init__(self, store_factory: Callable[[], OwnerKeyStore] | None = None) -> None:
        self._factory = store_factory or LocalOwnerKeyStore
        self._store: OwnerKeyStore | None = None

    @property
    def store(self) -> OwnerKeyStore:
        if self._store is None:
            try:
                self._store = self._factory()
            except KeyStoreError as exc:
                raise SealOpenError(f"cannot open the owner key store: {exc}") from exc
        return self._store

    def sealing_key(self, owner: str) -> DataKey:
        """The owner's live key; :class:`RawOwnerError` for an id that is not an owner
        pseudonym. A destroyed or missing key raises
        :class:`OwnerKeyDestroyedError` / :class:`SealOpenError`."""
        if not is_pseudonym(owner, "o"):
            raise RawOwnerError(
                f"owner {owner[:40]!r} is not an owner pseudonym, so it has no data key and "
                "its content cannot be sealed; capture must publish pseudonymous owners "
                "(through RuntimePublisher, which pseudonymizes raw ids)")
        try:
            return self.store.data_key(owner)
        except OwnerKeyDestroyedError:
            raise
        except PrivacyError as exc:
            raise SealOpenError(f"no data key to seal owner {owner}'s content: {exc}") from exc

    def opening_key(self, owner: str, generation: int) -> DataKey | Erased:
        """The key of ``generation``, or :class:`Erased` when an erasure destroyed it;
        :class:`SealOpenError` for any other reason it is not there."""
        try:
            return self.store.data_key(owner, generation=generation)
        except OwnerKeyDestroyedError:
            return Erased(owner, generation)
        except (PrivacyError, ValueError) as exc:
            raise SealOpenError(f"cannot open content of owner {owner!r}: {exc}") from exc


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def seal_fields(obj: Mapping[str, Any], names: Sequence[str], sealer: OwnerSealer, *,
                context: str) -> dict[str, Any]:
    """``obj`` with the fields ``names`` moved into one sealed ``$sealed`` entry (JSON
    ready), under the key of ``obj["owner"]``; bound to ``context`` (e.g. the thread
    generation id). A raw owner is refused (:class:`RawOwnerError`)."""
    key = sealer.sealing_key(str(obj["owner"]))
    inner = json.dumps({n: obj[n] for n in names}, separators=(",", ":")).encode()
    out = {k: v for k, v in obj.items() if k not in names}
    out[SEALED_TAG] = {"g": key.generation, "f": list(names), "c": _b64(
        seal(key, inner, field_name="fields", context=context.encode()))}
    return out


def open_fields(obj: Mapping[str, Any], sealer: OwnerSealer, *,
                context: str) -> dict[str, Any] | Erased:
    """The inverse of :func:`seal_fields` (objects without ``$sealed`` pass unchanged);
    :class:`Erased` when the owner's key was destroyed, :class:`SealOpenError` when the
    entry does not open for another reason."""
    entry = obj.get(SEALED_TAG)
    if entry is None:
        return dict(obj)
    try:
        generation, names, body = int(entry["g"]), list(entry["f"]), entry["c"]
        sealed = base64.b64decode(str(body).encode("ascii"), validate=True)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise SealOpenError(f"malformed {SEALED_TAG} entry: {exc!r}") from exc
    key = sealer.opening_key(str(obj.get("owner")), generation)
    if isinstance(key, Erased):
        return key
    try:
        inner = json.loads(open_sealed(key, sealed, field_name="fields",
                                       context=context.encode()))
    except (PrivacyError, ValueError) as exc:
        raise SealOpenError(f"sealed fields of {context!r} do not open: {exc}") from exc
    if not isinstance(inner, dict) or sorted(inner) != sorted(names):
        raise SealOpenError(f"sealed fields of {context!r} are not the fields {names}")
    out = {k: v for k, v in obj.items() if k != SEALED_TAG}
    out.update(inner)
    return out
