"""``flywheel verify SNAPSHOT``: the epoch directory is exactly what its manifest says.

Checks, all reported together: the manifest hashes to its snapshot id (and to the
expected id when one is given); every listed shard exists with its byte count and
SHA-256; no other file (hidden ones included) exists anywhere under the snapshot.
Any difference raises :class:`VerifyError` (the CLI exits with status 2).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers.exceptions import ManifestError, VerifyError
from hebrus_flywheel.consumers.manifest import MANIFEST_FILE, load_manifest, manifest_path
from hebrus_flywheel.consumers.shards import sha256_file


def _files(directory: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(directory):
        base = Path(dirpath)
        for name in filenames + [d for d in dirnames if (base / d).is_symlink()]:
            out.add((base / name).relative_to(directory).as_posix())
    out.discard(MANIFEST_FILE)
    return out


def _shard_problems(directory: Path, entry: dict[str, Any]) -> list[str]:
    path = directory / entry["path"]
    if path.is_symlink() or not path.is_file():
        return [f"{entry['path']} is not a regular file"]
    size = path.stat().st_size
    if size != entry["bytes"]:
        return [f"{entry['path']} has {size} bytes, the manifest says {entry['bytes']}"]
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        return [f"{entry['path']} has SHA-256 {digest}, the manifest says {entry['sha256']}"]
    return []


def verify_snapshot(snapshot: Path, *, expected_id: str | None = None) -> dict[str, Any]:
    """Verify a sealed epoch; a summary on success, VerifyError listing every problem."""
    directory = manifest_path(snapshot).parent
    try:
        manifest = load_manifest(directory)
    except ManifestError as exc:
        raise VerifyError(f"snapshot {directory} failed verification: {exc}") from exc
    problems = []
    if expected_id is not None and manifest["snapshot_id"] != expected_id:
        problems.append(f"snapshot id is {manifest['snapshot_id']}, expected {expected_id}")
    listed = {entry["path"]: entry for entry in manifest["shards"]}
    present = _files(directory)
    problems += [f"missing file {p}" for p in sorted(set(listed) - present)]
    problems += [f"extra file {p}" for p in sorted(present - set(listed))]
    for rel in sorted(set(listed) & present):
        problems += _shard_problems(directory, listed[rel])
    if problems:
        raise VerifyError(
            f"snapshot {manifest['snapshot_id']} at {directory} failed verification: "
            + "; ".join(problems[:20]) + (f" (+{len(problems) - 20} more)" if len(problems) > 20
                                          else "")
            + ". Do not train on it: restore the files from a copy or regenerate them with "
            "`flywheel rebuild --snapshot ...`"
        )
    return {"snapshot_id": manifest["snapshot_id"], "epoch": manifest["epoch"],
            "shards": len(listed), "rows": manifest["totals"]["rows"],
            "bytes": manifest["totals"]["bytes"], "parity_authoritative":
            bool((manifest.get("parity") or {}).get("authoritative")),
            "parity_override": manifest.get("parity_override")}
