"""The streams worker's consent check, in memory: a capture record whose owner has no
live capture grant at its wall time is quarantined ``no_consent``, metadata only."""

from __future__ import annotations

from hebrus_flywheel.streams import quarantine
from hebrus_flywheel.streams.consent import ConsentLedger, grant, revoke
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from tests.support.sealing import owner_pseudonym as pz
from tests.support.streams_synthetic import Scenario, ThreadSpec

T0 = 1_767_225_600_000


def _pipeline(ledger: ConsentLedger) -> Scenario:
    return Scenario(LocalPipeline(
        ProcessorConfig(),
        capture_consent=lambda owner, at_ms: ledger.allows(owner, "capture", at_ms)))


def test_records_without_a_live_capture_grant_are_quarantined_by_reference() -> None:
    ledger = ConsentLedger()
    ledger.entries[pz("ok")] = grant(pz("ok"), "capture", granted_at_ms=0, expires_at_ms=2 * T0,
                                 policy_version="p", granted_by="t")
    ledger.entries[pz("train-only")] = grant(pz("train-only"), "train", granted_at_ms=0,
                                         expires_at_ms=2 * T0, policy_version="p",
                                         granted_by="t")
    ledger.entries[pz("late")] = grant(pz("late"), "capture", granted_at_ms=T0 + 3_600_000,
                                   expires_at_ms=2 * T0, policy_version="p", granted_by="t")
    ledger.entries[pz("gone")] = revoke(pz("gone"), reason="asked", revoked_at_ms=T0)
    sc = _pipeline(ledger)
    sc.publish_identity()
    for owner in ("ok", "nobody", "train-only", "late", "gone"):
        for kind, key, record in sc.messages(ThreadSpec(owner=owner, thread="t", start_ms=T0)):
            sc.send(kind, key, record)
    refused = sc.pipeline.quarantined
    assert {q["reason"] for q in refused} == {"no_consent"}
    assert len(refused) == 4 * (len(sc.messages(ThreadSpec(owner="x", thread="t"))))
    for q in refused:  # metadata only: nothing of the record but its size and digest
        assert q["reference_only"] and q["value"] == b"" and q["value_size"] > 0
        assert q["owner"] is None and q["thread"] is None and q["source_key"] is None
        assert q["source_headers"] == [] and "wall_time_ms=" in q["detail"]
        assert quarantine.encode(q).key.count(b":") == 2  # topic:partition:offset, no owner
    assert {w["owner"] for w in sc.pipeline.windows} == {pz("ok")}
    assert sc.pipeline.counters.get("quarantine", "no_consent") == len(refused)
