"""Gates 1 (replay correctness) and 2 (data integrity and leakage)."""

from __future__ import annotations

from typing import Any

from hebrus_flywheel.train.metrics import EVALUATION_SPLITS, SPLITS
from hebrus_flywheel.train.qualify.config import IntegrityGateConfig, ReplayGateConfig
from hebrus_flywheel.train.qualify.data_evidence import (
    DeterminismEvidence,
    FailClosedEvidence,
    IntegrityEvidence,
    ParityEvidence,
)
from hebrus_flywheel.train.qualify.inputs import Identity, QualificationInputs
from hebrus_flywheel.train.qualify.verdict import (
    Check,
    GateVerdict,
    gate_verdict,
    measured,
    unmeasured,
)

GATE1_NAME = "replay correctness"
GATE2_NAME = "data integrity and leakage"


def _parity_checks(p: ParityEvidence | None) -> list[Check]:
    if p is None:
        return [unmeasured("parity", "no replay parity result: prove exact top-k id and rank "
                           "parity against real decode before training")]
    if p.compared == 0:
        checks = [measured("parity", False, "parity compared 0 routes: nothing shows replay "
                           "labels equal decode labels; do not train")]
    elif p.mismatches:
        checks = [measured("parity", False, f"top-k id/rank parity broken on {p.mismatches} of "
                           f"{p.compared} routes ({p.mismatches / p.compared:.4%}): replay is "
                           "not an authoritative label producer; do not train")]
    else:
        checks = [measured("parity", True, f"exact top-k id and rank parity on {p.compared} "
                           "routes")]
    if p.authoritative:
        checks.append(measured("authoritative", True, "parity run declared replay authoritative"))
    elif p.override_reason:
        checks.append(measured("authoritative", True, "parity run was NOT authoritative; "
                               f"accepted by override: {p.override_reason}"))
    else:
        checks.append(measured("authoritative", False, "parity run was not authoritative and no "
                               "override reason was given"))
    for name, value, what in (("token_parity", p.token_mismatches, "token id/position"),
                              ("prefix_digest_parity", p.prefix_digest_mismatches,
                               "accepted-prefix digest")):
        if value is None:
            checks.append(unmeasured(name, f"{what} parity was not reported", required=False))
        else:
            checks.append(measured(name, value == 0, f"{value} {what} mismatch(es)",
                                   required=False))
    return checks


def _determinism_check(d: DeterminismEvidence | None, config: ReplayGateConfig) -> Check:
    if d is None:
        return unmeasured("determinism", "no rebuild was made, so deterministic shards are "
                          "unproven; rebuild the snapshot from its recorded offsets",
                          required=config.require_rebuild)
    if d.identical:
        return measured("determinism", True, f"rebuild digest equals the snapshot digest "
                        f"({d.snapshot_digest[:16]})")
    return measured("determinism", False, f"rebuild digest {d.rebuild_digest[:16]} differs from "
                    f"snapshot digest {d.snapshot_digest[:16]}"
                    + (f" ({d.shards_differing} shard(s) differ)" if d.shards_differing else "")
                    + ": shards are not deterministic")


def _fail_closed_checks(f: FailClosedEvidence | None, config: ReplayGateConfig) -> list[Check]:
    if f is None:
        return [unmeasured("fail_closed", "no quarantine counts: fail-closed behaviour of the "
                           "stream processors is unverified")]
    quarantined = f.total_quarantined
    checks = []
    if f.records_accepted is None:
        checks.append(unmeasured("record_accounting", "records accepted was not reported, so "
                                 "silent drops cannot be excluded", required=False))
    else:
        lost = f.records_seen - f.records_accepted - quarantined
        detail = (f"{f.records_seen} records seen = {f.records_accepted} accepted + "
                  f"{quarantined} quarantined" if lost == 0 else
                  f"{lost:+d} record(s) unaccounted for ({f.records_seen} seen, "
                  f"{f.records_accepted} accepted, {quarantined} quarantined)")
        checks.append(measured("record_accounting", lost == 0, detail, required=False))
    fraction = quarantined / f.records_seen if f.records_seen else 0.0
    if config.max_quarantine_fraction is not None:
        checks.append(measured("quarantine_fraction", fraction <= config.max_quarantine_fraction,
                               f"{fraction:.2%} of records quarantined (bound "
                               f"{config.max_quarantine_fraction:.2%})"))
    if f.opaque_id_reuse is None:
        checks.append(unmeasured("opaque_id_reuse", "cross-owner/generation opaque-id reuse "
                                 "was not checked", required=False))
    else:
        checks.append(measured("opaque_id_reuse", f.opaque_id_reuse == 0,
                               f"{f.opaque_id_reuse} opaque id(s) reused across owners or "
                               "generations", required=False))
    return checks


