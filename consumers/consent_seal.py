"""Consent at seal time: every row of the epoch checked against the consent ledger.

The seal reads the ``owner`` column of every shard of the epoch and asks the ledger,
at seal time, whether each owner has a live grant of the scope of the row's split
(:func:`streams.consent.scope_for_split`: ``train`` for the train split, ``evaluate``
for the others). Sealed shards cannot be edited, so rows that fail are *refused* by
record: the manifest's ``consent`` block lists them per split and owner, every reader
excludes them (``train.data``), and Gate 2 reads ``authorized_fraction`` (granted rows
over all rows, 1.0 required): a snapshot holding a refused row needs a superseding
snapshot without it (``flywheel erase``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers.exceptions import SealError
from hebrus_flywheel.consumers.shards import iter_shards
from hebrus_flywheel.core.snapshot.crypto import read_parquet
from hebrus_flywheel.streams.consent import ConsentCheck, scope_for_split

log = logging.getLogger(__name__)


def owner_rows(root: Path, epoch: int) -> Counter[tuple[str, str]]:
    """Rows per ``(split, owner)`` over every shard of ``epoch``."""
    rows: Counter[tuple[str, str]] = Counter()
    for _, split, path in iter_shards(root, epoch):
        try:
            owners = read_parquet(path, ["owner"]).column("owner").to_pylist()
        except Exception as exc:  # pyarrow raises many types; the seal names the shard
            raise SealError(f"cannot read the owners of {path} to check consent: {exc}") \
                from exc
        rows.update((split, str(owner)) for owner in owners)
    return rows


def measure(rows: Mapping[tuple[str, str], int], consent: ConsentCheck, *, at_ms: int,
            ledger: str) -> dict[str, Any]:
    """The manifest's ``consent`` block for ``rows`` (see the module doc)."""
    refused: dict[str, dict[str, int]] = {}
    for (split, owner), n in sorted(rows.items()):
        if not consent.allows(owner, scope_for_split(split), at_ms):
            refused.setdefault(split, {})[owner] = n
    total = sum(rows.values())
    rows_refused = sum(n for by_owner in refused.values() for n in by_owner.values())
    return {
        "checked_at_ms": at_ms, "ledger": ledger, "rows": total,
        "rows_granted": total - rows_refused, "rows_refused": rows_refused,
        "owners": len({owner for _, owner in rows}),
        "owners_refused": len({o for by_owner in refused.values() for o in by_owner}),
        "refused": refused,
        "authorized_fraction": 1.0 if total == 0 else (total - rows_refused) / total,
    }


def refused_owners(manifest: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """``split -> owners`` whose rows the seal refused (empty for older manifests)."""
    block = manifest.get("consent") or {}
    return {split: frozenset(owners) for split, owners in (block.get("refused") or {}).items()}
