"""Evidence about the data, built from real artefacts (Gates 1 and 2).

* the sealed snapshot (``manifest.json``, verified against its shards, and the dataset
  root's ``dataset.json`` when present): id, identity, geometry, parity;
* a ``flywheel rebuild --json`` report: determinism;
* a streams summary (``flywheel streams inspect --json``, or read from the broker by
  :mod:`train.qualify.collect`): fail-closed counts and cross-split near duplicates;
* the shards' lineage columns (read with pyarrow, only those columns): split integrity,
  cross-split owner/thread overlaps, identity digests and coverage.

Nothing here invents a figure: a piece whose source is absent is ``None`` and the
gates report it as not measurable. No torch, no Kafka.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import RouteGeometry, StreamGeometry
from hebrus_flywheel.core.snapshot import (
    SnapshotContractError,
    load_manifest,
    manifest_path,
    read_parquet,
    verify_snapshot,
)
from hebrus_flywheel.train.metrics import SPLITS
from hebrus_flywheel.train.qualify.data_evidence import (
    Authorization,
    ConsentMeasure,
    DeterminismEvidence,
    FailClosedEvidence,
    IntegrityEvidence,
    NearDuplicates,
    Overlap,
    ParityEvidence,
    SplitIntegrity,
)
from hebrus_flywheel.train.qualify.errors import InputError
from hebrus_flywheel.train.qualify.inputs import Identity

DATASET_FILE = "dataset.json"
HOLDOUT_SPLIT = "runtime_holdout"
_DETAIL_KEYS = ("source", "identity_id", "windows_compared", "windows_skipped", "anchors",
                "primary_mismatches", "set_mismatches", "rank_only_mismatches",
                "weight_violations", "max_weight_abs_diff", "weight_atol", "min_sample")


@dataclass(frozen=True, eq=False)
class SnapshotInfo:
    """A sealed snapshot whose shards were verified against its manifest."""

    directory: Path
    """The epoch directory (``DATASET_ROOT/epoch=N``)."""
    manifest: dict[str, Any]
    """Its manifest (digest-checked)."""
    dataset: dict[str, Any] | None
    """``DATASET_ROOT/dataset.json`` when present."""

    @property
    def snapshot_id(self) -> str:
        return str(self.manifest["snapshot_id"])

    @property
    def identity(self) -> dict[str, Any]:
        return dict(self.manifest.get("identity") or {})

    def split_rows(self, split: str) -> int:
        return int((self.manifest.get("splits") or {}).get(split, {}).get("rows", 0))


def read_json(path: Path, what: str) -> Any:
    """A JSON file, or InputError saying what it was meant to be."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read {what} {path}: {exc}") from exc


def open_snapshot(path: Path) -> SnapshotInfo:
    """Verify every shard of the sealed epoch at ``path`` and read its manifest and the
    dataset root's ``dataset.json`` (whose identity must be the manifest's)."""
    directory = manifest_path(Path(path)).parent
    try:
        verify_snapshot(directory)
        manifest = load_manifest(directory).to_dict()
    except SnapshotContractError as exc:
        raise InputError(f"refusing to qualify on {directory}: {exc}") from exc
    dataset_file = directory.parent / DATASET_FILE
    dataset = read_json(dataset_file, "dataset record") if dataset_file.is_file() else None
    info = SnapshotInfo(directory=directory, manifest=manifest, dataset=dataset)
    if dataset is not None:
        theirs = (dataset.get("identity") or {}).get("identity_id")
        if theirs != info.identity.get("identity_id"):
            raise InputError(f"{dataset_file} names identity {theirs} but the snapshot manifest "
                             f"names {info.identity.get('identity_id')}; the epoch does not "
                             "belong to this dataset root")
    return info


def identity_evidence(info: SnapshotInfo) -> Identity:
    """Runtime identity id, teacher artifact digest and tokenizer digest (manifest)."""
    ident = info.identity
    runtime = ident.get("identity_id")
    if not isinstance(runtime, str) or not runtime:
        raise InputError(f"snapshot {info.snapshot_id} records no identity.identity_id; it "
                         "was not sealed by this pipeline")
    return Identity(runtime=runtime, teacher=ident.get("model_artifact_digest") or None,
                    tokenizer=ident.get("tokenizer_digest") or None,
                    model_family=ident.get("model_family") or None)


