"""Gates 1 (replay correctness) and 2 (data integrity and leakage)."""

from __future__ import annotations

from typing import Any

from hebrus_flywheel.train.metrics import EVALUATION_SPLITS, SPLITS
from hebrus_flywheel.train.qualify.config import IntegrityGateConfig, ReplayGateConfig
from hebrus_flywheel.train.qualify.data_evidence import (
    DeterminismEvidence,
    FailClosedEvidence,
    IntegrityEvidence,
    OpaqueIds,
    ParityEvidence,
    drill_summary,
)
from hebrus_flywheel.train.qualify.inputs import Identity, QualificationInputs
from hebrus_flywheel.train.qualify.verdict import (
    Check,
    GateVerdict,
    gate_verdict,
    judged,
    unmeasured,
)

GATE1_NAME = "replay correctness"
GATE2_NAME = "data integrity and leakage"


def _parity_checks(p: ParityEvidence | None) -> list[Check]:
    if p is None:
        return [unmeasured("parity", "no replay parity result: prove exact top-k id and rank "
                           "parity against real decode before training (`flywheel parity`)",
                           threshold="all routes equal"),
                unmeasured("token_parity", "no replay parity result: token ids and positions "
                           "of replay were not compared with the captured decode",
                           threshold="all anchors equal")]
    checks = [_route_check(p), _authoritative_check(p), _token_check(p)]
    if p.prefix_digest_mismatches is None:
        checks.append(unmeasured("prefix_digest_parity", "accepted-prefix digest parity was "
                                 "not reported (no speculative captures)", threshold="0",
                                 required=False))
    else:
        n = p.prefix_digest_mismatches
        checks.append(judged("prefix_digest_parity", n == 0, required=False,
                             figure=f"{n} accepted-prefix digest mismatch(es)", threshold="0"))
    return checks


def _route_check(p: ParityEvidence) -> Check:
    threshold = "all"
    if p.compared == 0:
        return judged("parity", False, figure="exact top-k id and rank parity: 0 routes "
                      "compared", threshold="all of at least one",
                      reason="nothing shows replay labels equal decode labels; do not train")
    agree = p.compared - p.mismatches
    figure = (f"exact top-k id and rank parity {_n(agree)}/{_n(p.compared)} (layer, token) "
              "routes")
    if p.mismatches:
        return judged("parity", False, figure=figure, threshold=threshold,
                      reason=f"{_n(p.mismatches)} differ ({p.mismatches / p.compared:.4%}); "
                      "replay is not an authoritative label producer; do not train")
    return judged("parity", True, figure=figure, threshold=threshold)


def _authoritative_check(p: ParityEvidence) -> Check:
    threshold = "authoritative or an override"
    if p.authoritative:
        return judged("authoritative", True, figure="the parity run declared replay "
                      "authoritative", threshold=threshold)
    if p.override_reason:
        return judged("authoritative", True, figure="the parity run was NOT authoritative",
                      threshold=threshold, reason=f"passed by override: {p.override_reason}")
    return judged("authoritative", False, figure="the parity run was not authoritative",
                  threshold=threshold, reason="no override reason was given")


def _n(value: int) -> str:
    return f"{value:,}"


def _token_check(p: ParityEvidence) -> Check:
    """Replayed token ids and positions versus the captured decode windows, per anchor."""
    n = p.tokens_compared
    if n is None or p.token_mismatches is None or p.position_mismatches is None:
        return unmeasured("token_parity", "the parity result does not compare token ids and "
                          "positions; reseal (or rerun `flywheel parity`) with this version",
                          threshold="all anchors equal")
    if n == 0:
        return judged("token_parity", False, figure="token id and position parity: 0 anchors "
                      "compared", threshold="all of at least one")
    ok = p.token_mismatches == 0 and p.position_mismatches == 0
    return judged("token_parity", ok, figure=f"token ids equal at "
                  f"{_n(n - p.token_mismatches)}/{_n(n)} anchors and positions at "
                  f"{_n(n - p.position_mismatches)}/{_n(n)}", threshold="all",
                  reason="" if ok else "replay did not see the tokens decode saw; do not train")


