"""Opaque-id reuse across owners and generations (Gate 1), measured from real artefacts.

* ``window_id`` from every shard of the sealed snapshot: a window id names one window of
  one owner, thread and generation; the same id under two of them means an id was
  reused (or minted from the wrong lineage).
* ``sequence_id`` (the runtime's request id of each turn) from the manifest's parity
  result, when the seal computed it over the captured ``runtime_holdout`` windows
  (:func:`hebrus_flywheel.consumers.holdout.sequence_id_reuse`).

No torch, no Kafka: four lineage columns read through the snapshot contract.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hebrus_flywheel.core.snapshot import SnapshotContractError, open_snapshot
from hebrus_flywheel.train.qualify.collect_data import SnapshotInfo
from hebrus_flywheel.train.qualify.data_evidence import OpaqueIds
from hebrus_flywheel.train.qualify.errors import InputError

WINDOW_COLUMNS = ("window_id", "owner", "thread", "generation")
MAX_EXAMPLES = 10


def window_id_reuse(rows: Iterable[Mapping[str, Any]], source: str) -> OpaqueIds:
    """Window ids seen under more than one ``(owner, thread, generation)`` in ``rows``."""
    seen: dict[str, set[tuple[str, str, int]]] = {}
    for row in rows:
        seen.setdefault(str(row["window_id"]), set()).add(
            (str(row["owner"]), str(row["thread"]), int(row["generation"])))
    reused = sorted(w for w, where in seen.items() if len(where) > 1)
    examples = tuple(f"{w[:12]}: " + ", ".join(f"{o}/{t} g{g}" for o, t, g in sorted(seen[w]))
                     for w in reused[:MAX_EXAMPLES])
    return OpaqueIds(kind="window_id", checked=len(seen), reused=len(reused), source=source,
                     examples=examples)


def _distinct_window_rows(info: SnapshotInfo) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    try:
        snapshot = open_snapshot(info.directory, expected_id=info.snapshot_id)
        for index in range(len(snapshot.manifest.shards)):
            table = snapshot.read_shard(index, list(WINDOW_COLUMNS))
            rows += table.group_by(list(WINDOW_COLUMNS)).aggregate([]).to_pylist()
    except SnapshotContractError as exc:
        raise InputError(f"cannot read the window lineage of {info.directory}: {exc}") from exc
    return rows


def sequence_id_reuse(parity: Mapping[str, Any] | None) -> OpaqueIds | None:
    """The seal's sequence-id measurement (``parity.opaque_ids``), when recorded."""
    node = (parity or {}).get("opaque_ids")
    if not isinstance(node, Mapping):
        return None
    try:
        return OpaqueIds(kind="sequence_id", checked=int(node["sequence_ids"]),
                         reused=int(node["reused"]), source=str(node["source"]),
                         examples=tuple(str(x) for x in node.get("examples") or ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"the manifest's parity.opaque_ids is malformed ({exc}); reseal "
                         "the epoch") from exc


def opaque_id_evidence(info: SnapshotInfo) -> tuple[OpaqueIds, ...]:
    """Every opaque-id measurement the snapshot allows (window ids always)."""
    shards = len(info.manifest.get("shards") or [])
    found = [window_id_reuse(_distinct_window_rows(info),
                             f"window_id/owner/thread/generation columns of the {shards} "
                             f"shard(s) of snapshot {info.snapshot_id[:12]}")]
    sequences = sequence_id_reuse(info.manifest.get("parity"))
    if sequences is not None:
        found.append(sequences)
    return tuple(found)