def geometry_evidence(info: SnapshotInfo) -> RouteGeometry:
    """The teacher's :class:`RouteGeometry` from the snapshot's identity, checked against
    the shards' own routed layers and top-k; the simulator and every byte budget are
    sized from it (:func:`stream_geometry`)."""
    shard = info.manifest.get("geometry") or {}
    try:
        geometry = RouteGeometry.from_identity(info.identity)
        layers, top_k = int(shard["layers"]), int(shard["top_k"])
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise InputError(f"snapshot {info.snapshot_id} lacks geometry.layers/top_k or a "
                         f"complete identity ({exc}); it was not sealed by this pipeline") from exc
    if (geometry.routed_layer_count, geometry.top_k) != (layers, top_k):
        raise InputError(f"snapshot {info.snapshot_id}: shards hold {layers} layers x top-"
                         f"{top_k} but the identity pins {geometry.routed_layer_count} x top-"
                         f"{geometry.top_k}; the snapshot is inconsistent")
    return geometry


def stream_geometry(info: SnapshotInfo, geometry: RouteGeometry) -> StreamGeometry:
    """What a streaming runtime of the snapshot's teacher reads, from its identity alone
    (``geometry`` is :func:`geometry_evidence`'s, already checked against the shards)."""
    try:
        stream = StreamGeometry.from_identity(info.identity)
    except (KeyError, ConfigError) as exc:
        raise InputError(f"snapshot {info.snapshot_id}: cannot size the teacher's experts "
                         f"from its identity ({exc})") from exc
    return dataclasses.replace(stream, route=geometry)


def _percentile_name(quantile: str) -> str:
    """``q0`` -> ``min``, ``q0.01`` -> ``p01``, ``q0.5`` -> ``p50``, ``q1`` -> ``max``."""
    value = float(quantile.lstrip("q"))
    if value in (0.0, 1.0):
        return "min" if value == 0.0 else "max"
    pct = value * 100.0
    return f"p{int(pct):02d}" if pct == int(pct) else f"p{pct:g}"


def _quantiles(node: Any) -> dict[str, float]:
    values = (node or {}).get("quantiles") or {}
    return {_percentile_name(k): float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def _margins(parity: Mapping[str, Any], kind: str) -> dict[str, float]:
    return _quantiles(((parity.get("margins") or {}).get(kind) or {}).get("overall"))


def parity_evidence(info: SnapshotInfo) -> ParityEvidence | None:
    """The manifest's parity result (``flywheel parity`` / the seal's holdout parity):
    pairs compared, mismatched pairs, per-layer rates, boundary-margin quantiles, the
    override reason. None when the manifest records neither a result nor an override."""
    parity = info.manifest.get("parity")
    override = (info.manifest.get("parity_override") or {}).get("reason")
    if parity is None and override is None:
        return None
    parity = dict(parity or {"source": "no parity result recorded in the manifest"})
    per_layer = {int(e.get("slot", i)): float(e.get("mismatch_rate", 0.0))
                 for i, e in enumerate(parity.get("per_layer") or [])}
    details = {k: parity[k] for k in _DETAIL_KEYS if k in parity}
    label = _margins(parity, "label")
    if label:
        details["label_margin_quantiles"] = label
    return ParityEvidence(
        authoritative=parity.get("authoritative") is True,
        compared=int(parity.get("pairs") or 0), mismatches=int(parity.get("mismatched_pairs")
                                                              or 0),
        per_layer_mismatch_rate=per_layer, margin_quantiles=_margins(parity, "boundary"),
        override_reason=override, details=details,
        tokens_compared=_count(parity, "tokens_compared"),
        token_mismatches=_count(parity, "token_id_mismatches"),
        position_mismatches=_count(parity, "position_mismatches"))


def _count(node: Mapping[str, Any], key: str) -> int | None:
    value = node.get(key)
    return None if value is None else int(value)


def determinism_evidence(report: Any, snapshot_id: str) -> DeterminismEvidence:
    """A ``flywheel rebuild --json`` report of this snapshot."""
    if not isinstance(report, Mapping) or "rebuilt_snapshot_id" not in report:
        raise InputError("the rebuild report lacks rebuilt_snapshot_id; pass the JSON that "
                         "`flywheel rebuild --json` prints")
    if report.get("snapshot_id") != snapshot_id:
        raise InputError(f"the rebuild report is for snapshot {report.get('snapshot_id')}, "
                         f"this run qualifies {snapshot_id}; rebuild this snapshot")
    differences = report.get("differences") or []
    # Encrypted shards get fresh ciphertext (so a fresh snapshot id) on every rebuild;
    # what must match is the content id over the plaintext digests, when reported.
    key, rebuilt = (("content_id", "rebuilt_content_id") if "rebuilt_content_id" in report
                    else ("snapshot_id", "rebuilt_snapshot_id"))
    return DeterminismEvidence(snapshot_digest=str(report[key]),
                               rebuild_digest=str(report[rebuilt]),
                               shards_compared=report.get("shards"),
                               shards_differing=len(differences))


def _counts(node: Any, where: str) -> dict[str, int]:
    if not isinstance(node, Mapping) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in node.values()):
        raise InputError(f"the streams summary's {where} must map names to counts; pass the "
                         "JSON of `flywheel streams inspect --json`")
    return {str(k): int(v) for k, v in node.items()}