def _opaque_id_check(found: tuple[OpaqueIds, ...] | None) -> Check:
    if not found:
        return unmeasured("opaque_id_reuse", "cross-owner/generation opaque-id reuse was not "
                          "checked; the snapshot's split manifests carry the ids",
                          threshold="0")
    reused = sum(o.reused for o in found)
    parts = "; ".join(f"{_n(o.reused)} of {_n(o.checked)} {o.kind}s" for o in found)
    examples = [e for o in found for e in o.examples][:3]
    return judged("opaque_id_reuse", reused == 0, figure=f"opaque ids under more than one "
                  f"owner, thread or generation: {parts}", threshold="0",
                  reason="" if reused == 0 else f"e.g. {'; '.join(examples)}")


def _determinism_check(d: DeterminismEvidence | None, config: ReplayGateConfig) -> Check:
    threshold = "rebuild content digest equal to the snapshot's" + (
        "" if config.require_rebuild else " (optional: require_rebuild is false)")
    if d is None:
        return unmeasured("determinism", "no rebuild was made, so deterministic shards are "
                          "unproven; rebuild the snapshot from its recorded offsets",
                          threshold=threshold, required=config.require_rebuild)
    figure = (f"rebuild digest {d.rebuild_digest[:16]} vs snapshot digest "
              f"{d.snapshot_digest[:16]}"
              + (f", {d.shards_differing} shard(s) differ" if d.shards_differing else ""))
    return judged("determinism", d.identical, figure=figure, threshold=threshold,
                  reason="" if d.identical else "shards are not deterministic")


def _fail_closed_checks(f: FailClosedEvidence | None, config: ReplayGateConfig) -> list[Check]:
    if f is None:
        return [unmeasured("fail_closed", "no quarantine counts: fail-closed behaviour of the "
                           "stream processors is unverified; give the streams summary",
                           threshold="every record accepted or quarantined")]
    quarantined = f.total_quarantined
    checks = []
    if f.accounting:
        checks.append(_ledger_check(f.accounting))
    elif f.records_accepted is None:
        checks.append(unmeasured("record_accounting", "records accepted was not reported, so "
                                 "silent drops cannot be excluded; the streams summary "
                                 "carries it", threshold="seen = accepted + quarantined",
                                 required=False))
    else:
        lost = f.records_seen - f.records_accepted - quarantined
        checks.append(judged(
            "record_accounting", lost == 0, required=False,
            figure=f"{_n(f.records_seen)} records seen, {_n(f.records_accepted)} accepted, "
            f"{_n(quarantined)} quarantined ({lost:+d} unaccounted)",
            threshold="seen = accepted + quarantined (0 unaccounted)",
            reason="" if lost == 0 else "records were dropped silently"))
    fraction = quarantined / f.records_seen if f.records_seen else 0.0
    bound = config.max_quarantine_fraction
    if bound is not None:
        checks.append(judged("quarantine_fraction", fraction <= bound,
                             figure=f"{fraction:.2%} of records quarantined",
                             threshold=f"<= {bound:.2%} (max_quarantine_fraction)",
                             reason="" if fraction <= bound else "a systemic capture problem"))
    return checks


def _ledger_check(ledger: dict[str, int]) -> Check:
    """Record accounting measured by the streams ledger: every consumed capture record in
    exactly one class, none unaccounted."""
    lost = ledger["unaccounted"]
    parts = ", ".join(f"{_n(n)} {name}" for name, n in sorted(ledger.items())
                      if n and name not in ("records", "unaccounted"))
    return judged(
        "record_accounting", lost == 0, required=False,
        figure=f"{_n(ledger['records'])} consumed capture records: {parts or 'none'}; "
        f"{_n(lost)} unaccounted",
        threshold="every consumed record windowed, quarantined, dropped as a duplicate or "
        "pending in an open window (0 unaccounted)",
        reason="" if lost == 0 else "consumed records reached no output and no open state")