def _gate1_figures(inputs: QualificationInputs) -> dict[str, Any]:
    p, d, f = inputs.parity, inputs.determinism, inputs.fail_closed
    figures: dict[str, Any] = {"parity": None, "determinism": None, "fail_closed": None}
    if p is not None:
        worst = sorted(p.per_layer_mismatch_rate.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
        figures["parity"] = {
            "authoritative": p.authoritative, "compared": p.compared,
            "mismatches": p.mismatches,
            "parity_rate": None if not p.compared else 1 - p.mismatches / p.compared,
            "per_layer_mismatch_rate": {str(k): r for k, r in
                                        sorted(p.per_layer_mismatch_rate.items())},
            "worst_layers": [{"layer": k, "mismatch_rate": r} for k, r in worst],
            "margin_quantiles": dict(sorted(p.margin_quantiles.items())),
            "override_reason": p.override_reason, "token_mismatches": p.token_mismatches,
            "prefix_digest_mismatches": p.prefix_digest_mismatches, "details": p.details}
    if d is not None:
        figures["determinism"] = {"snapshot_digest": d.snapshot_digest,
                                  "rebuild_digest": d.rebuild_digest, "identical": d.identical,
                                  "shards_compared": d.shards_compared,
                                  "shards_differing": d.shards_differing}
    if f is not None:
        figures["fail_closed"] = {
            "records_seen": f.records_seen, "records_accepted": f.records_accepted,
            "quarantined": f.total_quarantined,
            "quarantined_by_reason": dict(sorted(f.quarantined.items())),
            "quarantine_fraction": f.total_quarantined / f.records_seen if f.records_seen
            else None, "opaque_id_reuse": f.opaque_id_reuse}
    return figures


def gate1_replay(inputs: QualificationInputs, config: ReplayGateConfig) -> GateVerdict:
    """Gate 1: exact parity (authoritative or overridden), a deterministic rebuild and
    fail-closed accounting. Fails closed: if it does not pass, do not train."""
    checks = [*_parity_checks(inputs.parity), _determinism_check(inputs.determinism, config),
              *_fail_closed_checks(inputs.fail_closed, config)]
    return gate_verdict(1, GATE1_NAME, checks, _gate1_figures(inputs))


def _overlap_checks(integrity: IntegrityEvidence, config: IntegrityGateConfig) -> list[Check]:
    overlaps = integrity.all_overlaps()
    checks = []
    strict = {frozenset(pair) for pair in config.owner_disjoint_pairs}
    for kind in ("thread", "owner"):
        found = [o for o in overlaps if o.kind == kind and o.size]
        if kind == "owner":
            informative = [o for o in found if frozenset(o.splits) not in strict]
            found = [o for o in found if frozenset(o.splits) in strict]
            if informative:
                listing = "; ".join(f"{a}/{b}: {o.size}" for o in informative
                                    for a, b in [o.splits])
                checks.append(measured("owner_holdout_overlap", True, "owners shared with a "
                                       f"per-thread holdout (allowed by policy): {listing}"))
        if not found:
            checks.append(measured(f"{kind}_disjoint", True,
                                   f"no {kind} is shared between splits"))
            continue
        listing = "; ".join(f"{a}/{b}: {o.size} ({', '.join(o.ids[:3])}"
                            f"{', ...' if o.size > 3 else ''})"
                            for o in found for a, b in [o.splits])
        allowed = kind == "owner" and config.allow_owner_overlap
        checks.append(measured(f"{kind}_disjoint", allowed,
                               f"{kind}s shared between splits{' (allowed)' if allowed else ''}"
                               f": {listing}"))
    return checks


def _dedup_check(integrity: IntegrityEvidence) -> Check:
    nd = integrity.near_duplicates
    if nd is None:
        return unmeasured("near_duplicates", "cross-split near-duplicate windows were not "
                          "measured; run dedup before sealing")
    left = nd.found - nd.removed
    return measured("near_duplicates", left == 0,
                    f"{nd.found} cross-split near-duplicate window(s) found, {nd.removed} "
                    f"removed" + (f": {left} remain across train/evaluation" if left else ""))


def _identity_check(integrity: IntegrityEvidence, name: str, field_name: str,
                    pinned: str | None, *, required: bool) -> Check:
    splits = integrity.splits
    silent = [s for s in splits if not getattr(splits[s], field_name)]
    if silent:
        return unmeasured(f"{name}_identity", f"{name} digest not reported for split(s) "
                          f"{', '.join(silent)}", required=required)
    seen = sorted({d for s in splits.values() for d in getattr(s, field_name)})
    if len(seen) > 1:
        return measured(f"{name}_identity", False, f"splits carry {len(seen)} different {name} "
                        f"digests ({', '.join(x[:12] for x in seen)})")
    if pinned is not None and seen[0] != pinned:
        return measured(f"{name}_identity", False, f"splits carry {name} digest {seen[0][:12]} "
                        f"but the run pins {pinned[:12]}")
    return measured(f"{name}_identity", True, f"every split carries the same {name} digest "
                    f"({seen[0][:12]})")


def _identity_checks(integrity: IntegrityEvidence, identity: Identity) -> list[Check]:
    return [_identity_check(integrity, "runtime", "identity_digests", identity.runtime,
                            required=True),
            _identity_check(integrity, "teacher", "teacher_digests", identity.teacher,
                            required=False),
            _identity_check(integrity, "tokenizer", "tokenizer_digests", identity.tokenizer,
                            required=False)]


def _coverage_checks(integrity: IntegrityEvidence, config: IntegrityGateConfig) -> list[Check]:
    checks = []
    for dim in config.coverage_dimensions:
        silent = [s for s, item in integrity.splits.items() if not item.coverage.get(dim)]
        if silent:
            checks.append(unmeasured(f"coverage_{dim}", f"coverage by {dim} not reported for "
                                     f"{', '.join(silent)}", required=False))
        else:
            checks.append(measured(f"coverage_{dim}", True, f"coverage by {dim} reported",
                                   required=False))
    return checks


def _authorization_check(integrity: IntegrityEvidence, config: IntegrityGateConfig) -> Check:
    a = integrity.authorization
    if a is None:
        return unmeasured("authorization", "no authorization/deletion policy evidence given",
                          required=config.require_authorization)
    if not a.approved:
        return measured("authorization", False, f"replay is not authorized under {a.policy}")
    if a.production_transcripts and a.deletion_supported is not True:
        return measured("authorization", False, "production transcripts without deletion "
                        f"support under {a.policy}")
    return measured("authorization", True, f"authorized under {a.policy}")


def _gate2_figures(integrity: IntegrityEvidence) -> dict[str, Any]:
    order = sorted(integrity.splits, key=SPLITS.index)
    nd = integrity.near_duplicates
    return {
        "splits": {s: {"owners": integrity.splits[s].owners,
                       "threads": integrity.splits[s].threads,
                       "windows": integrity.splits[s].windows,
                       "identity_digests": list(integrity.splits[s].identity_digests),
                       "teacher_digests": list(integrity.splits[s].teacher_digests),
                       "tokenizer_digests": list(integrity.splits[s].tokenizer_digests)}
                   for s in order},
        "overlaps": [{"kind": o.kind, "splits": list(o.splits), "count": o.size,
                      "ids": list(o.ids)} for o in integrity.all_overlaps()],
        "near_duplicates": None if nd is None else {
            "found": nd.found, "removed": nd.removed, "threshold": nd.threshold,
            "method": nd.method},
        "coverage": {s: {dim: dict(sorted(c.items())) for dim, c in
                         sorted(integrity.splits[s].coverage.items())} for s in order},
        "authorization": None if integrity.authorization is None else {
            k: getattr(integrity.authorization, k) for k in
            ("policy", "approved", "production_transcripts", "deletion_supported",
             "retention_days")},
    }


def gate2_integrity(inputs: QualificationInputs, config: IntegrityGateConfig) -> GateVerdict:
    """Gate 2: split disjointness by thread (and owner), no cross-split near duplicates,
    one pinned identity across splits; coverage and authorization reported."""
    integrity = inputs.integrity
    if integrity is None:
        return gate_verdict(2, GATE2_NAME, [unmeasured(
            "integrity", "no split-integrity evidence: leakage cannot be excluded")], {})
    checks = []
    if "train" not in integrity.splits or not set(integrity.splits) & set(EVALUATION_SPLITS):
        checks.append(unmeasured("splits", "integrity evidence needs the train split and at "
                                 f"least one evaluation split; got {sorted(integrity.splits)}"))
    checks += _overlap_checks(integrity, config)
    checks.append(_dedup_check(integrity))
    checks += _identity_checks(integrity, inputs.identity)
    checks += _coverage_checks(integrity, config)
    checks.append(_authorization_check(integrity, config))
    return gate_verdict(2, GATE2_NAME, checks, _gate2_figures(integrity))
