"""Superseding snapshots: a sealed epoch rewritten without one owner's rows.

Sealed snapshots are immutable, so erasing an owner writes a *new* sealed snapshot of
the same epoch and retires the old one:

1. Build ``ROOT/.erasure/<old id>/epoch=N/``: every shard without the owner's rows is
   hard-linked (copied when links are impossible), byte-identical; every shard with
   them is read through the snapshot reader (decrypted, checked against the manifest),
   filtered and written again through the shard writer (:func:`consumers.shards.write_shard`,
   same settings and key file), its footer's row and window counts updated. A shard all
   of whose rows were the owner's is written with 0 rows, so the epoch still covers its
   offsets. The manifest is the old one with the new shard entries, split and total
   counts, ``supersedes: <old id>`` and an ``erasure`` record (owner pseudonym, rows
   removed, shards rewritten), and gets its own ids; the tree is made read-only.
2. Swap: the old ``epoch=N`` moves to ``ROOT/.superseded/<old id>/epoch=N`` and the new
   tree takes its place, so ``epoch=N`` (what readers, ``latest``-style lookups, seal
   and expire look at) is always the live snapshot; superseded ones live only under the
   hidden ``.superseded`` folder that nothing reads.
3. ``ROOT/.superseded/<old id>.json`` records when the superseded files may be deleted
   (the grace period) and, once deleted, which files went.

Each step is checked against the files before it runs, so a run killed at any point
and run again finishes the same snapshot (:func:`supersede_epoch` is idempotent).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from hebrus_flywheel.consumers import faults
from hebrus_flywheel.consumers.exceptions import ConsumersError, ShardError
from hebrus_flywheel.consumers.manifest import (
    _splits,
    describe_shards,
    make_read_only,
    write_manifest,
)
from hebrus_flywheel.consumers.shards import (
    STAGING_DIR,
    ShardConfig,
    epoch_dir,
    iter_shards,
    write_shard,
)
from hebrus_flywheel.core.files import atomic_write_json, fsync_path, make_dirs
from hebrus_flywheel.core.snapshot import (
    MANIFEST_FILE,
    ShardCrypto,
    SnapshotContractError,
    content_digest,
    load_manifest,
    manifest_digest,
    open_snapshot,
    read_parquet,
    read_shard_metadata,
    shard_layout,
    shard_metadata,
    verify_snapshot,
)
from hebrus_flywheel.core.snapshot.crypto import default_crypto

WORK_DIR = ".erasure"
SUPERSEDED_DIR = ".superseded"


class EraseError(ConsumersError):
    """An erasure step cannot go on; the message says what to do."""


@dataclass(frozen=True, kw_only=True)
class Affected:
    """A sealed snapshot that holds rows of the owner being erased."""

    root: Path
    epoch: int
    snapshot_id: str
    owner_rows: int
    rows: int

    def to_json(self) -> dict[str, Any]:
        return {"dataset": str(self.root), "epoch": self.epoch, "snapshot_id": self.snapshot_id,
                "owner_rows": self.owner_rows, "rows": self.rows}


def _owner_rows(table: pa.Table, owner: str) -> int:
    return int(pc.sum(pc.equal(table.column("owner"), owner)).as_py() or 0)


def snapshot_owner_rows(directory: Path, owner: str,
                        crypto: ShardCrypto | None = None) -> tuple[int, int]:
    """(rows of ``owner``, all rows) of a sealed snapshot, read through the checked reader."""
    sealed = open_snapshot(directory, crypto=crypto)
    mine = total = 0
    for index in range(len(sealed.manifest.shards)):
        table = sealed.read_shard(index, ["owner"])
        mine += _owner_rows(table, owner)
        total += table.num_rows
    return mine, total


def sealed_epochs(root: Path) -> Iterator[tuple[int, Path]]:
    """``(epoch, directory)`` of every sealed epoch under a dataset root, in order."""
    for edir in sorted(Path(root).glob("epoch=*")):
        number = edir.name.partition("=")[2]
        if number.isdigit() and (edir / MANIFEST_FILE).is_file():
            yield int(number), edir


def find_affected(root: Path, owner: str) -> list[Affected]:
    """The live sealed snapshots under ``root`` that hold rows of ``owner``."""
    out = []
    for epoch, edir in sealed_epochs(root):
        try:
            snapshot_id = load_manifest(edir).snapshot_id
            mine, total = snapshot_owner_rows(edir, owner)
        except SnapshotContractError as exc:
            raise EraseError(f"cannot read the sealed snapshot {edir}: {exc}. Fix or restore it "
                             "(`flywheel verify`), then run the erasure again") from exc
        if mine:
            out.append(Affected(root=Path(root), epoch=epoch, snapshot_id=snapshot_id,
                                owner_rows=mine, rows=total))
    return out


def _without_owner(table: pa.Table, owner: str) -> pa.Table:
    """``table`` without ``owner``'s rows, its footer counts (rows, windows) updated."""
    kept = table.filter(pc.not_equal(table.column("owner"), owner))
    meta = dict(table.schema.metadata or {})
    info = read_shard_metadata(meta)
    windows = len(set(kept.column("window_id").to_pylist()))
    info.update(rows=kept.num_rows, windows=windows)
    meta.update(shard_metadata(shard_layout(meta), info))
    return kept.replace_schema_metadata(meta)


