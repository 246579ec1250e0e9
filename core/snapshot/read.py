"""Open, verify and read a sealed snapshot; every reader goes through here.

Verification is all-or-nothing: the manifest must hash to its snapshot id (and to the
expected id when given), every listed shard must exist as a regular file with its byte
count and SHA-256, and no other file (hidden ones and symlinks included) may exist
under the snapshot. Readers that open lazily check each shard (bytes, SHA-256, footer
against the manifest) before using any of its rows, and refuse on any mismatch.

Encrypted shards (:mod:`hebrus_flywheel.core.snapshot.crypto`): verification without keys
checks the ciphertext (``sha256``); ``keys=True`` also decrypts every shard, re-encodes
its rows without encryption and compares ``plaintext_sha256``. Readers decrypt with the
default local key file (never created by a reader) or a given :class:`ShardCrypto`; no
key file or the wrong KEK raises :class:`KeyAccessError` naming what to do.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

from hebrus_flywheel.core.snapshot.crypto import (
    KEY_PLAINTEXT_SHA256,
    ShardCrypto,
    check_kek,
    default_crypto,
    is_encrypted,
    open_parquet,
    read_parquet,
)
from hebrus_flywheel.core.snapshot.encode import ParquetSettings, plaintext_sha256
from hebrus_flywheel.core.snapshot.errors import (
    KeyAccessError,
    ProductError,
    ShardFormatError,
    VerifyError,
)
from hebrus_flywheel.core.snapshot.manifest import (
    MANIFEST_FILE,
    Manifest,
    ManifestError,
    ShardEntry,
    load_manifest,
    manifest_path,
)
from hebrus_flywheel.core.snapshot.remote import fetch_snapshot, fresh_copy
from hebrus_flywheel.core.snapshot.shard import (
    PRODUCT_CLEAN,
    PRODUCTS,
    read_shard_metadata,
    shard_product,
)
from hebrus_flywheel.core.storage import is_object_url


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


def manifest_crypto(manifest: Manifest, crypto: ShardCrypto | None) -> ShardCrypto | None:
    """The crypto to read ``manifest``'s shards with (None when they are plaintext);
    KeyAccessError when no key file is at hand or it holds another KEK."""
    record = manifest.encryption
    if record is None:
        return None
    chosen = crypto or default_crypto()
    check_kek(record, chosen, f"snapshot {manifest.snapshot_id}")
    return chosen


def _plaintext_problems(directory: Path, manifest: Manifest,
                        crypto: ShardCrypto | None) -> list[str]:
    chosen = manifest_crypto(manifest, crypto)
    settings = ParquetSettings.from_mapping(manifest["determinism"].get("shard") or {})
    problems = []
    for entry in manifest.shards:
        try:
            table = read_parquet(directory / entry.path, crypto=chosen)
        except (OSError, pa.ArrowException) as exc:
            problems.append(f"{entry.path} cannot be read: {exc}")
            continue
        digest = plaintext_sha256(table, settings)
        if digest != entry.plaintext_sha256:
            problems.append(f"{entry.path} decrypts to plaintext SHA-256 {digest}, the manifest "
                            f"says {entry.plaintext_sha256}")
    return problems


def verify_snapshot(snapshot: Path | str, *, expected_id: str | None = None,
                    keys: bool = False, crypto: ShardCrypto | None = None) -> dict[str, Any]:
    """Verify a sealed epoch; a summary on success, VerifyError listing every problem.

    Without ``keys`` no key is needed (ciphertext digests); with ``keys`` every shard is
    also decrypted and its plaintext digest compared (KeyAccessError without the KEK).
    An ``s3://.../epoch=N`` is downloaded afresh (every object, extra ones included) and
    verified the same way.
    """
    if isinstance(snapshot, str) and is_object_url(snapshot):
        try:
            with fresh_copy(snapshot) as copy:
                return {**verify_snapshot(copy, expected_id=expected_id, keys=keys,
                                          crypto=crypto), "location": snapshot}
        except ManifestError as exc:
            raise VerifyError(f"snapshot {snapshot} failed verification: {exc}") from exc
    directory = manifest_path(Path(snapshot)).parent
    try:
        manifest = load_manifest(directory)
    except ManifestError as exc:
        raise VerifyError(f"snapshot {directory} failed verification: {exc}") from exc
    problems = _problems(directory, manifest, expected_id)
    if keys and not problems:
        problems = _plaintext_problems(directory, manifest, crypto)
    if problems:
        more = f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""
        raise VerifyError(
            f"snapshot {manifest.snapshot_id} at {directory} failed verification: "
            + "; ".join(problems[:20]) + more
            + ". Do not train on it: restore the files from a copy or regenerate them with "
            "`flywheel rebuild --snapshot ...`")
    return {"snapshot_id": manifest.snapshot_id, "content_id": manifest.content_id,
            "epoch": manifest.epoch, "shards": len(manifest.shards),
            "rows": manifest["totals"]["rows"], "bytes": manifest["totals"]["bytes"],
            "encrypted": manifest.encryption is not None, "plaintext_checked": keys,
            "parity_authoritative":
            bool((manifest.get("parity") or {}).get("authoritative")),
            "parity_override": manifest.get("parity_override")}


class SealedSnapshot:
    """A verified-on-read sealed epoch: its manifest and checked access to its shards."""

    def __init__(self, directory: Path, manifest: Manifest, *, hash_on_read: bool,
                 crypto: ShardCrypto | None = None) -> None:
        self.directory = directory
        self.manifest = manifest
        self._hash_on_read = hash_on_read
        self._checked: set[int] = set()
        self._given_crypto = crypto
        self._crypto: ShardCrypto | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for spawned DataLoader workers: keys are loaded again there."""
        return {**self.__dict__, "_crypto": None}

    def crypto(self) -> ShardCrypto | None:
        """The keys to read shards with (loaded once, on the first encrypted read)."""
        if self._crypto is None and self.manifest.encryption is not None:
            self._crypto = manifest_crypto(self.manifest, self._given_crypto)
        return self._crypto

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
        if is_encrypted(path) != (self.manifest.encryption is not None):
            raise VerifyError(f"{where}: the manifest says the shards are "
                              f"{'encrypted' if self.manifest.encryption else 'plaintext'}, "
                              "the file is not; the snapshot is inconsistent")
        crypto = self.crypto()
        try:
            meta = open_parquet(path, crypto).metadata
            info = read_shard_metadata(meta.metadata)
        except (OSError, pa.ArrowException, ShardFormatError) as exc:
            raise VerifyError(f"{where} has an unreadable footer: {exc}") from exc
        plain = (meta.metadata or {}).get(KEY_PLAINTEXT_SHA256)
        plain_ok = entry.plaintext_sha256 == (entry.sha256 if crypto is None
                                              else (plain or b"").decode())
        layout = self.manifest.layout
        same = layout is not None and layout.to_dict() == {k: info.get(k)
                                                            for k in layout.to_dict()}
        if (not same or not plain_ok or meta.num_rows != entry.rows
                or shard_product(info) != self.manifest.product
                or info.get("split") != entry.split
                or info.get("identity_id") != self.manifest.identity.get("identity_id")
                or (groups != [None] and meta.num_row_groups != len(groups))):
            raise VerifyError(f"{where}: footer disagrees with the manifest (rows, split, row "
                              "groups, identity, layout or plaintext digest); the snapshot is "
                              "inconsistent")

    def read_shard(self, index: int, columns: Sequence[str] | None,
                   row_group: int | None = None) -> pa.Table:
        """Rows of shard ``index`` (``columns`` or all; one row group, or all), checking
        the shard first.

        KeyAccessError when the shard is encrypted and the reader lacks its KEK.
        """
        self.check_shard(index)
        path = self.directory / self.manifest.shards[index].path
        try:
            return read_parquet(path, columns, self.crypto(), row_group)
        except KeyAccessError:
            raise
        except (OSError, pa.ArrowException) as exc:
            raise VerifyError(f"cannot read {path}: {exc}; verify the snapshot") from exc


