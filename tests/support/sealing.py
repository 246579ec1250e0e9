"""The owner key store of a test session, and capture records sealed with it.

``tests/conftest.py`` points ``$FLYWHEEL_OWNER_KEYS`` at a private temporary directory
before anything runs, so the records tests build here, the publisher, in-process
pipelines and the worker subprocesses (which inherit the environment) all use one store.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer, is_pseudonym
from hebrus_flywheel.streams import routes
from hebrus_flywheel.streams.sealing import seal_observation, seal_turn


@functools.cache
def test_keys() -> LocalOwnerKeyStore:
    """The session's writer key store (creates owner keys on first use)."""
    return LocalOwnerKeyStore(create=True)


def names() -> Pseudonymizer:
    return Pseudonymizer(test_keys())


def owner_pseudonym(raw_owner: str) -> str:
    return names().owner(raw_owner)


def thread_pseudonym(raw_owner: str, raw_thread: str) -> str:
    return names().thread(raw_owner, raw_thread)


def sealed(kind: str, record: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(schema, record)``: a transcripts or observations record (pseudonymous ids,
    plaintext fields) sealed as the runtime publisher seals it. A forged owner that is
    not a pseudonym is sealed under the key of its pseudonym (workers refuse it)."""
    owner = str(record["owner"])
    key = test_keys().data_key(owner if is_pseudonym(owner, "o") else owner_pseudonym(owner),
                               create=True)
    if kind == "transcripts":
        return "TranscriptTurn.v2", seal_turn(test_keys(), record, key=key)
    packed = record if routes.is_packed(record) else routes.to_v2(record)
    return "RouteObservation.v3", seal_observation(test_keys(), packed, key=key)


def thread_key(raw_owner: str, raw_thread: str) -> bytes:
    """The Kafka key (``owner/thread`` pseudonyms) of a thread given by its raw ids."""
    return f"{owner_pseudonym(raw_owner)}/{thread_pseudonym(raw_owner, raw_thread)}".encode()