def _link_or_copy(source: Path, target: Path) -> None:
    make_dirs(target.parent)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _shard_config(manifest: Any) -> ShardConfig:
    recorded = dict(manifest["determinism"].get("shard") or {})
    return ShardConfig(**{k: v for k, v in recorded.items()
                          if k in ShardConfig.__dataclass_fields__})


def _paths(root: Path, epoch: int, old_id: str) -> dict[str, Path]:
    work = root / WORK_DIR / old_id
    grave = root / SUPERSEDED_DIR / old_id
    return {"live": epoch_dir(root, epoch), "work": work, "new": epoch_dir(work, epoch),
            "grave": grave, "old": epoch_dir(grave, epoch),
            "marker": root / SUPERSEDED_DIR / f"{old_id}.json"}


def build_superseding(root: Path, epoch: int, owner: str) -> dict[str, Any]:
    """Write the superseding tree of the live ``epoch=N`` under ``ROOT/.erasure`` (step 1
    of the module doc); its manifest."""
    live = epoch_dir(root, epoch)
    sealed = open_snapshot(live, verify="full")
    old_id = sealed.snapshot_id
    paths = _paths(root, epoch, old_id)
    _remove_tree(paths["work"])
    make_dirs(paths["new"])
    config, crypto = _shard_config(sealed.manifest), sealed.crypto()
    removed, rewritten = 0, []
    for index, entry in enumerate(sealed.manifest.shards):
        table = sealed.read_shard(index, None)
        mine = _owner_rows(table, owner)
        if not mine:
            _link_or_copy(live / entry.path, paths["new"] / entry.path)
            continue
        kept = _without_owner(table, owner)
        write_shard(paths["work"], f"epoch={epoch}/{entry.path}", kept, config,
                    windows=int(read_shard_metadata(kept.schema.metadata)["windows"]),
                    crypto=crypto)
        removed += mine
        rewritten.append(entry.path)
    manifest = _superseding_manifest(sealed.manifest.to_dict(), paths["work"], epoch, owner,
                                     removed, rewritten)
    _remove_tree(paths["work"] / STAGING_DIR)
    write_manifest(paths["work"], paths["new"], manifest)
    _remove_tree(paths["work"] / STAGING_DIR)
    make_read_only(paths["new"])
    return manifest


def _superseding_manifest(old: dict[str, Any], work: Path, epoch: int, owner: str,
                          removed: int, rewritten: list[str]) -> dict[str, Any]:
    entries = [{k: v for k, v in s.items() if k not in ("geometry", "encryption")}
               for s in describe_shards(work, epoch)]
    layers = int(old["determinism"]["geometry"]["layers"])
    totals = {k: sum(s[k] for s in entries) for k in ("windows", "rows", "bytes")}
    manifest = {k: v for k, v in old.items() if k not in ("snapshot_id", "content_id")}
    manifest.update(
        shards=entries, splits=_splits(entries, layers),
        totals={**totals, "shards": len(entries), "labels": totals["rows"] * layers},
        supersedes=old["snapshot_id"],
        erasure={"owner": owner, "supersedes": old["snapshot_id"], "rows_removed": removed,
                 "shards_rewritten": sorted(rewritten)})
    manifest["content_id"] = content_digest(manifest)
    manifest["snapshot_id"] = manifest_digest(manifest)
    return manifest