def fail_closed_evidence(summary: Mapping[str, Any]) -> FailClosedEvidence | None:
    """Quarantine counts by reason and records seen on the capture topics. None when the
    summary does not say how many records were seen (``capture.records``)."""
    quarantined = _counts(summary.get("quarantine", {}), "quarantine")
    seen = (summary.get("capture") or {}).get("records")
    if seen is None:
        return None
    ledger = summary.get("accounting")
    accounting = {} if ledger is None else _counts(
        ledger.get("totals") if isinstance(ledger, Mapping) else None, "accounting.totals")
    return FailClosedEvidence(records_seen=int(seen), quarantined=quarantined,
                              accounting=accounting)


CROSS_SPLIT_REASONS = ("near_duplicate_of_train", "near_duplicate_of_evaluation")
"""Dedup reasons that remove one thread of a train/evaluation near-duplicate pair."""


def near_duplicates_evidence(summary: Mapping[str, Any]) -> NearDuplicates | None:
    """Cross-split near duplicates from the dedup decisions: evaluation threads dropped as
    near duplicates of an earlier train thread and train threads dropped as near
    duplicates of an earlier evaluation thread (found and removed), plus the late
    conflicts older workers recorded (a train thread kept after an already published
    evaluation thread: found, kept)."""
    dedup = summary.get("dedup")
    if not isinstance(dedup, Mapping) or "by_reason" not in dedup:
        return None
    by_reason = _counts(dedup["by_reason"], "dedup.by_reason")
    removed = sum(by_reason.get(r, 0) for r in CROSS_SPLIT_REASONS)
    late = dedup.get("late_eval_conflicts", 0)
    if isinstance(late, bool) or not isinstance(late, int):
        raise InputError("the streams summary's dedup.late_eval_conflicts must be a count")
    return NearDuplicates(found=removed + late, removed=removed,
                          threshold=_threshold(dedup.get("threshold")),
                          method="MinHash/LSH over token shingles (streams dedup stage): "
                                 "near_duplicate_of_train + near_duplicate_of_evaluation "
                                 "+ late_eval_conflicts (ledgers of older workers)")


