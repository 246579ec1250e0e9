"""Consent when a snapshot is read: rows whose owner may not be used are excluded.

Two sources, both fail closed:

* the seal's refusals, recorded in the manifest's ``consent`` block (rows whose owner had
  no live grant of their split's scope at seal time) — always excluded, offline;
* the consent ledger now (:func:`check_ledger`, what ``flywheel train`` and ``flywheel
  evaluate`` do by default): every owner of the splits read is asked again for the
  split's scope (``train`` for the train split, ``evaluate`` for the others), so an
  owner who revoked or whose grant expired after the seal is excluded too.

The exclusion lives on the :class:`~train.data.Snapshot` (``excluded``), so every
reader of it (training streams, evaluation batches) skips the same rows; the counts go
into the checkpoint's lineage and the evaluation report.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hebrus_flywheel.streams.consent import ConsentCheck, now_ms, scope_for_split
from hebrus_flywheel.train.exceptions import SnapshotError

log = logging.getLogger(__name__)


class Snapshot(Protocol):
    """What this module needs of :class:`train.data.Snapshot`."""

    excluded: dict[str, frozenset[str]]
    consent: dict[str, Any]

    def units(self, splits: Sequence[str]) -> list[Any]: ...

    def read(self, unit: Any, columns: Sequence[str], *, filtered: bool = True) -> Any: ...

    def exclude(self, owners: Mapping[str, frozenset[str]]) -> None: ...


def sealed_refusals(manifest: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """``split -> owners`` the seal refused (none for a manifest without a consent block)."""
    block = manifest.get("consent") or {}
    return {split: frozenset(owners) for split, owners in (block.get("refused") or {}).items()}


def sealed_summary(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The counts of the seal's refusals (what is excluded without the ledger)."""
    block = manifest.get("consent") or {}
    by_split = {split: sum(owners.values())
                for split, owners in sorted((block.get("refused") or {}).items())}
    return {"source": "manifest" if block else "none", "checked_at_ms": block.get("checked_at_ms"),
            "rows_checked": block.get("rows"), "rows_excluded": sum(by_split.values()),
            "rows_excluded_by_split": by_split,
            "owners_excluded": block.get("owners_refused", 0)}


def owner_rows(snapshot: Snapshot, splits: Sequence[str]) -> Counter[tuple[str, str]]:
    """Rows per ``(split, owner)`` of ``splits`` (reads only the owner column)."""
    rows: Counter[tuple[str, str]] = Counter()
    for split in splits:
        for unit in snapshot.units([split]):
            owners = snapshot.read(unit, ["owner"], filtered=False).column("owner").to_pylist()
            rows.update((split, str(o)) for o in owners)
    return rows


def check_ledger(snapshot: Snapshot, splits: Sequence[str], consent: ConsentCheck, *,
                 at_ms: int | None = None) -> dict[str, Any]:
    """Exclude, on ``snapshot``, every owner of ``splits`` without a live grant of the
    split's scope at ``at_ms`` (default now); returns the counts (no owner ids)."""
    at = now_ms() if at_ms is None else at_ms
    rows = owner_rows(snapshot, splits)
    excluded: dict[str, set[str]] = {s: set(snapshot.excluded.get(s, ())) for s in splits}
    for (split, owner), _ in sorted(rows.items()):
        if not consent.allows(owner, scope_for_split(split), at):
            excluded[split].add(owner)
    snapshot.exclude({s: frozenset(o) for s, o in excluded.items()})
    report = summary(snapshot, rows, source="ledger", at_ms=at)
    emptied = [s for s in splits if report["rows_checked_by_split"].get(s, 0)
               and report["rows_excluded_by_split"].get(s, 0) == report["rows_checked_by_split"][s]]
    if emptied:
        raise SnapshotError(
            f"every row of {', '.join(emptied)} belongs to owners without a live grant of the "
            "split's scope in the consent ledger, so nothing is left to read; check `flywheel "
            "consent list` (and the ledger topic the snapshot's prefix names)")
    if report["rows_excluded"]:
        log.warning("consent: %d of %d rows (%d owners) excluded from %s: no live grant of "
                    "the split's scope", report["rows_excluded"], report["rows_checked"],
                    report["owners_excluded"], ", ".join(splits))
    return report


def summary(snapshot: Snapshot, rows: Mapping[tuple[str, str], int], *, source: str,
            at_ms: int | None) -> dict[str, Any]:
    """Counts of checked and excluded rows per split; stored on ``snapshot.consent``."""
    by_split: Counter[str] = Counter()
    checked: Counter[str] = Counter()
    owners: set[str] = set()
    for (split, owner), n in rows.items():
        checked[split] += n
        if owner in snapshot.excluded.get(split, ()):
            by_split[split] += n
            owners.add(owner)
    report = {"source": source, "checked_at_ms": at_ms,
              "rows_checked": sum(rows.values()), "rows_excluded": sum(by_split.values()),
              "rows_checked_by_split": dict(sorted(checked.items())),
              "rows_excluded_by_split": dict(sorted(by_split.items())),
              "owners_excluded": len(owners)}
    snapshot.consent = report
    return report