def _gate1_figures(inputs: QualificationInputs) -> dict[str, Any]:
    p, d, f = inputs.parity, inputs.determinism, inputs.fail_closed
    figures: dict[str, Any] = {"parity": None, "determinism": None, "fail_closed": None,
                               "opaque_ids": None}
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
            "override_reason": p.override_reason, "tokens_compared": p.tokens_compared,
            "token_mismatches": p.token_mismatches,
            "position_mismatches": p.position_mismatches,
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
            "accounting": dict(sorted(f.accounting.items())) or None,
            "quarantine_fraction": f.total_quarantined / f.records_seen if f.records_seen
            else None}
    figures["opaque_ids"] = None if inputs.opaque_ids is None else [
        {"kind": o.kind, "checked": o.checked, "reused": o.reused, "source": o.source,
         "examples": list(o.examples)} for o in inputs.opaque_ids]
    return figures


def gate1_replay(inputs: QualificationInputs, config: ReplayGateConfig) -> GateVerdict:
    """Gate 1: exact parity (authoritative or overridden), a deterministic rebuild and
    fail-closed accounting. Fails closed: if it does not pass, do not train."""
    checks = [*_parity_checks(inputs.parity), _candidate_parity_check(inputs.candidates),
              _determinism_check(inputs.determinism, config),
              *_fail_closed_checks(inputs.fail_closed, config),
              _opaque_id_check(inputs.opaque_ids)]
    return gate_verdict(1, GATE1_NAME, checks, _gate1_figures(inputs))


CANDIDATE_RATES = ("candidate_ids_exact", "candidate_rank_exact",
                   "accepted_prefix_digest_parity")


def _candidate_parity_check(candidates: Any) -> Check:
    """Candidate-path replay against step-by-step cached decode over the same prefixes and
    paths: ids and rank per (candidate row, layer) and accepted-prefix digests per path."""
    threshold = "candidate ids, rank and accepted-prefix digests all at 1.000 (non-empty)"
    parity = None if candidates is None else candidates.parity
    if parity is None:
        return unmeasured("candidate_parity", "no candidate-path snapshot with a parity "
                          "result was given (`flywheel replay candidates`, then qualify "
                          "--candidate-snapshot)", threshold=threshold,
                          required=candidates is not None)
    rates = {k: parity.get(k) for k in CANDIDATE_RATES}
    pairs, paths = int(parity.get("pairs") or 0), int(parity.get("paths") or 0)
    ok = bool(parity.get("authoritative")) and pairs > 0 and all(r == 1.0 for r in rates.values())
    shown = ", ".join(f"{k} {'n/a' if r is None else f'{float(r):.4f}'}" for k, r in rates.items())
    return judged("candidate_parity", ok, figure=f"candidate-path parity vs step-by-step "
                  f"decode: {shown} over {_n(pairs)} (row, layer) pairs and {_n(paths)} paths",
                  threshold=threshold, reason="" if ok else "candidate rows differ from decode "
                  "(or nothing was compared): do not train Model B on them")


def _pairs(config: IntegrityGateConfig) -> str:
    return ", ".join(f"{a}/{b}" for a, b in config.owner_disjoint_pairs) or "no pair"


def _listing(found: list[Any]) -> str:
    return "; ".join(f"{a}/{b}: {_n(o.size)} ({', '.join(o.ids[:3])}"
                     f"{', ...' if o.size > 3 else ''})" for o in found for a, b in [o.splits])


def _thread_check(overlaps: list[Any]) -> Check:
    found = [o for o in overlaps if o.kind == "thread" and o.size]
    shared = sum(o.size for o in found)
    return judged("thread_disjoint", not found,
                  figure=f"{_n(shared)} thread(s) shared between splits"
                  + (f" ({_listing(found)})" if found else ""),
                  threshold="0 threads shared between any two splits",
                  reason="" if not found else "a thread in two splits leaks its context into "
                  "evaluation")


