"""The consent ledger's pure core: entries, the one ``allows`` rule, the ledger state."""

from __future__ import annotations

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.consent import (
    Consent,
    ConsentLedger,
    grant,
    parse_scopes,
    revoke,
    scope_for_split,
)
from hebrus_flywheel.streams.exceptions import ConsentError

OWNER = "o" + "ab" * 16
T0 = 1_767_225_600_000
DAY = 86_400_000


def _grant(scopes: str = "capture,train", **kw: object) -> Consent:
    args: dict[str, object] = {"expires_at_ms": T0 + DAY, "policy_version": "p1",
                               "granted_by": "test", "granted_at_ms": T0,
                               "recorded_at_ms": T0}
    args.update(kw)
    return grant(str(args.pop("owner", OWNER)), scopes, **args)  # type: ignore[arg-type]


def test_a_grant_allows_its_scopes_within_its_validity_only() -> None:
    entry = _grant()
    assert entry.allows("capture", T0) and entry.allows("train", T0 + DAY - 1)
    assert not entry.allows("evaluate", T0)  # not granted
    assert not entry.allows("capture", T0 - 1)  # before the grant took effect
    assert not entry.allows("capture", T0 + DAY)  # expired (exclusive)
    assert entry.status(T0 - 1) == "pending"
    assert entry.status(T0) == "live"
    assert entry.status(T0 + DAY) == "expired"


def test_a_revoke_allows_nothing() -> None:
    entry = revoke(OWNER, reason="asked", revoked_at_ms=T0)
    assert not any(entry.allows(s, T0 + 1) for s in ("capture", "train", "evaluate"))
    assert entry.status(T0) == "revoked"


def test_entries_round_trip_through_avro() -> None:
    for entry in (_grant(), revoke(OWNER, reason="asked", revoked_at_ms=T0)):
        assert Consent.decode(entry.encode()) == entry


@pytest.mark.parametrize("change, field", [
    ({"expires_at_ms": T0}, "expires_at_ms"),
    ({"policy_version": " "}, "policy_version"),
    ({"granted_by": ""}, "granted_by"),
    ({"owner": ""}, "owner"),
])
def test_invalid_grants_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        _grant(**change)


def test_scopes_are_checked() -> None:
    assert parse_scopes("train, capture,train") == ("capture", "train")
    with pytest.raises(ConfigError, match="capture, train, evaluate"):
        parse_scopes("capture,share")
    with pytest.raises(ConfigError, match="non-empty"):
        parse_scopes("")


def test_scope_of_a_split() -> None:
    assert scope_for_split("train") == "train"
    for split in ("validation", "temporal_holdout", "stress_holdout", "runtime_holdout"):
        assert scope_for_split(split) == "evaluate"


def test_the_latest_entry_per_owner_decides() -> None:
    ledger = ConsentLedger()
    key = OWNER.encode()
    assert not ledger.allows(OWNER, "capture", T0)  # unknown owner: no
    ledger.apply(key, _grant().encode())
    assert ledger.allows(OWNER, "capture", T0 + 1)
    ledger.apply(key, revoke(OWNER, reason="asked", revoked_at_ms=T0 + 5).encode())
    assert not ledger.allows(OWNER, "capture", T0 + 1)  # revoked: nothing, even earlier
    ledger.apply(key, _grant("capture", granted_at_ms=T0 + 10).encode())
    assert ledger.allows(OWNER, "capture", T0 + 10)
    ledger.apply(key, None)  # tombstone
    assert not ledger.allows(OWNER, "capture", T0 + 10)


def test_garbage_and_mismatched_keys_fail_closed() -> None:
    ledger = ConsentLedger()
    ledger.apply(OWNER.encode(), _grant().encode())
    ledger.apply(OWNER.encode(), b"not avro")
    assert not ledger.allows(OWNER, "capture", T0 + 1)
    other = "o" + "cd" * 16
    ledger.apply(OWNER.encode(), _grant(owner=other).encode())  # key says another owner
    assert not ledger.allows(other, "capture", T0 + 1)
    assert not ledger.allows(OWNER, "capture", T0 + 1)
    assert ledger.invalid == 2


def test_another_schema_is_not_a_consent_entry() -> None:
    from tests.unit.test_codec import identity
    with pytest.raises(ConsentError, match="not a consent entry"):
        Consent.decode(codec.encode("RuntimeIdentity", identity()))
