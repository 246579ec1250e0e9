"""``flywheel snapshots expire --dataset s3://bucket/prefix``: expiry on an object store.

The same rule as the local :mod:`.expire` (the newest ``keep`` sealed snapshots stay,
the others go once sealed longer ago than ``older_than``; epochs without a manifest are
never touched: they may be mid-publication), in the order that keeps the contract:

1. write ``_expiring/epoch=N`` (the snapshot id) — the resume marker;
2. delete ``epoch=N/manifest.json`` first: the epoch is no longer sealed, no reader opens it;
3. delete the epoch's other objects, then the marker.

A run killed anywhere is finished by the next (the marker names the epoch). "Sealed at"
is the manifest object's ``Last-Modified``.
"""

from __future__ import annotations

import json
import re
import time

from hebrus_flywheel.consumers.expire import EpochOutcome, ExpireResult
from hebrus_flywheel.core.durations import format_duration_ms
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.snapshot import MANIFEST_FILE
from hebrus_flywheel.core.storage import WRITE_ROLE, ObjectStore, open_store

MARKERS = "_expiring"
_SEALED_RE = re.compile(r"^epoch=(?P<n>[0-9]+)/manifest\.json$")
_MARKER_RE = re.compile(r"^_expiring/epoch=(?P<n>[0-9]+)$")


def _remove(store: ObjectStore, epoch: int, snapshot_id: str | None,
            state: str) -> EpochOutcome:
    marker = f"{MARKERS}/epoch={epoch}"
    store.put_bytes(marker, (snapshot_id or "").encode())
    store.delete([f"epoch={epoch}/{MANIFEST_FILE}"])  # unsealed from here on
    objects = store.objects(f"epoch={epoch}/")
    store.delete(sorted(objects))
    store.delete([marker])
    return EpochOutcome(epoch=epoch, state=state, snapshot_id=snapshot_id,
                        files=len(objects) + 1, bytes=sum(objects.values()))


def _snapshot_id(store: ObjectStore, key: str) -> str | None:
    data = store.get_bytes(key)
    try:
        return str(json.loads(data or b"{}").get("snapshot_id")) if data else None
    except ValueError:
        return None


def expire_published(root: str, *, older_than_ms: int, keep: int = 1, dry_run: bool = False,
                     now_s: float | None = None,
                     store: ObjectStore | None = None) -> ExpireResult:
    """Expire sealed snapshots under an ``s3://`` root (see the module doc)."""
    if keep < 0 or older_than_ms <= 0:
        raise ConfigError("expire: keep must be >= 0 and older_than_ms > 0")
    store = store if store is not None else open_store(root, WRITE_ROLE)
    now = time.time() if now_s is None else now_s
    result = ExpireResult(root=root, dry_run=dry_run)
    keys = store.objects("")
    pending = sorted(int(m["n"]) for k in keys if (m := _MARKER_RE.match(k)))
    for epoch in pending:
        sid = (store.get_bytes(f"{MARKERS}/epoch={epoch}") or b"").decode() or None
        result.epochs.append(EpochOutcome(epoch=epoch, state="would resume", snapshot_id=sid)
                             if dry_run else _remove(store, epoch, sid, "resumed"))
    sealed = sorted((int(m["n"]) for k in keys if (m := _SEALED_RE.match(k))), reverse=True)
    for rank, epoch in enumerate(e for e in sealed if e not in pending):
        key = f"epoch={epoch}/{MANIFEST_FILE}"
        sealed_at = store.modified(key) or now
        sid = _snapshot_id(store, key)
        age = format_duration_ms(max(0, int(now - sealed_at)) * 1000)
        if rank < keep:
            outcome = EpochOutcome(epoch=epoch, state="kept", snapshot_id=sid,
                                   reason=f"one of the newest {keep}", sealed_age=age)
        elif (now - sealed_at) * 1000 <= older_than_ms:
            outcome = EpochOutcome(epoch=epoch, state="kept", snapshot_id=sid, sealed_age=age,
                                   reason=f"not older than {format_duration_ms(older_than_ms)}")
        elif dry_run:
            outcome = EpochOutcome(epoch=epoch, state="would remove", snapshot_id=sid,
                                   sealed_age=age)
        else:
            outcome = _remove(store, epoch, sid, "removed")
        result.epochs.append(outcome)
    return result