def open_snapshot(path: Path | str, *, expected_id: str | None = None,
                  verify: Literal["lazy", "full"] = "lazy",
                  crypto: ShardCrypto | None = None,
                  products: Collection[str] = (PRODUCT_CLEAN,)) -> SealedSnapshot:
    """Open a sealed epoch from its manifest (``lazy``) or after a full verification.

    ``lazy`` reads only ``manifest.json`` now and hashes each shard when first read;
    ``full`` runs :func:`verify_snapshot` first (also refusing extra files). Encrypted
    shards are read with ``crypto``, else the default local key file. An
    ``s3://.../epoch=N`` is read from its checked local cache (:mod:`.remote`).
    ``products`` are the replay products the caller reads: clean-path only by default,
    so a candidate-path snapshot raises :class:`ProductError` (and the reverse with
    ``products=("candidate_path",)``); pass both to read either.
    """
    if verify not in ("lazy", "full"):
        raise VerifyError(f"verify must be 'lazy' or 'full', got {verify!r}")
    unknown = sorted(set(products) - set(PRODUCTS))
    if unknown or not products:
        raise ProductError(f"products must be a non-empty subset of {PRODUCTS}, got "
                           f"{sorted(products)}")
    local = fetch_snapshot(path) if isinstance(path, str) and is_object_url(path) else Path(path)
    directory = manifest_path(local).parent
    if verify == "full":
        verify_snapshot(directory, expected_id=expected_id)
    manifest = load_manifest(directory)
    if expected_id is not None and manifest.snapshot_id != expected_id:
        raise VerifyError(f"snapshot {directory} is {manifest.snapshot_id}, expected "
                          f"{expected_id}; point at the snapshot you meant")
    if manifest.product not in products:
        raise ProductError(
            f"snapshot {manifest.snapshot_id} at {directory} is a {manifest.product} snapshot "
            f"but this reader reads {sorted(products)}; candidate-path rows (rejected suffixes "
            "included) must never be read as clean-path state. Pass products=(...) naming "
            "both products to read it anyway")
    return SealedSnapshot(directory, manifest, hash_on_read=verify == "lazy", crypto=crypto)
