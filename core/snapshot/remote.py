"""Sealed snapshots on an object store (``s3://bucket/prefix/epoch=N``): fetched, verified.

The layout is the local one, object for file: ``<root>/epoch=N/manifest.json`` and
``<root>/epoch=N/split=S/<shard>.parquet``. The manifest is the commit point: it is
written last (:mod:`hebrus_flywheel.consumers.publish`), so an epoch without one is not
sealed and no reader opens it.

Readers fetch a sealed epoch into a local cache, ``$FLYWHEEL_HOME/storage/cache/<snapshot
id>/`` (files 0640), and then use the ordinary POSIX code on it: every download is hashed
while it is written and compared with the manifest (size and SHA-256) before the cache
directory is renamed into place, and :class:`~.read.SealedSnapshot` checks every shard
again when it is first read. The cache is keyed by the snapshot id read from the store
each time, so a superseded snapshot is never read from a stale cache. Verification
(:func:`verify_remote`) always downloads afresh into a temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hebrus_flywheel.core.files import atomic_write_bytes, fill_dir_once
from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.core.snapshot.errors import ManifestError, VerifyError
from hebrus_flywheel.core.snapshot.manifest import MANIFEST_FILE, Manifest, parse_manifest
from hebrus_flywheel.core.storage import (
    READ_ROLE,
    ObjectStore,
    S3Url,
    StorageError,
    is_object_url,
    open_store,
)


def epoch_url(url: str) -> str:
    """``s3://.../epoch=N`` for the epoch itself or its ``manifest.json``."""
    parsed = S3Url.parse(url)
    prefix = parsed.prefix
    if prefix.endswith("/" + MANIFEST_FILE) or prefix == MANIFEST_FILE:
        prefix = prefix[: -len(MANIFEST_FILE)].rstrip("/")
    if not prefix.rsplit("/", 1)[-1].startswith("epoch="):
        raise ManifestError(f"{url} is not a sealed epoch: point at s3://bucket/prefix/epoch=N")
    return S3Url(bucket=parsed.bucket, prefix=prefix).child()


def _store(url: str, store: ObjectStore | None) -> ObjectStore:
    return store if store is not None else open_store(epoch_url(url), READ_ROLE)


def remote_manifest(url: str, *, store: ObjectStore | None = None) -> tuple[Manifest, bytes]:
    """The parsed manifest of a sealed remote epoch and its bytes; ManifestError when the
    epoch has none (not sealed, or a publication that has not finished)."""
    where = f"{epoch_url(url)}/{MANIFEST_FILE}"
    try:
        data = _store(url, store).get_bytes(MANIFEST_FILE)
    except StorageError as exc:
        raise ManifestError(f"cannot read {where}: {exc}") from exc
    if data is None:
        raise ManifestError(f"{where} does not exist: the epoch is not sealed (or its "
                            "publication has not finished; re-run the same seal)")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"cannot read {where}: {exc}; the manifest is damaged") from exc
    return parse_manifest(value, where=where), data


def _download_all(store: ObjectStore, manifest: Manifest, data: bytes, dest: Path,
                  where: str) -> None:
    """Every object of the epoch into ``dest``, each compared with the manifest."""
    listed = store.objects("")
    listed.pop(MANIFEST_FILE, None)
    entries = {entry.path: entry for entry in manifest.shards}
    problems = [f"missing object {p}" for p in sorted(set(entries) - set(listed))]
    problems += [f"{p} has {listed[p]} bytes, the manifest says {e.bytes}"
                 for p, e in sorted(entries.items()) if p in listed and listed[p] != e.bytes]
    if not problems:
        for key in sorted(listed):
            digest = store.download(key, dest / key)
            entry = entries.get(key)
            if entry is not None and digest != entry.sha256:
                problems.append(f"{key} has SHA-256 {digest}, the manifest says {entry.sha256}")
    if problems:
        raise VerifyError(f"snapshot {manifest.snapshot_id} at {where} failed verification: "
                          + "; ".join(problems[:20]) + ". Do not train on it: publish it "
                          "again from the sealed local epoch or rebuild it")
    atomic_write_bytes(dest / MANIFEST_FILE, data)


def cache_root() -> Path:
    return flywheel_home() / "storage" / "cache"


def fetch_snapshot(url: str, *, store: ObjectStore | None = None,
                   cache: Path | None = None) -> Path:
    """The local copy of a sealed remote epoch (downloaded and checked once per id)."""
    store = _store(url, store)
    manifest, data = remote_manifest(url, store=store)
    target = (cache or cache_root()) / manifest.snapshot_id
    return fill_dir_once(
        target, lambda partial: _download_all(store, manifest, data, partial, epoch_url(url)),
        complete=MANIFEST_FILE)


@contextlib.contextmanager
def fresh_copy(url: str, *, store: ObjectStore | None = None) -> Iterator[Path]:
    """A freshly downloaded and checked copy of a remote epoch, removed afterwards."""
    store = _store(url, store)
    manifest, data = remote_manifest(url, store=store)
    with tempfile.TemporaryDirectory(prefix="flywheel-verify-") as tmp:
        _download_all(store, manifest, data, Path(tmp), epoch_url(url))
        yield Path(tmp)


def localize(snapshot: str | os.PathLike[str]) -> Path:
    """A local epoch directory (or manifest file) for ``snapshot``: itself, or the cached
    copy of an ``s3://`` epoch."""
    if isinstance(snapshot, str) and is_object_url(snapshot):
        return fetch_snapshot(snapshot)
    return Path(snapshot)
