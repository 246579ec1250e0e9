"""Open, verify and read a sealed snapshot; every reader goes through here.

Verification is all-or-nothing: the manifest must hash to its snapshot id (and to the
expected id when given), every listed shard must exist as a regular file with its byte
count and SHA-256, and no other file (hidden ones and symlinks included) may exist
under the snapshot. Readers that open lazily check each shard (bytes, SHA-256, footer
against the manifest) before using any of its rows, and refuse on any mismatch.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from hebrus_flywheel.core.snapshot.errors import ShardFormatError, VerifyError
from hebrus_flywheel.core.snapshot.manifest import (
    MANIFEST_FILE,
    Manifest,
    ManifestError,
    ShardEntry,
    load_manifest,
    manifest_path,
)
from hebrus_flywheel.core.snapshot.shard import read_shard_metadata


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(directory):
        base = Path(dirpath)
        for name in filenames + [d for d in dirnames if (base / d).is_symlink()]:
            out.add((base / name).relative_to(directory).as_posix())
    out.discard(MANIFEST_FILE)
    return out


def _file_problems(directory: Path, entry: ShardEntry, *, hash_bytes: bool = True) -> list[str]:
    path = directory / entry.path
    if path.is_symlink() or not path.is_file():
        return [f"{entry.path} is missing or not a regular file"]
    size = path.stat().st_size
    if size != entry.bytes:
        return [f"{entry.path} has {size} bytes, the manifest says {entry.bytes}"]
    if hash_bytes and (digest := sha256_file(path)) != entry.sha256:
        return [f"{entry.path} has SHA-256 {digest}, the manifest says {entry.sha256}"]
    return []


def _problems(directory: Path, manifest: Manifest, expected_id: str | None) -> list[str]:
    problems = []
    if expected_id is not None and manifest.snapshot_id != expected_id:
        problems.append(f"snapshot id is {manifest.snapshot_id}, expected {expected_id}")
    listed = {entry.path: entry for entry in manifest.shards}
    present = _files(directory)
    problems += [f"missing file {p}" for p in sorted(set(listed) - present)]
    problems += [f"extra file {p}" for p in sorted(present - set(listed))]
    for rel in sorted(set(listed) & present):
        problems += _file_problems(directory, listed[rel])
    return problems


def verify_snapshot(snapshot: Path, *, expected_id: str | None = None) -> dict[str, Any]:
    """Verify a sealed epoch; a summary on success, VerifyError listing every problem."""
    directory = manifest_path(snapshot).parent
    try:
        manifest = load_manifest(directory)
    except ManifestError as exc:
        raise VerifyError(f"snapshot {directory} failed verification: {exc}") from exc
    problems = _problems(directory, manifest, expected_id)
    if problems:
        more = f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""
        raise VerifyError(
            f"snapshot {manifest.snapshot_id} at {directory} failed verification: "
            + "; ".join(problems[:20]) + more
            + ". Do not train on it: restore the files from a copy or regenerate them with "
            "`flywheel rebuild --snapshot ...`")
    return {"snapshot_id": manifest.snapshot_id, "epoch": manifest.epoch,
            "shards": len(manifest.shards), "rows": manifest["totals"]["rows"],
            "bytes": manifest["totals"]["bytes"], "parity_authoritative":
            bool((manifest.get("parity") or {}).get("authoritative")),
            "parity_override": manifest.get("parity_override")}


class SealedSnapshot:
    """A verified-on-read sealed epoch: its manifest and checked access to its shards."""

    def __init__(self, directory: Path, manifest: Manifest, *, hash_on_read: bool) -> None:
        self.directory = directory
        self.manifest = manifest
        self._hash_on_read = hash_on_read
        self._checked: set[int] = set()

    @property
    def snapshot_id(self) -> str:
        return self.manifest.snapshot_id

    def row_groups(self, index: int) -> list[int | None]:
        """Row groups of shard ``index`` from its rows; ``[None]`` if the size is unknown."""
        size = self.manifest.row_group_rows
        if size is None:
            return [None]
        return list(range(math.ceil(self.manifest.shards[index].rows / size)))

    def check_shard(self, index: int) -> None:
        """VerifyError unless shard ``index`` matches the manifest (once per process)."""
        if index in self._checked:
            return
        entry = self.manifest.shards[index]
        where = f"snapshot {self.snapshot_id}: {entry.path}"
        problems = _file_problems(self.directory, entry, hash_bytes=self._hash_on_read)
        if problems:
            raise VerifyError(f"snapshot {self.snapshot_id}: {problems[0]}, so it differs from "
                              "its manifest; do not train on it: restore the file or rebuild "
                              "the snapshot (`flywheel rebuild`)")
        self._check_footer(entry, self.directory / entry.path, self.row_groups(index), where)
        self._checked.add(index)

    def _check_footer(self, entry: ShardEntry, path: Path, groups: list[int | None],
                      where: str) -> None:
        try:
            meta = pq.read_metadata(path)
            info = read_shard_metadata(meta.metadata)
        except (OSError, pa.ArrowException, ShardFormatError) as exc:
            raise VerifyError(f"{where} has an unreadable footer: {exc}") from exc
        layout = self.manifest.layout
        same = layout is not None and layout.to_dict() == {k: info.get(k)
                                                            for k in layout.to_dict()}
        if (not same or meta.num_rows != entry.rows or info.get("split") != entry.split
                or info.get("identity_id") != self.manifest.identity.get("identity_id")
                or (groups != [None] and meta.num_row_groups != len(groups))):
            raise VerifyError(f"{where}: footer disagrees with the manifest (rows, split, row "
                              "groups, identity or layout); the snapshot is inconsistent")

    def read_shard(self, index: int, columns: Sequence[str],
                   row_group: int | None = None) -> pa.Table:
        """Rows of shard ``index`` (one row group, or all), checking the shard first."""
        self.check_shard(index)
        path = self.directory / self.manifest.shards[index].path
        try:
            handle = pq.ParquetFile(path)
            if row_group is None:
                return handle.read(columns=list(columns))
            return handle.read_row_group(row_group, columns=list(columns))
        except (OSError, pa.ArrowException) as exc:
            raise VerifyError(f"cannot read {path}: {exc}; verify the snapshot") from exc


def open_snapshot(path: Path, *, expected_id: str | None = None,
                  verify: Literal["lazy", "full"] = "lazy") -> SealedSnapshot:
    """Open a sealed epoch from its manifest (``lazy``) or after a full verification.

    ``lazy`` reads only ``manifest.json`` now and hashes each shard when first read;
    ``full`` runs :func:`verify_snapshot` first (also refusing extra files).
    """
    if verify not in ("lazy", "full"):
        raise VerifyError(f"verify must be 'lazy' or 'full', got {verify!r}")
    directory = manifest_path(Path(path)).parent
    if verify == "full":
        verify_snapshot(directory, expected_id=expected_id)
    manifest = load_manifest(directory)
    if expected_id is not None and manifest.snapshot_id != expected_id:
        raise VerifyError(f"snapshot {directory} is {manifest.snapshot_id}, expected "
                          f"{expected_id}; point at the snapshot you meant")
    return SealedSnapshot(directory, manifest, hash_on_read=verify == "lazy")
