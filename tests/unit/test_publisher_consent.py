"""The runtime publisher's consent hook, without a broker: no live capture grant, no
record; refusals are counted; an unreadable ledger refuses; the opt-out is loud."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from hebrus_flywheel.streams.consent import ConsentLedger, grant, revoke
from hebrus_flywheel.streams.consent_book import CaptureGate
from hebrus_flywheel.streams.exceptions import ConsentError
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from tests.support.consent import ledger_allowing
from tests.support.sealing import owner_pseudonym as pz
from tests.unit.test_publisher import IDENTITY, UNREACHABLE, observation

T0 = 1_767_225_600_000


def _publisher(consent: Any = None, **change: Any) -> RuntimePublisher:
    pub = RuntimePublisher(PublisherConfig(bootstrap_servers=UNREACHABLE, close_timeout_s=0.1,
                                           **change), identity=IDENTITY, consent=consent)
    pub._send = lambda item: None  # type: ignore[method-assign]
    return pub


@pytest.fixture
def ledger() -> Iterator[ConsentLedger]:
    yield ConsentLedger()


def test_owner_without_grant_is_not_published(ledger: ConsentLedger) -> None:
    pub = _publisher(ledger)
    try:
        assert not pub.publish_observation(observation(0, wall_time_ms=T0))
        ledger.entries[pz("o1")] = grant(pz("o1"), "train,evaluate", granted_at_ms=0,
                                         expires_at_ms=2 * T0, policy_version="p",
                                         granted_by="t")
        assert not pub.publish_observation(observation(0, wall_time_ms=T0))  # no capture scope
        ledger.entries[pz("o1")] = grant(pz("o1"), "capture", granted_at_ms=0, expires_at_ms=2 * T0,
                                     policy_version="p", granted_by="t")
        assert pub.publish_observation(observation(0, wall_time_ms=T0))
        assert not pub.publish_observation(observation(1, wall_time_ms=2 * T0))  # expired
        ledger.entries[pz("o1")] = revoke(pz("o1"), reason="asked", revoked_at_ms=T0)
        assert not pub.publish_observation(observation(1, wall_time_ms=T0 + 1))
        stats = pub.stats()
    finally:
        pub.close(timeout_s=0.1)
    # the one accepted observation is in its thread's open chunk, or enqueued in it already
    assert stats.refused_no_consent == 4 and stats.tokens_buffered + stats.enqueued == 1
    assert stats.consent_checked and not stats.rejected_invalid


def test_unreadable_ledger_refuses_and_is_retried_later() -> None:
    class Broken:
        calls = 0

        def allows(self, owner: str, scope: str, at_ms: int) -> bool:
            Broken.calls += 1
            raise ConsentError("ledger down")

    gate = CaptureGate(Broken(), retry_s=60.0)
    assert not gate.allows("o1", T0) and not gate.allows("o1", T0)
    assert Broken.calls == 1  # the second answer did not wait for the ledger again


def test_invalid_records_are_refused_before_consent_is_asked() -> None:
    pub = _publisher(ledger_allowing([]))
    try:
        with pytest.raises(Exception, match="owner"):
            pub.publish_observation(observation(0, owner=""))
        assert pub.stats().refused_no_consent == 0
    finally:
        pub.close(timeout_s=0.1)


def test_opting_out_is_loud(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        pub = _publisher(consent_check=False)
    try:
        assert pub.publish_observation(observation(0))
        assert not pub.stats().consent_checked
    finally:
        pub.close(timeout_s=0.1)
    assert "WITHOUT the consent check" in caplog.text