def _threshold(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError("the streams summary's dedup.threshold must be a number")
    return float(value)


# --- split integrity from the shards' lineage columns ------------------------------------

LINEAGE_COLUMNS = ("split", "owner", "thread", "generation", "window_id", "identity_id",
                   "domain_tags", "token_ordinal")
NON_DOMAIN_TAGS = frozenset({"tool_calls", "multilingual", "unusual_length", "long_reasoning"})
PROMPT_BUCKETS: tuple[tuple[int, str], ...] = ((32, "0-31"), (128, "32-127"), (512, "128-511"),
                                               (2048, "512-2047"), (2**62, ">=2048"))
COVERAGE_MEANING: dict[str, str] = {
    "domain": "threads per domain tag (a thread with several tags counts under each; "
              "tool_calls, multilingual, unusual_length and long_reasoning are reported as "
              "their own dimensions)",
    "language": "threads tagged 'multilingual' (non-English) or not: the shards record no "
                "language, only that tag",
    "prompt_length": "threads by the token ordinal of their first anchor, i.e. the tokens "
                     "before the first labelled (assistant) token: the first prompt's length",
    "tool_calls": "threads tagged 'tool_calls' or not",
    "reasoning": "threads tagged 'long_reasoning' or not",
    "unusual_length": "threads tagged 'unusual_length' (very short exchanges or a very long "
                      "first prompt) or not",
}
"""What each coverage dimension counts (the shards carry tags, not measured languages)."""

SYNTHETIC_RUNTIMES = frozenset({"planted"})
"""Runtime names whose data are synthetic by construction (``train.testing``: planted
states, no transcripts at all)."""


@dataclass
class _ThreadLineage:
    """One owner/thread of one split, gathered from its windows."""

    tags: set[str] = field(default_factory=set)
    first_ordinal: int = 2**62
    windows: set[str] = field(default_factory=set)
    identities: set[str] = field(default_factory=set)


def _window_rows(table: pa.Table) -> Iterable[dict[str, Any]]:
    """One dict per window of a shard table: its lineage and its lowest anchor ordinal."""
    ids = np.asarray(table.column("window_id").to_pylist(), dtype=object)
    if not len(ids):
        return []
    unique, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    lowest = np.full(len(unique), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(lowest, inverse.reshape(-1), table.column("token_ordinal").to_numpy())
    picked = table.take(pa.array(first)).to_pylist()
    return [{**row, "first_ordinal": int(low)} for row, low in zip(picked, lowest, strict=True)]


def _lineage(info: SnapshotInfo) -> dict[str, dict[str, _ThreadLineage]]:
    """split -> ``owner/thread`` -> lineage, from every shard's lineage columns."""
    out: dict[str, dict[str, _ThreadLineage]] = {}
    for entry in info.manifest.get("shards") or []:
        path = info.directory / entry["path"]
        try:
            table = read_parquet(path, LINEAGE_COLUMNS)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"cannot read the lineage columns of {path}: {exc}") from exc
        for row in _window_rows(table):
            key = f"{row['owner']}/{row['thread']}"
            item = out.setdefault(str(row["split"]), {}).setdefault(key, _ThreadLineage())
            item.tags.update(row["domain_tags"] or ())
            item.first_ordinal = min(item.first_ordinal, row["first_ordinal"])
            item.windows.add(str(row["window_id"]))
            item.identities.add(str(row["identity_id"]))
    return out


def _flag(threads: Iterable[_ThreadLineage], tag: str, yes: str, no: str) -> dict[str, int]:
    counts = Counter(yes if tag in t.tags else no for t in threads)
    return dict(sorted(counts.items()))


def _prompt_bucket(ordinal: int) -> str:
    return next(label for bound, label in PROMPT_BUCKETS if ordinal < bound)


def coverage(threads: Mapping[str, _ThreadLineage]) -> dict[str, dict[str, int]]:
    """Thread counts per coverage dimension (see :data:`COVERAGE_MEANING`)."""
    items = list(threads.values())
    domains = Counter(tag for t in items for tag in (set(t.tags) - NON_DOMAIN_TAGS) or
                      {"no domain tag"})
    return {
        "domain": dict(sorted(domains.items())),
        "language": _flag(items, "multilingual", "tagged multilingual",
                          "not tagged multilingual"),
        "prompt_length": dict(sorted(Counter(_prompt_bucket(t.first_ordinal)
                                             for t in items).items())),
        "tool_calls": _flag(items, "tool_calls", "with tool calls", "without tool calls"),
        "reasoning": _flag(items, "long_reasoning", "long reasoning", "no long reasoning"),
        "unusual_length": _flag(items, "unusual_length", "tagged unusual_length",
                                "not tagged unusual_length"),
    }


def _split_integrity(info: SnapshotInfo, threads: Mapping[str, _ThreadLineage]
                     ) -> SplitIntegrity:
    ident = info.identity
    seen = sorted({i for t in threads.values() for i in t.identities})
    # teacher and tokenizer digests are recorded for the pinned identity only
    pinned = ident.get("identity_id") in seen
    teacher, tokenizer = ident.get("model_artifact_digest"), ident.get("tokenizer_digest")
    owners = frozenset(k.split("/", 1)[0] for k in threads)
    return SplitIntegrity(
        owners=len(owners), threads=len(threads), owner_ids=owners,
        thread_ids=frozenset(threads),
        windows=sum(len(t.windows) for t in threads.values()), identity_digests=tuple(seen),
        teacher_digests=(str(teacher),) if pinned and teacher else (),
        tokenizer_digests=(str(tokenizer),) if pinned and tokenizer else (),
        coverage=coverage(threads))


def overlaps(splits: Mapping[str, SplitIntegrity]) -> tuple[Overlap, ...]:
    """Owners and threads present in two splits (every pair of splits)."""
    names = sorted(splits, key=SPLITS.index)
    found = []
    for kind in ("owner", "thread"):
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                shared = (getattr(splits[a], f"{kind}_ids") or frozenset()) & (
                    getattr(splits[b], f"{kind}_ids") or frozenset())
                if shared:
                    found.append(Overlap(kind=kind, splits=(a, b), ids=tuple(sorted(shared))))
    return tuple(found)


def consent_evidence(info: SnapshotInfo,
                     summary: Mapping[str, Any] | None) -> ConsentMeasure | None:
    """The seal's consent measurement (manifest ``consent``), with the records refused
    upstream (``no_consent`` in the streams summary's quarantine counts) when known."""
    block = info.manifest.get("consent")
    if not isinstance(block, Mapping):
        return None
    refused = None
    if summary is not None and isinstance(summary.get("quarantine"), Mapping):
        refused = int(_counts(summary["quarantine"], "quarantine").get("no_consent", 0))
    try:
        return ConsentMeasure(rows=block["rows"], rows_granted=block["rows_granted"],
                              owners=block["owners"], owners_refused=block["owners_refused"],
                              checked_at_ms=block["checked_at_ms"], ledger=block["ledger"],
                              refused_records=refused)
    except KeyError as exc:
        raise InputError(f"snapshot {info.snapshot_id}: the manifest's consent block lacks "
                         f"{exc}; re-seal it") from exc


def integrity_evidence(info: SnapshotInfo, *, near_duplicates: NearDuplicates | None,
                       authorization: Authorization | None,
                       consent: ConsentMeasure | None = None) -> IntegrityEvidence:
    """Per-split owners, threads, windows, identity digests and coverage from the
    shards; overlaps between splits; near duplicates and authorization as given."""
    lineage = _lineage(info)
    unknown = sorted(set(lineage) - set(SPLITS))
    if unknown:
        raise InputError(f"snapshot {info.snapshot_id} has rows of unknown split(s) {unknown}")
    splits = {s: _split_integrity(info, lineage[s]) for s in SPLITS if s in lineage}
    if not splits:
        raise InputError(f"snapshot {info.snapshot_id} holds no rows; nothing to qualify")
    return IntegrityEvidence(splits=splits, overlaps=overlaps(splits),
                             near_duplicates=near_duplicates, authorization=authorization,
                             consent=consent)


def deletion_evidence(drill: Mapping[str, Any] | None
                      ) -> tuple[bool | None, dict[str, Any] | None]:
    """Whether deletion works, measured by an erasure drill's receipt (None: unknown),
    and the figures it was measured from. It works when the drill removed the owner's
    rows (some before, none after), the superseding snapshot verifies and no plaintext
    canary is left."""
    if drill is None:
        return None, None
    if drill.get("state") != "run":
        return None, {"state": drill.get("state"), "reason": drill.get("reason")}
    superseding = drill.get("superseding_snapshot") or {}
    figures = {"state": "run", "owner_rows_before": drill.get("owner_rows_before"),
               "owner_rows_after": drill.get("owner_rows_after"),
               "plaintext_canary_hits": drill.get("plaintext_canary_hits"),
               "plaintext_canary_hits_broker_logs":
                   (drill.get("plaintext_canary_scan") or {}).get("broker_logs"),
               "superseding_snapshot_verifies": superseding.get("verifies"),
               "tainted_checkpoints": len(drill.get("tainted_checkpoints") or []),
               "does_not_establish": list(drill.get("does_not_establish") or [])}
    if figures["plaintext_canary_hits"] is None or not figures["owner_rows_before"]:
        return None, figures
    works = (figures["owner_rows_after"] == 0 and figures["plaintext_canary_hits"] == 0
             and figures["superseding_snapshot_verifies"] is True)
    return works, figures


def authorization_evidence(info: SnapshotInfo, declared: Mapping[str, Any] | None,
                           drill: Mapping[str, Any] | None = None) -> Authorization | None:
    """The declared policy (config ``[authorization]``), else ``synthetic-threads`` for a
    runtime whose data are synthetic by construction, else None (not given). The
    reference runtime alone does not say its threads were synthetic: declare it.
    Deletion support is measured by the erasure drill (``drill``), never declared."""
    deletion, figures = deletion_evidence(drill)
    if declared is not None:
        if "deletion_supported" in declared:
            raise InputError("[authorization] in the config declares deletion_supported, but "
                             "deletion support is measured: remove it and pass "
                             "--erasure-receipt FILE (the erasure drill's receipt)")
        try:
            return Authorization(**dict(declared), deletion_supported=deletion,
                                 erasure_drill=figures)
        except TypeError as exc:
            raise InputError(f"[authorization] in the config: {exc}") from exc
    if info.identity.get("runtime_name") in SYNTHETIC_RUNTIMES:
        return Authorization(policy="synthetic-threads", production_transcripts=False,
                             deletion_supported=deletion, erasure_drill=figures)
    return None
