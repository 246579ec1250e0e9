"""The owner key store of a test session, and capture records sealed with it.

``tests/conftest.py`` points ``$FLYWHEEL_OWNER_KEYS`` at a private temporary directory
before anything runs, so the records tests build here, the publisher, in-process
pipelines and the worker subprocesses (which inherit the environment) all use one store.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from typing import Any

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer, is_pseudonym
from hebrus_flywheel.streams import routes
from hebrus_flywheel.streams.sealing import seal_observation, seal_turn


@functools.cache
def session_keys() -> LocalOwnerKeyStore:
    """The session's writer key store (creates owner keys on first use)."""
    return LocalOwnerKeyStore(create=True)


def names() -> Pseudonymizer:
    return Pseudonymizer(session_keys())


def owner_pseudonym(raw_owner: str) -> str:
    return names().owner(raw_owner)


def thread_pseudonym(raw_owner: str, raw_thread: str) -> str:
    return names().thread(raw_owner, raw_thread)


def sealed(kind: str, record: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(schema, record)``: a transcripts or observations record (pseudonymous ids,
    plaintext fields) sealed as the runtime publisher seals it. A forged owner that is
    not a pseudonym is sealed under the key of its pseudonym (workers refuse it)."""
    owner = str(record["owner"])
    key = session_keys().data_key(owner if is_pseudonym(owner, "o") else owner_pseudonym(owner),
                               create=True)
    if kind == "transcripts":
        return "TranscriptTurn.v2", seal_turn(session_keys(), record, key=key)
    packed = record if routes.is_packed(record) else routes.to_v2(record)
    return "RouteObservation.v3", seal_observation(session_keys(), packed, key=key)


def thread_key(raw_owner: str, raw_thread: str) -> bytes:
    """The Kafka key (``owner/thread`` pseudonyms) of a thread given by its raw ids."""
    return f"{owner_pseudonym(raw_owner)}/{thread_pseudonym(raw_owner, raw_thread)}".encode()


CANARY = (3141592, 2718281, 1618033, 1414213)
"""A token sequence to plant and then look for (below int32 and any tiny vocabulary)."""


def _zigzag_varint(value: int) -> bytes:
    n, out = (value << 1) ^ (value >> 63), bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def canary_forms(tokens: tuple[int, ...] = CANARY) -> dict[str, bytes]:
    """The byte forms a token sequence takes in files, messages and logs."""
    return {
        "int32-le": struct.pack(f"<{len(tokens)}i", *tokens),
        "avro-varint": b"".join(_zigzag_varint(t) for t in tokens),
        "decimal": ", ".join(map(str, tokens)).encode(),
        "decimal-compact": ",".join(map(str, tokens)).encode(),
        "decimal-first": str(tokens[0]).encode(),
    }


def hits(data: bytes, tokens: tuple[int, ...] = CANARY) -> list[str]:
    """Which forms of ``tokens`` occur in ``data`` (``[]``: none)."""
    return [name for name, form in canary_forms(tokens).items() if form in data]
