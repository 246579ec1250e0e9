"""Consent for tests: every path that captures data grants it first, explicitly.

``ledger_allowing`` is an in-memory ledger for publishers built without a broker;
``grant_owners`` writes real grants to a (prefixed) consent topic on the test broker.
Grants from here take effect at ``FROM_MS`` (before any synthetic record's wall time)
and last until ``UNTIL_MS``.

The ledger is keyed by owner pseudonyms (what capture records carry once the runtime
publisher pseudonymized them). Tests name owners by their raw ids, and some hand-built
``Window.v1`` records still carry raw ids, so an owner given here that is not a
pseudonym is granted under both its raw id and its pseudonym in the session's key store.
"""

from __future__ import annotations

from collections.abc import Iterable

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.privacy import is_pseudonym
from hebrus_flywheel.streams.consent import CONSENT_TOPIC, SCOPES, ConsentLedger, grant, revoke
from hebrus_flywheel.streams.consent_book import write_entries
from tests.support.sealing import owner_pseudonym

FROM_MS = 0
UNTIL_MS = 4_102_444_800_000  # 2100-01-01
POLICY = "test-policy-v1"


def _keyed(owners: Iterable[str]) -> set[str]:
    out = set()
    for owner in owners:
        out.add(owner)
        if not is_pseudonym(owner, "o"):
            out.add(owner_pseudonym(owner))
    return out


def consent_entries(owners: Iterable[str], scopes: Iterable[str] = SCOPES, *,
                    granted_at_ms: int = FROM_MS, expires_at_ms: int = UNTIL_MS) -> list:
    return [grant(owner, tuple(scopes), granted_at_ms=granted_at_ms, expires_at_ms=expires_at_ms,
                  policy_version=POLICY, granted_by="tests") for owner in sorted(_keyed(owners))]


def ledger_allowing(owners: Iterable[str], scopes: Iterable[str] = SCOPES) -> ConsentLedger:
    ledger = ConsentLedger()
    for entry in consent_entries(owners, scopes):
        ledger.entries[entry.owner] = entry
    return ledger


def grant_owners(target: kafka.KafkaTarget, owners: Iterable[str], *, prefix: str = "",
                 scopes: Iterable[str] = SCOPES, granted_at_ms: int = FROM_MS,
                 expires_at_ms: int = UNTIL_MS) -> None:
    """Grant ``scopes`` to every owner on ``<prefix>flywheel.consent.ledger.v1``."""
    entries = consent_entries(owners, scopes, granted_at_ms=granted_at_ms,
                              expires_at_ms=expires_at_ms)
    if entries:
        write_entries(target, entries, topic=prefix + CONSENT_TOPIC)


def revoke_owners(target: kafka.KafkaTarget, owners: Iterable[str], *, prefix: str = "",
                  reason: str = "test revoke") -> None:
    write_entries(target, [revoke(o, reason=reason) for o in sorted(_keyed(owners))],
                  topic=prefix + CONSENT_TOPIC)