def _remove_tree(path: Path) -> None:
    """Delete a (possibly read-only) tree; nothing when it does not exist."""
    if not path.exists():
        return
    for dirpath, _, _ in os.walk(path):
        os.chmod(dirpath, 0o700)
    shutil.rmtree(path)


def _move_dir(source: Path, target: Path) -> None:
    """Rename a (read-only) directory to another parent, keeping its mode."""
    make_dirs(target.parent)
    mode = source.stat().st_mode & 0o777
    os.chmod(source, mode | 0o700)  # moving a directory rewrites its ".." entry
    os.replace(source, target)
    os.chmod(target, mode)
    fsync_path(source.parent)
    fsync_path(target.parent)


def _manifest_or_none(directory: Path) -> dict[str, Any] | None:
    try:
        return load_manifest(directory).to_dict() if (directory / MANIFEST_FILE).exists() \
            else None
    except SnapshotContractError:
        return None


def supersede_epoch(root: Path, epoch: int, old_id: str, owner: str, *,
                    grace_ms: int, now_ms: int | None = None) -> dict[str, Any]:
    """Replace the sealed snapshot ``old_id`` at ``ROOT/epoch=N`` by one without
    ``owner``'s rows (module doc); resumes a killed run. The superseding manifest."""
    root = Path(root).resolve()
    paths = _paths(root, epoch, old_id)
    live = _manifest_or_none(paths["live"])
    if live is not None and live.get("supersedes") == old_id:
        _mark(paths["marker"], live, old_id, grace_ms, now_ms)
        return live  # done before (a rerun)
    if live is not None and live["snapshot_id"] == old_id:
        new = _manifest_or_none(paths["new"])
        if new is None or new.get("supersedes") != old_id:
            new = build_superseding(root, epoch, owner)
        faults.hit("erase_before_swap")
        _move_dir(paths["live"], paths["old"])
        faults.hit("erase_between_renames")
    elif live is None and paths["old"].is_dir():
        new = _manifest_or_none(paths["new"])  # killed between the two renames
    else:
        found = "nothing" if live is None else f"snapshot {live['snapshot_id']}"
        raise EraseError(f"{paths['live']} holds {found}, not snapshot {old_id} or one that "
                         "supersedes it: it changed during the erasure. Inspect it, then run "
                         "`flywheel erase` again")
    if new is None:
        raise EraseError(f"the superseding tree {paths['new']} is missing or damaged while the "
                         f"old snapshot is already retired to {paths['old']}; move it back to "
                         f"{paths['live']} and run the erasure again")
    _move_dir(paths["new"], paths["live"])
    _remove_tree(paths["work"])
    _mark(paths["marker"], new, old_id, grace_ms, now_ms)
    return new


def _mark(marker: Path, new: dict[str, Any], old_id: str, grace_ms: int,
          now_ms: int | None) -> None:
    if marker.exists():
        return
    now = int(time.time() * 1000) if now_ms is None else now_ms
    make_dirs(marker.parent)
    atomic_write_json(marker, {"snapshot_id": old_id, "superseded_by": new["snapshot_id"],
                               "epoch": new["epoch"], "owner": new["erasure"]["owner"],
                               "superseded_at_ms": now, "delete_after_ms": now + grace_ms,
                               "deleted": None})


def read_marker(root: Path, old_id: str) -> dict[str, Any]:
    path = Path(root) / SUPERSEDED_DIR / f"{old_id}.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EraseError(f"cannot read {path}: {exc}; run `flywheel erase` again") from exc
    return dict(value)


