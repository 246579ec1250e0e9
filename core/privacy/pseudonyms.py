"""Pseudonymous identities: owner, thread and request ids as keyed HMACs.

Raw ids never leave the runtime. The runtime publisher replaces each with an
HMAC-SHA256 under the key store's pseudonym key (:meth:`OwnerKeyStore.hmac`), domain
separated by kind so an owner id and a thread id with the same text never collide. A
thread pseudonym is keyed by its owner too: two owners' ``thread-1`` are two threads.

Pseudonyms are stable for a given key store, so splitting by owner, consent lookups
and ``flywheel erase --owner RAW`` all find the same owner without storing the raw id.
They are not reversible without the key, and they are short enough to print: a kind
letter and 32 hex digits (128 bits of the HMAC).
"""

from __future__ import annotations

import re
from typing import Protocol

OWNER, THREAD, SEQUENCE = "o", "t", "s"
_PATTERN = re.compile(r"^[ots][0-9a-f]{32}$")


class HmacKeyHolder(Protocol):
    """Anything that computes an HMAC under a key it never reveals (the key store, or
    Vault transit's ``/hmac`` endpoint)."""

    def hmac(self, message: bytes) -> bytes: ...


def _tag(kind: str, *parts: str) -> bytes:
    # length-prefixed parts: ("ab", "c") and ("a", "bc") hash differently
    body = b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
    return b"hebrus-flywheel/pseudonym/v1\0" + kind.encode() + b"\0" + body


class Pseudonymizer:
    """Turns raw ids into pseudonyms with one key holder's HMAC."""

    def __init__(self, keys: HmacKeyHolder) -> None:
        self._keys = keys

    def _make(self, kind: str, *parts: str) -> str:
        return kind + self._keys.hmac(_tag(kind, *parts))[:16].hex()

    def owner(self, raw_owner: str) -> str:
        return self._make(OWNER, raw_owner)

    def thread(self, raw_owner: str, raw_thread: str) -> str:
        return self._make(THREAD, raw_owner, raw_thread)

    def sequence(self, raw_owner: str, raw_sequence_id: str) -> str:
        return self._make(SEQUENCE, raw_owner, raw_sequence_id)


def is_pseudonym(value: str, kind: str | None = None) -> bool:
    """True when ``value`` has the shape of a pseudonym (of ``kind`` if given)."""
    return bool(_PATTERN.match(value)) and (kind is None or value[0] == kind)
