"""Publish a sealed epoch to an object store root (``s3://bucket/prefix``), atomically.

The snapshot contract on object storage (:mod:`hebrus_flywheel.core.snapshot.remote`):

1. **Claim** the epoch: write ``_seal/epoch=N/<snapshot id>`` (empty), then list
   ``_seal/epoch=N/``. Any other claim there means another sealer is publishing another
   snapshot of this epoch: ours is withdrawn and :class:`PublishError` raised. Because
   each sealer writes its claim *before* listing and the listing is strongly consistent
   (S3 since 2020, SeaweedFS's filer), of two racing sealers at least the later
   one sees the other's claim, so two different snapshots never both pass; the claim of
   the same snapshot id (a re-run after a crash) is ours and is reused.
2. **Shards first**: every shard is uploaded under its immutable name
   ``epoch=N/split=S/<shard>.parquet`` with ``Content-MD5`` (a damaged upload is refused
   by the server). An epoch prefix holding objects the manifest does not list is refused.
3. **Manifest last** — the commit point: ``epoch=N/manifest.json`` is written with
   ``If-None-Match: *`` (a conditional put: stores that honour it — AWS S3, MinIO, Ceph,
   SeaweedFS, the embedded store — refuse a second one at the server; S3Proxy 2.6.0
   accepts the header but does not enforce it, which is why step 1 exists) and read
   back: if it is not ours, another snapshot sealed the epoch and PublishError says so.
4. The claim is removed.

**Superseding** (erasure, :mod:`.supersede`): a local epoch whose manifest ``supersedes``
the snapshot published at the root replaces it. Under the same claim its shards are
uploaded over the old objects of the same names (a reader of the old manifest then fails
its SHA-256 check and refuses: never a mix), objects the new manifest does not list are
deleted, and the new manifest is written last. The old rows are gone from the store once
their objects are overwritten (keep bucket versioning off, or expire old versions, for
erasure to hold).

A crash anywhere leaves either no ``manifest.json`` (no reader opens the epoch; re-running
the same seal resumes from step 1 with the same claim) or the whole snapshot.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from hebrus_flywheel.consumers import faults
from hebrus_flywheel.consumers.exceptions import PublishError
from hebrus_flywheel.core.snapshot import MANIFEST_FILE, Manifest, parse_manifest
from hebrus_flywheel.core.storage import WRITE_ROLE, ObjectStore, StorageError, open_store

log = logging.getLogger(__name__)

CLAIMS = "_seal"


@dataclass(frozen=True, kw_only=True)
class PublishResult:
    """Where a sealed epoch was published."""

    url: str
    snapshot_id: str
    shards: int
    already_published: bool


def _read_manifest(directory: Path) -> tuple[Manifest, bytes]:
    data = (directory / MANIFEST_FILE).read_bytes()
    return parse_manifest(json.loads(data), where=str(directory / MANIFEST_FILE)), data


def _published_id(store: ObjectStore, key: str) -> str | None:
    data = store.get_bytes(key)
    if data is None:
        return None
    return str(parse_manifest(json.loads(data), where=f"{store.location}/{key}").snapshot_id)


def claim_epoch(store: ObjectStore, epoch: int, snapshot_id: str) -> str:
    """Step 1 of the module doc; the claim's key."""
    prefix = f"{CLAIMS}/epoch={epoch}/"
    mine = prefix + snapshot_id
    store.put_bytes(mine, b"")
    others = sorted(k[len(prefix):] for k in store.objects(prefix) if k != mine)
    if others:
        store.delete([mine])
        raise PublishError(
            f"another sealer is publishing snapshot {others[0]} of epoch {epoch} to "
            f"{store.location} (its claim {prefix}{others[0]}); ours ({snapshot_id}) was "
            "withdrawn. If that sealer died, check its snapshot, delete the claim and re-run "
            "the seal")
    return mine


def _conflict(location: str, epoch: int, theirs: str, ours: str) -> PublishError:
    return PublishError(f"epoch {epoch} at {location} is already sealed as snapshot {theirs}; "
                        f"ours is {ours}. Two different snapshots of one epoch cannot both "
                        "be sealed: find out why they differ (different inputs or writer?)")


def publish_epoch(directory: Path, root: str, *, store: ObjectStore | None = None
                  ) -> PublishResult:
    """Publish the sealed epoch ``directory`` under ``root`` (see the module doc); resumable
    and idempotent for the same snapshot."""
    manifest, data = _read_manifest(Path(directory))
    store = store if store is not None else open_store(root, WRITE_ROLE)
    base, url = f"epoch={manifest.epoch}/", f"{root.rstrip('/')}/epoch={manifest.epoch}"
    try:
        existing = _published_id(store, base + MANIFEST_FILE)
        if existing == manifest.snapshot_id:
            return PublishResult(url=url, snapshot_id=existing, shards=len(manifest.shards),
                                 already_published=True)
        supersedes = existing is not None and manifest.get("supersedes") == existing
        if existing is not None and not supersedes:
            raise _conflict(store.location, manifest.epoch, existing, manifest.snapshot_id)
        claim = claim_epoch(store, manifest.epoch, manifest.snapshot_id)
        _upload_shards(store, Path(directory), manifest, base, replace=supersedes)
        faults.hit("publish_before_manifest")
        store.put_bytes(base + MANIFEST_FILE, data, if_absent=not supersedes)
        winner = _published_id(store, base + MANIFEST_FILE)
        if winner != manifest.snapshot_id:
            raise _conflict(store.location, manifest.epoch, str(winner), manifest.snapshot_id)
        store.delete([claim])
    except StorageError as exc:
        raise PublishError(f"cannot publish epoch {manifest.epoch} to {root}: {exc}; the "
                           "epoch is not sealed there until its manifest is; re-run the "
                           "seal") from exc
    log.info("published snapshot %s to %s", manifest.snapshot_id, url)
    return PublishResult(url=url, snapshot_id=manifest.snapshot_id,
                         shards=len(manifest.shards), already_published=False)


def _upload_shards(store: ObjectStore, directory: Path, manifest: Manifest, base: str, *,
                   replace: bool) -> None:
    listed = {entry.path for entry in manifest.shards} | ({MANIFEST_FILE} if replace else set())
    stray = sorted(k for k in store.objects(base) if k[len(base):] not in listed)
    if stray and replace:
        store.delete(stray)  # the superseded snapshot's objects the new one drops
    elif stray:
        raise PublishError(f"{store.location}/{base} holds objects snapshot "
                           f"{manifest.snapshot_id} does not list ({stray[:5]}); an unsealed "
                           "epoch prefix must hold only this snapshot's shards. Delete them "
                           "(they belong to no sealed snapshot) and re-run the seal")
    for entry in manifest.shards:
        store.put_file(base + entry.path, directory / entry.path)
        faults.hit("publish_after_shard")