def ancestors(root: Path, snapshot_id: str) -> set[str]:
    """Every snapshot that ``snapshot_id`` superseded, directly or through earlier
    erasures (from the markers, which outlive the deleted files): they held all its rows."""
    folder = Path(root) / SUPERSEDED_DIR
    parents: dict[str, list[str]] = {}
    for marker in folder.glob("*.json") if folder.is_dir() else []:
        try:
            body = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        parents.setdefault(str(body.get("superseded_by")), []).append(str(body["snapshot_id"]))
    found: set[str] = set()
    todo = [snapshot_id]
    while todo:
        for parent in parents.get(todo.pop(), []):
            if parent not in found:
                found.add(parent)
                todo.append(parent)
    return found


def purge_superseded(root: Path, *, now_ms: int | None = None) -> list[dict[str, Any]]:
    """Delete the files of every superseded snapshot under ``root`` whose grace period
    ended; what was deleted (per snapshot: files, bytes). Resumable: the list of files is
    recorded in the marker before any is deleted."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    folder = Path(root) / SUPERSEDED_DIR
    done = []
    for marker in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        body = json.loads(marker.read_text(encoding="utf-8"))
        if body.get("delete_after_ms", now + 1) > now:
            continue
        tree = folder / str(body["snapshot_id"])
        if body.get("deleted") is None:
            files = sorted(str(p.relative_to(folder)) for p in tree.rglob("*") if p.is_file())
            size = sum((folder / f).stat().st_size for f in files)
            body["deleted"] = {"files": files, "bytes": size, "deleted_at_ms": now,
                               "complete": False}
            atomic_write_json(marker, body)
        if tree.exists() or not body["deleted"]["complete"]:
            _remove_tree(tree)
            body["deleted"]["complete"] = True
            atomic_write_json(marker, body)
            done.append(body)
    return done


def verify_live(root: Path, epoch: int) -> tuple[bool, str | None]:
    """Whether ``ROOT/epoch=N`` verifies with its keys (decrypting every shard)."""
    try:
        verify_snapshot(epoch_dir(root, epoch), keys=True)
    except SnapshotContractError as exc:
        return False, str(exc)
    return True, None


def erase_unsealed(root: Path, owner: str) -> list[dict[str, Any]]:
    """Rewrite every shard of an epoch not sealed yet that holds ``owner``'s rows, without
    them (in place, through the shard writer), and delete leftover staging files; what was
    done. Run with the dataset's replay workers stopped."""
    root = Path(root).resolve()
    out: list[dict[str, Any]] = []
    for epoch, _split, path in iter_shards(root):
        if (epoch_dir(root, epoch) / MANIFEST_FILE).exists():
            continue
        try:
            table = read_parquet(path, crypto=default_crypto())
        except (OSError, pa.ArrowException, SnapshotContractError) as exc:
            raise EraseError(f"cannot read the unsealed shard {path}: {exc}") from exc
        mine = _owner_rows(table, owner)
        if not mine:
            continue
        kept = _without_owner(table, owner)
        relpath = str(path.relative_to(root))
        scratch = root / WORK_DIR / "unsealed"
        _remove_tree(scratch)
        write_shard(scratch, relpath, kept, _unsealed_config(root), crypto=default_crypto(),
                    windows=int(read_shard_metadata(kept.schema.metadata)["windows"]))
        os.replace(scratch / relpath, path)
        fsync_path(path.parent)
        _remove_tree(scratch)
        out.append({"path": relpath, "rows_removed": mine, "action": "rewritten"})
    staging = root / STAGING_DIR
    for leftover in sorted(staging.iterdir()) if staging.is_dir() else []:
        leftover.unlink(missing_ok=True)
        out.append({"path": str(leftover.relative_to(root)), "rows_removed": None,
                    "action": "deleted staging file"})
    return out


def _unsealed_config(root: Path) -> ShardConfig:
    from hebrus_flywheel.consumers.dataset import read_dataset

    try:
        return _shard_config(read_dataset(root))
    except (ConsumersError, ShardError, TypeError) as exc:
        raise EraseError(f"cannot read the shard settings of {root}: {exc}") from exc