def _owner_checks(overlaps: list[Any], config: IntegrityGateConfig) -> list[Check]:
    strict = {frozenset(pair) for pair in config.owner_disjoint_pairs}
    found = [o for o in overlaps if o.kind == "owner" and o.size]
    informative = [o for o in found if frozenset(o.splits) not in strict]
    found = [o for o in found if frozenset(o.splits) in strict]
    checks = []
    if informative:
        checks.append(judged(
            "owner_holdout_overlap", True,
            figure=f"owners shared with a per-thread holdout: {_listing(informative)}",
            threshold="reported only: holdouts are chosen per thread "
            "(IntegrityGateConfig.owner_disjoint_pairs)", reason="allowed by the split policy"))
    allowed = config.allow_owner_overlap
    threshold = (f"0 owners shared between {_pairs(config)}"
                 + (" (allow_owner_overlap: any)" if allowed else ""))
    shared = sum(o.size for o in found)
    reason = "" if not found else ("allowed by allow_owner_overlap" if allowed else
                                   "an owner on both sides leaks their style into evaluation")
    checks.append(judged("owner_disjoint", allowed or not found,
                         figure=f"{_n(shared)} owner(s) shared between {_pairs(config)}"
                         + (f" ({_listing(found)})" if found else ""),
                         threshold=threshold, reason=reason))
    return checks


def _overlap_checks(integrity: IntegrityEvidence, config: IntegrityGateConfig) -> list[Check]:
    overlaps = list(integrity.all_overlaps())
    return [_thread_check(overlaps), *_owner_checks(overlaps, config)]


def _dedup_check(integrity: IntegrityEvidence) -> Check:
    nd = integrity.near_duplicates
    threshold = "0 cross-split near-duplicate windows left after dedup"
    if nd is None:
        return unmeasured("near_duplicates", "cross-split near-duplicate windows were not "
                          "measured; run dedup before sealing (snapshot integrity report)",
                          threshold=threshold)
    left = nd.found - nd.removed
    how = ", ".join(part for part in (
        None if nd.threshold is None else f"similarity >= {nd.threshold:g}", nd.method) if part)
    return judged("near_duplicates", left == 0,
                  figure=f"{_n(nd.found)} cross-split near-duplicate window(s) found, "
                  f"{_n(nd.removed)} removed, {_n(left)} left" + (f" ({how})" if how else ""),
                  threshold=threshold,
                  reason="" if left == 0 else f"{left} remain across train/evaluation")


def _identity_check(integrity: IntegrityEvidence, name: str, field_name: str,
                    pinned: str | None, *, required: bool) -> Check:
    splits = integrity.splits
    threshold = f"one {name} digest across every split" + (
        f", equal to the pinned {pinned[:12]}" if pinned else "")
    silent = [s for s in splits if not getattr(splits[s], field_name)]
    if silent:
        return unmeasured(f"{name}_identity", f"{name} digest not reported for split(s) "
                          f"{', '.join(silent)}; the sealed snapshot's split manifests carry "
                          "it", threshold=threshold, required=required)
    seen = sorted({d for s in splits.values() for d in getattr(s, field_name)})
    figure = f"{len(seen)} distinct {name} digest(s) ({', '.join(x[:12] for x in seen)})"
    if len(seen) > 1:
        return judged(f"{name}_identity", False, figure=figure, threshold=threshold,
                      reason="splits were produced by different identities", required=required)
    if pinned is not None and seen[0] != pinned:
        return judged(f"{name}_identity", False, figure=figure, threshold=threshold,
                      reason=f"the run pins {pinned[:12]}", required=required)
    return judged(f"{name}_identity", True, figure=figure, threshold=threshold,
                  required=required)


def _identity_checks(integrity: IntegrityEvidence, identity: Identity) -> list[Check]:
    return [_identity_check(integrity, "runtime", "identity_digests", identity.runtime,
                            required=True),
            _identity_check(integrity, "teacher", "teacher_digests", identity.teacher,
                            required=False),
            _identity_check(integrity, "tokenizer", "tokenizer_digests", identity.tokenizer,
                            required=False)]


