"""Sealed fields: AES-256-GCM under an owner's data key (crypto-shredding).

A sealed field is ``b"\\x01" + nonce (12 bytes) + ciphertext + tag (16 bytes)``. The
associated data binds it to its key id, its field name and a caller-chosen context
(for example the thread pseudonym and token ordinal), so sealed bytes moved to another
record, field or owner do not open. Destroying the owner's data key makes every sealed
copy, in every topic, changelog and file, unreadable: that is the erasure.

:func:`keyed_digest` is the owner-keyed replacement for plain SHA-256 digests of
content (for example a thread digest): without the owner's key the digest cannot be
recomputed from a guessed text, and after erasure it links to nothing.

Legend: ``DataKey.key_id`` is ``<owner pseudonym>/<generation>``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hebrus_flywheel.core.privacy.errors import SealedFieldError

SEAL_VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_OVERHEAD = 1 + NONCE_BYTES + TAG_BYTES


@dataclass(frozen=True, kw_only=True)
class DataKey:
    """One generation of one owner's data key. Never logged, never written into data."""

    owner: str
    """The owner's pseudonym."""
    generation: int
    """Bumps each time the owner is erased and later creates data again."""
    secret: bytes = field(repr=False)
    """The 256-bit AES key."""

    def __post_init__(self) -> None:
        if len(self.secret) != 32:
            raise ValueError(f"DataKey.secret must be 32 bytes, got {len(self.secret)}")
        if self.generation < 0:
            raise ValueError(f"DataKey.generation must be >= 0, got {self.generation}")

    @property
    def key_id(self) -> str:
        return f"{self.owner}/{self.generation}"


def _aad(key: DataKey, field_name: str, context: bytes) -> bytes:
    return b"\0".join((b"hebrus-flywheel/sealed/v1", key.key_id.encode(),
                       field_name.encode(), context))


def seal(key: DataKey, plaintext: bytes, *, field_name: str, context: bytes = b"") -> bytes:
    """Encrypt ``plaintext`` for ``field_name`` of a record described by ``context``."""
    nonce = os.urandom(NONCE_BYTES)
    body = AESGCM(key.secret).encrypt(nonce, plaintext, _aad(key, field_name, context))
    return bytes((SEAL_VERSION,)) + nonce + body


def seal_deterministic(key: DataKey, plaintext: bytes, *, field_name: str,
                       context: bytes = b"") -> bytes:
    """:func:`seal` with a synthetic nonce: the first 12 bytes of an HMAC-SHA256, under a
    subkey of ``key``, of the associated data and the plaintext (the SIV construction).

    Equal inputs under one key give equal bytes, so a record re-derived from the same
    content (a rebuild, an at-least-once repeat) is byte-identical. This is safe for
    AES-GCM: a nonce repeats only when key, associated data and plaintext all repeat
    (up to a 2**-96 HMAC collision, birthday-bound at 2**48 distinct fields per key),
    and then the ciphertext is the same one, so no keystream is ever reused for two
    different plaintexts. What it reveals is equality of two sealed fields under one
    owner's key, which the record ids that travel with them reveal already. Opened by
    :func:`open_sealed` like any sealed field.
    """
    aad = _aad(key, field_name, context)
    subkey = hmac.digest(key.secret, b"hebrus-flywheel/siv-nonce/v1", "sha256")
    mac = hmac.new(subkey, len(aad).to_bytes(8, "little") + aad, hashlib.sha256)
    mac.update(plaintext)
    nonce = mac.digest()[:NONCE_BYTES]
    return bytes((SEAL_VERSION,)) + nonce + AESGCM(key.secret).encrypt(nonce, plaintext, aad)


def open_sealed(key: DataKey, sealed: bytes, *, field_name: str, context: bytes = b"") -> bytes:
    """The plaintext of :func:`seal`; :class:`SealedFieldError` if it does not open."""
    if len(sealed) < SEAL_OVERHEAD or sealed[0] != SEAL_VERSION:
        raise SealedFieldError(
            f"sealed field {field_name!r} is {len(sealed)} bytes with version byte "
            f"{sealed[:1].hex() or 'none'}; expected a version-{SEAL_VERSION} sealed field")
    nonce, body = sealed[1:1 + NONCE_BYTES], sealed[1 + NONCE_BYTES:]
    try:
        return AESGCM(key.secret).decrypt(nonce, body, _aad(key, field_name, context))
    except InvalidTag as exc:
        raise SealedFieldError(
            f"sealed field {field_name!r} does not open under key {key.key_id}: it was sealed "
            "under another key or context, or its bytes are damaged") from exc


def keyed_digest(key: DataKey, data: bytes, *, purpose: str) -> str:
    """Hex HMAC-SHA256 of ``data`` under a subkey of ``key`` for ``purpose``."""
    subkey = hmac.digest(key.secret, b"hebrus-flywheel/digest/v1\0" + purpose.encode(), "sha256")
    return hmac.new(subkey, data, hashlib.sha256).hexdigest()


def pack_int32(values: Sequence[int]) -> bytes:
    """Little-endian int32 bytes of ``values`` (token ids)."""
    packed = array("i", values)
    if packed.itemsize != 4:  # pragma: no cover - every platform we run on
        return struct.pack(f"<{len(values)}i", *values)
    return packed.tobytes() if _LITTLE else _swapped(packed)


def unpack_int32(data: bytes) -> list[int]:
    """Inverse of :func:`pack_int32`."""
    if len(data) % 4:
        raise SealedFieldError(f"packed int32 field has {len(data)} bytes, not a multiple of 4")
    packed = array("i")
    packed.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        packed.byteswap()
    return packed.tolist()


def _swapped(packed: array) -> bytes:  # pragma: no cover - big-endian hosts only
    copy = array("i", packed)
    copy.byteswap()
    return copy.tobytes()


_LITTLE = struct.pack("=i", 1) == struct.pack("<i", 1)
