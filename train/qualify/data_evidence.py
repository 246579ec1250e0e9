"""Evidence about the data: replay parity, determinism, fail-closed counts (Gate 1) and
split integrity, deduplication, identity, coverage and authorization (Gate 2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hebrus_flywheel.train.metrics import SPLITS
from hebrus_flywheel.train.qualify import checks as v
from hebrus_flywheel.train.qualify.errors import InputError


@dataclass(frozen=True, kw_only=True)
class ParityEvidence:
    """Replay-prefill versus deployment-decode route parity (Gate 1, falsifier #1)."""

    authoritative: bool
    """Whether the parity run declared replay an authoritative label producer."""
    compared: int
    """(position, layer) routes compared."""
    mismatches: int
    """Compared routes whose top-k ids or rank order differ."""
    per_layer_mismatch_rate: dict[int, float] = field(default_factory=dict)
    """Mismatch rate per routed layer."""
    margin_quantiles: dict[str, float] = field(default_factory=dict)
    """Quantiles of the router score margin at the top-k boundary (e.g. ``"p01"``)."""
    override_reason: str | None = None
    """Why a non-authoritative result was accepted anyway (never overrides mismatches)."""
    tokens_compared: int | None = None
    """Anchors whose replayed token id and position were compared with the captured
    window's (None: not compared)."""
    token_mismatches: int | None = None
    """Of those, anchors whose token id differed (None: not compared)."""
    position_mismatches: int | None = None
    """Of those, anchors whose thread position differed (None: not compared)."""
    prefix_digest_mismatches: int | None = None
    """Accepted-prefix digests that differed (None: not compared)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Anything else the parity result carried, reported verbatim."""

    def __post_init__(self) -> None:
        v.flag("parity.authoritative", self.authoritative)
        v.count("parity.compared", self.compared)
        v.count("parity.mismatches", self.mismatches)
        if self.mismatches > self.compared:
            raise InputError("parity.mismatches exceeds parity.compared; check the parity result")
        for layer, rate in self.per_layer_mismatch_rate.items():
            v.count("parity.per_layer_mismatch_rate key", layer)
            v.number(f"parity.per_layer_mismatch_rate[{layer}]", rate, high=1.0)
        for name, value in self.margin_quantiles.items():
            v.number(f"parity.margin_quantiles[{name}]", value, low=None)
        v.text("parity.override_reason", self.override_reason, optional=True)
        for name in ("tokens_compared", "token_mismatches", "position_mismatches"):
            v.count(f"parity.{name}", getattr(self, name), optional=True)
            if name != "tokens_compared" and (getattr(self, name) or 0) > (
                    self.tokens_compared or 0):
                raise InputError(f"parity.{name} exceeds parity.tokens_compared; check the "
                                 "parity result")
        v.count("parity.prefix_digest_mismatches", self.prefix_digest_mismatches,
                optional=True)
        v.mapping("parity.details", self.details)


@dataclass(frozen=True, kw_only=True)
class DeterminismEvidence:
    """A rebuild of the snapshot from its recorded source offsets (Gate 1)."""

    snapshot_digest: str
    """Digest of the sealed snapshot (its content id: manifest over plaintext digests)."""
    rebuild_digest: str
    """The same digest of the rebuilt one."""
    shards_compared: int | None = None
    """Shards compared byte for byte, when reported."""
    shards_differing: int | None = None
    """Shards whose bytes differed, when reported."""

    def __post_init__(self) -> None:
        v.text("determinism.snapshot_digest", self.snapshot_digest)
        v.text("determinism.rebuild_digest", self.rebuild_digest)
        v.count("determinism.shards_compared", self.shards_compared, optional=True)
        v.count("determinism.shards_differing", self.shards_differing, optional=True)

    @property
    def identical(self) -> bool:
        return self.snapshot_digest == self.rebuild_digest and not self.shards_differing


@dataclass(frozen=True, kw_only=True)
class FailClosedEvidence:
    """What the stream processors refused (Gate 1)."""

    records_seen: int
    """Records read from the capture topics."""
    records_accepted: int | None = None
    """Records that reached a window; with the quarantine counts it must add up."""
    quarantined: dict[str, int] = field(default_factory=dict)
    """Quarantined records by reason code."""
    accounting: dict[str, int] = field(default_factory=dict)
    """Consumed capture records by accounting class (the ``totals`` of ``flywheel streams
    accounting``: ``records``, ``windowed``, ``quarantined``, ``duplicate``, ``pending``,
    ..., ``unaccounted``); empty when no ledger was given."""

    def __post_init__(self) -> None:
        v.count("fail_closed.records_seen", self.records_seen)
        v.count("fail_closed.records_accepted", self.records_accepted, optional=True)
        v.mapping("fail_closed.quarantined", self.quarantined)
        for code, n in self.quarantined.items():
            v.count(f"fail_closed.quarantined[{code}]", n)
        v.mapping("fail_closed.accounting", self.accounting)
        for name, n in self.accounting.items():
            v.count(f"fail_closed.accounting[{name}]", n)
        if self.accounting and not {"records", "unaccounted"} <= self.accounting.keys():
            raise ValueError("fail_closed.accounting must hold records and unaccounted")

    @property
    def total_quarantined(self) -> int:
        return sum(self.quarantined.values())


@dataclass(frozen=True, kw_only=True)
class OpaqueIds:
    """One kind of opaque id and how many of them were reused (Gate 1)."""

    kind: str
    """What the ids are, e.g. ``window_id`` or ``sequence_id``."""
    checked: int
    """Distinct ids checked."""
    reused: int
    """Ids seen under more than one owner (or thread) or more than one generation."""
    source: str
    """Where the ids were read."""
    examples: tuple[str, ...] = ()
    """A few reused ids with the owners/generations they appeared under."""

    def __post_init__(self) -> None:
        v.freeze(self, "examples", tuple)
        v.text("opaque_ids[].kind", self.kind)
        v.count(f"opaque_ids[{self.kind}].checked", self.checked)
        v.count(f"opaque_ids[{self.kind}].reused", self.reused)
        if self.reused > self.checked:
            raise InputError(f"opaque_ids[{self.kind}].reused exceeds checked")
        v.text(f"opaque_ids[{self.kind}].source", self.source)
        v.strings(f"opaque_ids[{self.kind}].examples", self.examples)


@dataclass(frozen=True, kw_only=True)
class Overlap:
    """Owners or threads found in two splits (computed upstream)."""

    kind: str
    """``owner`` or ``thread``."""
    splits: tuple[str, str]
    """The two splits."""
    ids: tuple[str, ...] = ()
    """The shared ids (possibly a sample)."""
    count: int | None = None
    """How many are shared in all (None: ``len(ids)``)."""

    def __post_init__(self) -> None:
        v.freeze(self, "splits", tuple)
        v.freeze(self, "ids", tuple)
        if self.kind not in ("owner", "thread"):
            raise InputError(f"overlap kind must be 'owner' or 'thread', got {self.kind!r}")
        if len(self.splits) != 2 or set(self.splits) - set(SPLITS):
            raise InputError(f"overlap splits must be two of {', '.join(SPLITS)}, "
                             f"got {self.splits!r}")
        v.strings("overlap ids", self.ids)
        v.count("overlap count", self.count, optional=True)

    @property
    def size(self) -> int:
        return len(self.ids) if self.count is None else self.count


@dataclass(frozen=True, kw_only=True)
class SplitIntegrity:
    """One split of the snapshot, as Gate 2 sees it."""

    owners: int
    """Distinct owners."""
    threads: int
    """Distinct threads."""
    windows: int | None = None
    """Causal windows."""
    owner_ids: frozenset[str] | None = None
    """The owners themselves, when given (overlaps are then recomputed here)."""
    thread_ids: frozenset[str] | None = None
    """The threads themselves, when given."""
    identity_digests: tuple[str, ...] = ()
    """Runtime identity digests seen in the split (exactly one expected)."""
    teacher_digests: tuple[str, ...] = ()
    """Teacher digests seen in the split."""
    tokenizer_digests: tuple[str, ...] = ()
    """Tokenizer/template digests seen in the split."""
    coverage: dict[str, dict[str, int]] = field(default_factory=dict)
    """Counts by dimension (``domain``, ``language``, ``prompt_length``, ``tool_calls``,
    ...) and value."""

    def __post_init__(self) -> None:
        for name in ("owner_ids", "thread_ids"):
            v.freeze(self, name, frozenset)
        for name in ("identity_digests", "teacher_digests", "tokenizer_digests"):
            v.freeze(self, name, tuple)

    def check(self, split: str) -> None:
        where = f"integrity.splits[{split}]"
        v.count(f"{where}.owners", self.owners)
        v.count(f"{where}.threads", self.threads)
        v.count(f"{where}.windows", self.windows, optional=True)
        for name in ("owner_ids", "thread_ids"):
            value = getattr(self, name)
            if value is not None:
                v.strings(f"{where}.{name}", value)
        for name in ("identity_digests", "teacher_digests", "tokenizer_digests"):
            v.strings(f"{where}.{name}", getattr(self, name))
        v.mapping(f"{where}.coverage", self.coverage)
        for dim, counts in self.coverage.items():
            v.mapping(f"{where}.coverage[{dim}]", counts)
            for value, n in counts.items():
                v.count(f"{where}.coverage[{dim}][{value}]", n)


@dataclass(frozen=True, kw_only=True)
class NearDuplicates:
    """Near-identical windows across train and evaluation splits."""

    found: int
    """Cross-split near-duplicate windows found."""
    removed: int
    """Of those, removed before sealing."""
    threshold: float | None = None
    """Similarity threshold used (e.g. MinHash Jaccard)."""
    method: str | None = None
    """How they were detected."""

    def __post_init__(self) -> None:
        v.count("integrity.near_duplicates.found", self.found)
        v.count("integrity.near_duplicates.removed", self.removed)
        if self.removed > self.found:
            raise InputError("integrity.near_duplicates.removed exceeds found")
        v.number("integrity.near_duplicates.threshold", self.threshold, optional=True,
                 high=1.0)
        v.text("integrity.near_duplicates.method", self.method, optional=True)


@dataclass(frozen=True, kw_only=True)
class Authorization:
    """The capture's authorization and deletion policy."""

    policy: str
    """Name or reference of the policy."""
    approved: bool | None = None
    """A declared approval, kept for the record only: Gate 2 measures authorization from
    the consent ledger (:class:`ConsentMeasure`), never from this."""
    production_transcripts: bool
    """True for real production traffic (False: synthetic or internal data)."""
    deletion_supported: bool | None = None
    """Whether a deletion request propagates to snapshots (measured by an erasure drill:
    ``qualify --erasure-receipt``; never declared in the config)."""
    retention_days: int | None = None
    """Retention limit."""
    erasure_drill: dict[str, Any] | None = None
    """The erasure drill's figures ``deletion_supported`` was measured from (owner rows
    before and after, plaintext canary hits, whether the superseding snapshot verifies)."""

    def __post_init__(self) -> None:
        if self.erasure_drill is not None and not isinstance(self.erasure_drill, dict):
            raise InputError("integrity.authorization.erasure_drill must be an object or null, "
                             f"got {type(self.erasure_drill).__name__}")
        v.text("integrity.authorization.policy", self.policy)
        v.flag("integrity.authorization.approved", self.approved, optional=True)
        v.flag("integrity.authorization.production_transcripts", self.production_transcripts)
        v.flag("integrity.authorization.deletion_supported", self.deletion_supported,
               optional=True)
        v.count("integrity.authorization.retention_days", self.retention_days, optional=True)


@dataclass(frozen=True, kw_only=True)
class ConsentMeasure:
    """Authorization measured from the consent ledger, never declared: the seal checked
    every row's owner for a live grant of its split's scope (the manifest's ``consent``
    block, :mod:`consumers.consent_seal`)."""

    rows: int
    """Rows of the snapshot checked."""
    rows_granted: int
    """Rows whose owner had a live grant of the split's scope at seal time."""
    owners: int
    owners_refused: int
    checked_at_ms: int
    ledger: str
    """The consent topic read."""
    refused_records: int | None = None
    """Records quarantined ``no_consent`` upstream (streams and replay; from the streams
    summary), None when not available."""

    def __post_init__(self) -> None:
        for name in ("rows", "rows_granted", "owners", "owners_refused", "checked_at_ms"):
            v.count(f"integrity.consent.{name}", getattr(self, name))
        v.count("integrity.consent.refused_records", self.refused_records, optional=True)
        v.text("integrity.consent.ledger", self.ledger)
        if self.rows_granted > self.rows:
            raise InputError("integrity.consent.rows_granted exceeds rows")

    @property
    def authorized_fraction(self) -> float:
        return 1.0 if self.rows == 0 else self.rows_granted / self.rows


@dataclass(frozen=True, kw_only=True)
class IntegrityEvidence:
    """Split disjointness, deduplication, identity and coverage (Gate 2)."""

    splits: dict[str, SplitIntegrity]
    """Per split, including ``train``."""
    overlaps: tuple[Overlap, ...] = ()
    """Owner/thread overlaps computed upstream."""
    near_duplicates: NearDuplicates | None = None
    """Cross-split near duplicates (None: not measured)."""
    authorization: Authorization | None = None
    """Declared policy facts (production transcripts, deletion, retention); whether the
    rows are authorized is :attr:`consent`, measured."""
    consent: ConsentMeasure | None = None
    """The consent ledger's verdict on every row at seal time (None: not measured)."""

    def __post_init__(self) -> None:
        v.freeze(self, "overlaps", tuple)
        v.mapping("integrity.splits", self.splits)
        if not self.splits or set(self.splits) - set(SPLITS):
            raise InputError(f"integrity.splits must name splits among {', '.join(SPLITS)}, "
                             f"got {sorted(self.splits)}")
        for split, item in self.splits.items():
            v.instance(f"integrity.splits[{split}]", item, SplitIntegrity, optional=False)
            item.check(split)
        for overlap in self.overlaps:
            v.instance("integrity.overlaps[]", overlap, Overlap, optional=False)
        v.instance("integrity.near_duplicates", self.near_duplicates, NearDuplicates)
        v.instance("integrity.authorization", self.authorization, Authorization)
        v.instance("integrity.consent", self.consent, ConsentMeasure)

    def all_overlaps(self) -> list[Overlap]:
        """Upstream overlaps, plus any found here from explicit id sets (largest kept
        when both report the same kind and pair)."""
        found = {(o.kind, tuple(sorted(o.splits))): o for o in self.overlaps}
        names = sorted(self.splits, key=SPLITS.index)
        for kind in ("owner", "thread"):
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    ids_a = getattr(self.splits[a], f"{kind}_ids")
                    ids_b = getattr(self.splits[b], f"{kind}_ids")
                    if ids_a is None or ids_b is None or not ids_a & ids_b:
                        continue
                    shared = Overlap(kind=kind, splits=(a, b), ids=tuple(sorted(ids_a & ids_b)))
                    key = (kind, tuple(sorted((a, b))))
                    if key not in found or found[key].size < shared.size:
                        found[key] = shared
        return [found[k] for k in sorted(found)]


def drill_summary(drill: dict[str, Any] | None) -> str:
    """One line on the erasure drill deletion support was measured from."""
    if drill is None:
        return "not measured: no erasure drill receipt"
    if drill.get("state") != "run":
        return f"erasure drill not run: {drill.get('reason')}"
    return (f"erasure drill: {drill.get('owner_rows_before')} owner rows before, "
            f"{drill.get('owner_rows_after')} after, {drill.get('plaintext_canary_hits')} "
            f"plaintext canary hits ({drill.get('plaintext_canary_hits_broker_logs')} in "
            f"broker logs), superseding snapshot verifies "
            f"{_yes_no(drill.get('superseding_snapshot_verifies'))}, "
            f"{drill.get('tainted_checkpoints')} tainted checkpoint(s)")


def _yes_no(value: Any) -> str:
    return "unknown" if value is None else ("yes" if value else "no")