def _coverage_checks(integrity: IntegrityEvidence, config: IntegrityGateConfig) -> list[Check]:
    checks = []
    threshold = "reported for every split (IntegrityGateConfig.coverage_dimensions)"
    for dim in config.coverage_dimensions:
        silent = [s for s, item in integrity.splits.items() if not item.coverage.get(dim)]
        if silent:
            checks.append(unmeasured(f"coverage_{dim}", f"coverage by {dim} not reported for "
                                     f"{', '.join(silent)}; the capture's {dim} tags feed it",
                                     threshold=threshold, required=False))
        else:
            groups = max(len(item.coverage[dim]) for item in integrity.splits.values())
            checks.append(judged(f"coverage_{dim}", True, figure=f"{dim} reported for "
                                 f"{len(integrity.splits)} split(s), up to {groups} group(s)",
                                 threshold=threshold, required=False))
    return checks


def _authorization_check(integrity: IntegrityEvidence, config: IntegrityGateConfig) -> Check:
    """Measured from the consent ledger (the seal's check of every row), never declared;
    the declared policy only adds its deletion requirement for production transcripts."""
    c, a = integrity.consent, integrity.authorization
    threshold = ("every row's owner had a live consent grant of its split's scope at seal "
                 "time (fraction 1.0)" + ("" if config.require_authorization else
                                          " (optional: require_authorization is false)"))
    if c is None:
        return unmeasured("authorization", "the snapshot's manifest has no consent measurement "
                          "(sealed before the consent ledger); re-seal it with the ledger",
                          threshold=threshold, required=config.require_authorization)
    figure = (f"consent ledger {c.ledger} at seal: {c.rows_granted} of {c.rows} rows granted "
              f"(fraction {c.authorized_fraction:.4f}), {c.owners_refused} of {c.owners} owners "
              "refused; records that reached Kafka without a grant (quarantined "
              "no_consent by the stream workers): "
              + ("not measured" if c.refused_records is None else str(c.refused_records))
              + " (a publisher's refusals never reach Kafka: the runtime counts them)"
              + ("" if a is None else f"; deletion supported {_yes(a.deletion_supported)} "
                 f"({drill_summary(a.erasure_drill)})"))
    if c.rows_granted < c.rows:
        return judged("authorization", False, figure=figure, threshold=threshold,
                      reason=f"{c.rows - c.rows_granted} rows have no live grant: readers "
                      "exclude them, but the snapshot still holds them; erase the owners "
                      "(`flywheel erase`) for a superseding snapshot")
    if a is not None and a.production_transcripts and a.deletion_supported is not True:
        return judged("authorization", False, figure=figure, threshold=threshold,
                      reason="production transcripts without deletion support")
    return judged("authorization", True, figure=figure, threshold=threshold)


def _yes(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


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
             "retention_days", "erasure_drill")},
        "consent": None if integrity.consent is None else {
            "rows": integrity.consent.rows, "rows_granted": integrity.consent.rows_granted,
            "authorized_fraction": integrity.consent.authorized_fraction,
            "owners": integrity.consent.owners,
            "owners_refused": integrity.consent.owners_refused,
            "refused_records": integrity.consent.refused_records,
            "checked_at_ms": integrity.consent.checked_at_ms,
            "ledger": integrity.consent.ledger},
    }


def gate2_integrity(inputs: QualificationInputs, config: IntegrityGateConfig) -> GateVerdict:
    """Gate 2: split disjointness by thread (and owner), no cross-split near duplicates,
    one pinned identity across splits; coverage and authorization reported."""
    integrity = inputs.integrity
    if integrity is None:
        return gate_verdict(2, GATE2_NAME, [unmeasured(
            "integrity", "no split-integrity evidence: leakage cannot be excluded; the sealed "
            "snapshot's split manifests provide it",
            threshold="disjoint threads and owners, no near duplicates")], {})
    checks = []
    if "train" not in integrity.splits or not set(integrity.splits) & set(EVALUATION_SPLITS):
        checks.append(unmeasured("splits", "integrity evidence needs the train split and at "
                                 f"least one evaluation split; got {sorted(integrity.splits)}",
                                 threshold="train and at least one evaluation split"))
    checks += _overlap_checks(integrity, config)
    checks.append(_dedup_check(integrity))
    checks += _identity_checks(integrity, inputs.identity)
    checks += _coverage_checks(integrity, config)
    checks.append(_authorization_check(integrity, config))
    return gate_verdict(2, GATE2_NAME, checks, _gate2_figures(integrity))
