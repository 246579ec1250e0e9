"""Checkpoints on an object store (``s3://bucket/prefix/run``): staged, published, fetched.

``flywheel train --out s3://…`` trains into a local staging directory,
``$FLYWHEEL_HOME/storage/outbox/<digest of the URL>/`` (a crash leaves it there and the
same command resumes writing it), and rank 0 publishes it when training ends:
``checkpoint.pt`` and ``history.jsonl`` first, ``lineage.json`` last, each with
``Content-MD5``. ``published.json`` in the staging directory names the URL, so an erasure
that taints the staged copy taints the published one too
(:func:`hebrus_flywheel.core.taint.taint_published`).

Readers (``--resume``, ``flywheel evaluate --checkpoint``) read the URL's
``lineage.json`` each time and fetch the checkpoint into
``$FLYWHEEL_HOME/storage/cache/checkpoints/<checkpoint id>/`` once per id (a later run
may publish another checkpoint at the same URL), with the store's taint marker refreshed
on every read; :func:`~.checkpoint.load_checkpoint` then checks the checkpoint id against
the parameters as for a local file. The embedded store keeps checkpoints in
their own bucket, ``flywheel-checkpoints``, the only one the ``trainer`` keys may write.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from hebrus_flywheel.core.files import (
    atomic_write_bytes,
    atomic_write_json,
    fill_dir_once,
)
from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.core.storage import S3Store, S3Url, is_object_url, s3_target
from hebrus_flywheel.core.storage.config import CHECKPOINT_ROLE
from hebrus_flywheel.core.taint import PUBLISHED_FILE, TAINT_FILE
from hebrus_flywheel.train.checkpoint import CHECKPOINT_FILE, HISTORY_FILE, LINEAGE_FILE
from hebrus_flywheel.train.exceptions import CheckpointError

PUBLISH_ORDER = (CHECKPOINT_FILE, HISTORY_FILE, LINEAGE_FILE)  # lineage last


def _digest(url: str) -> str:
    return hashlib.sha256(str(S3Url.parse(url)).encode()).hexdigest()[:24]


def staging_dir(url: str, home: Path | None = None) -> Path:
    """Where ``flywheel train --out URL`` writes before publishing."""
    return (home or flywheel_home()) / "storage" / "outbox" / _digest(url)


def output_dir(out: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """The local directory training writes, and the URL to publish it to (None: local)."""
    if isinstance(out, str) and is_object_url(out):
        return staging_dir(out), str(S3Url.parse(out))
    return Path(out), None


def publish_checkpoint(local: Path, url: str, *, role: str = CHECKPOINT_ROLE) -> list[str]:
    """Upload a finished checkpoint directory to ``url``, lineage last; the keys written."""
    if not (local / LINEAGE_FILE).is_file() or not (local / CHECKPOINT_FILE).is_file():
        raise CheckpointError(f"{local} holds no finished checkpoint to publish to {url}")
    store = S3Store(url, s3_target(role))
    written = []
    for name in PUBLISH_ORDER:
        if (local / name).is_file():
            store.put_file(name, local / name)
            written.append(name)
    atomic_write_json(local / PUBLISHED_FILE, {"url": str(S3Url.parse(url))})
    return written


def fetch_checkpoint(url: str, *, role: str = CHECKPOINT_ROLE,
                     home: Path | None = None) -> Path:
    """The local copy of the checkpoint at ``url``, cached by its checkpoint id (so ranks
    fetching at once share one copy), with the store's taint marker refreshed."""
    store = S3Store(url, s3_target(role))
    present = store.objects("")
    lineage = store.get_bytes(LINEAGE_FILE) if CHECKPOINT_FILE in present else None
    if lineage is None:
        raise CheckpointError(f"{url} holds no published checkpoint ({CHECKPOINT_FILE} and "
                              f"{LINEAGE_FILE}); write one with `flywheel train --out {url}`")
    try:
        checkpoint_id = str(json.loads(lineage)["checkpoint_id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{url}/{LINEAGE_FILE} names no checkpoint id") from exc
    def download(partial: Path) -> None:
        for name in PUBLISH_ORDER:
            if name in present:
                store.download(name, partial / name)

    root = (home or flywheel_home()) / "storage" / "cache" / "checkpoints"
    target = fill_dir_once(root / checkpoint_id, download, complete=CHECKPOINT_FILE)
    marker = store.get_bytes(TAINT_FILE)
    if marker is not None:
        atomic_write_bytes(target / TAINT_FILE, marker)
    return target


def localize_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A local checkpoint directory or file for ``path``: itself, or a fetched copy."""
    if isinstance(path, str) and is_object_url(path):
        return fetch_checkpoint(path)
    return Path(path)
