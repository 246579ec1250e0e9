"""Deterministic, atomic Parquet shards.

Names: a shard covers one contiguous range of source offsets of one (topic, partition),
``[first, last]`` inclusive, and is called
``<topic>.p<partition:03d>.o<first:020d>-<last:020d>.parquet`` under the Hive-style
folders ``epoch=<N>/split=<split>/``. The range is the *block* the rows came from
(:mod:`consumers.epochs`), so the name is a pure function of the input offsets.

Bytes: rows arrive sorted (:func:`consumers.labels.pack_rows`), every writer option is
pinned (:mod:`core.snapshot.encode`) and the only key/value metadata are the Arrow
schema and the contract's ``flywheel.*`` keys (:func:`core.snapshot.shard_metadata`),
without timestamps. Parquet's ``created_by`` is ``parquet-cpp-arrow version <pyarrow
version>``: stable for one pyarrow version, which is why manifests record the writer
versions and rebuilds check them. The same rows therefore give a byte-identical
*plaintext encoding*.

Encryption (secure by default): shards are written encrypted
(:mod:`core.snapshot.crypto`: encrypted footer, per-column keys wrapped by the KEK of the
default local key file, created on first write). Random data keys make the ciphertext
differ on every write, so the writer also encodes the rows without encryption in memory
and stores that encoding's SHA-256 in the (encrypted) footer as
``flywheel.plaintext_sha256``; :class:`ShardInfo` carries both digests. ``crypto=None``
writes plaintext shards (benchmarks, explicit opt-out; logged as a warning).

Durability: the file is written to ``<root>/.staging/`` (same filesystem), fsynced,
renamed over its final name with ``os.replace`` and the destination directory is
fsynced, so a crash at any point leaves either no shard or the whole shard. When the
final file already exists (a crash after the rename but before the offset commit,
then a replay of the same block) the new plaintext encoding must equal the old one;
anything else is a determinism bug and raises :class:`ShardError`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from hebrus_flywheel.consumers import faults
from hebrus_flywheel.consumers.exceptions import ShardError
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import FILE_MODE, fsync_path, make_dirs
from hebrus_flywheel.core.jsonio import canonical_json
from hebrus_flywheel.core.processes import pid_alive
from hebrus_flywheel.core.snapshot import (
    WEIGHT_ENCODINGS,
    KeyAccessError,
    ShardFormatError,
    read_shard_metadata,
    sha256_file,
)
from hebrus_flywheel.core.snapshot.crypto import (
    KEY_ENCRYPTION,
    KEY_PLAINTEXT_SHA256,
    ShardCrypto,
    default_crypto,
    open_parquet,
    read_parquet,
)
from hebrus_flywheel.core.snapshot.encode import (
    ParquetSettings,
    open_writer,
    plaintext_sha256,
    write_row_groups,
)

log = logging.getLogger(__name__)

STAGING_DIR = ".staging"
SHARD_SUFFIX = ".parquet"
_NAME_RE = re.compile(
    r"^(?P<topic>[A-Za-z0-9._-]+)\.p(?P<partition>\d{3,})\.o(?P<first>\d{20})-(?P<last>\d{20})"
    r"\.parquet$"
)
_EPOCH_RE = re.compile(r"^epoch=(?P<epoch>\d+)$")
_SPLIT_RE = re.compile(r"^split=(?P<split>[a-z_]+)$")
_HOST = socket.gethostname().replace(".", "_")
DEFAULT_CRYPTO = "default"
"""``write_shard(crypto=...)``: encrypt with the default local key file (created if need be)."""


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """How blocks and shards are cut and written; part of every manifest.

    Fields:
        offsets_per_shard: a shard covers at most this many consecutive source offsets
            of one partition, aligned to multiples of it (and cut at epoch boundaries).
        row_group_rows: rows per Parquet row group (fixed, so bytes do not depend on
            how rows arrived).
        compression_level: zstd level.
        weight_encoding: ``uint8`` (q/255, abs error <= 0.00196) or ``float16``.
        data_page_bytes: Parquet data page size target.
    """

    offsets_per_shard: int = 256
    row_group_rows: int = 8192
    compression_level: int = 3
    weight_encoding: str = "uint8"
    data_page_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("offsets_per_shard", "row_group_rows", "data_page_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ShardConfig.{name} must be a positive integer, got {value!r}")
        level = self.compression_level
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 22:
            raise ConfigError(f"ShardConfig.compression_level must be 1..22, got {level!r}")
        if self.weight_encoding not in WEIGHT_ENCODINGS:
            raise ConfigError(
                f"ShardConfig.weight_encoding must be 'uint8' or 'float16', "
                f"got {self.weight_encoding!r}"
            )


@dataclass(frozen=True, kw_only=True)
class ShardName:
    """The coordinates a shard's file name encodes."""

    topic: str
    partition: int
    first_offset: int
    last_offset: int

    @property
    def filename(self) -> str:
        return (f"{self.topic}.p{self.partition:03d}.o{self.first_offset:020d}-"
                f"{self.last_offset:020d}{SHARD_SUFFIX}")

    @classmethod
    def parse(cls, filename: str) -> ShardName:
        match = _NAME_RE.match(filename)
        if match is None:
            raise ShardError(
                f"{filename!r} is not a shard name (<topic>.pNNN.o<first>-<last>.parquet); "
                "remove the stray file"
            )
        return cls(topic=match["topic"], partition=int(match["partition"]),
                   first_offset=int(match["first"]), last_offset=int(match["last"]))


def shard_relpath(epoch: int, split: str, name: ShardName) -> str:
    """``epoch=<N>/split=<split>/<file name>`` (POSIX separators)."""
    return f"epoch={epoch}/split={split}/{name.filename}"


def epoch_dir(root: Path, epoch: int) -> Path:
    return root / f"epoch={epoch}"


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """A durable shard: where it is and what it holds."""

    relpath: str
    sha256: str
    plaintext_sha256: str
    bytes: int
    rows: int
    windows: int
    encrypted: bool


def parquet_settings(config: ShardConfig) -> ParquetSettings:
    return ParquetSettings(row_group_rows=config.row_group_rows,
                           compression_level=config.compression_level,
                           data_page_bytes=config.data_page_bytes)


def _write_staging(path: Path, table: pa.Table, config: ShardConfig,
                   crypto: ShardCrypto | None) -> str:
    """Write the staging file; the SHA-256 of the plaintext encoding (None: of the file)."""
    settings = parquet_settings(config)
    try:
        plain = None if crypto is None else plaintext_sha256(table, settings)
        props = None if crypto is None else crypto.encryption_properties(table.schema.names)
        writer = open_writer(str(path), table.schema, settings, props)
        try:
            write_row_groups(writer, table, settings, lambda: faults.hit("mid_write"))
            if crypto is not None and plain is not None:
                writer.add_key_value_metadata({
                    KEY_PLAINTEXT_SHA256.decode(): plain,
                    KEY_ENCRYPTION.decode(): canonical_json(
                        crypto.record(table.schema.names)).decode()})
        finally:
            writer.close()
    except (OSError, pa.ArrowException) as exc:
        raise ShardError(
            f"cannot write shard staging file {path}: {exc}; check disk space"
        ) from exc
    os.chmod(path, FILE_MODE)  # pyarrow creates it by the umask; the staging dir is 0750
    fsync_path(path)
    return plain if plain is not None else sha256_file(path)


def _crypto(crypto: ShardCrypto | str | None) -> ShardCrypto | None:
    if crypto == DEFAULT_CRYPTO:
        try:
            return default_crypto(create=True)
        except KeyAccessError as exc:
            raise ShardError(f"cannot encrypt shards: {exc}") from exc
    if crypto is None:
        log.warning("writing an UNENCRYPTED shard (crypto=None): sealed data will be "
                    "readable by anyone who can read the files")
        return None
    if not isinstance(crypto, ShardCrypto):
        raise ShardError(f"write_shard crypto must be a ShardCrypto, {DEFAULT_CRYPTO!r} or "
                         f"None, got {crypto!r}")
    return crypto


def write_shard(root: Path, relpath: str, table: pa.Table, config: ShardConfig,
                *, windows: int, crypto: ShardCrypto | str | None = DEFAULT_CRYPTO
                ) -> ShardInfo:
    """Write ``table`` atomically to ``root/relpath`` (see the module doc); its info."""
    shard_crypto = _crypto(crypto)
    final = root / relpath
    staging_dir = root / STAGING_DIR
    make_dirs(staging_dir)
    make_dirs(final.parent)
    staging = staging_dir / f"{final.name}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        plain = _write_staging(staging, table, config, shard_crypto)
        digest = sha256_file(staging)
        if final.exists():
            digest = sha256_file(final)
            _same_as_existing(final, plain, shard_crypto)
            staging.unlink()
        else:
            faults.hit("before_rename")
            os.replace(staging, final)
            fsync_path(final.parent)
    finally:
        staging.unlink(missing_ok=True)
    faults.hit("after_rename")
    return ShardInfo(relpath=relpath, sha256=digest, plaintext_sha256=plain,
                     bytes=final.stat().st_size, rows=table.num_rows, windows=windows,
                     encrypted=shard_crypto is not None)


def _same_as_existing(final: Path, plain: str, crypto: ShardCrypto | None) -> None:
    existing = shard_summary(final, crypto)["plaintext_sha256"]
    if existing != plain:
        raise ShardError(
            f"{final} already exists with plaintext SHA-256 {existing}, but replaying the same "
            f"source offsets now gives {plain}: replay or shard writing is not deterministic "
            "(different teacher, config, library version or thread count?). Investigate "
            "before deleting either file"
        )
    log.info("shard %s already durable with identical plaintext bytes", final.name)


def clean_staging(root: Path, *, stale_after_s: float = 3600.0) -> int:
    """Remove staging files of dead local processes, or older than ``stale_after_s``."""
    removed = 0
    staging_dir = root / STAGING_DIR
    if not staging_dir.is_dir():
        return 0
    now = time.time()
    for path in staging_dir.iterdir():
        parts = path.name.rsplit(".", 4)
        mine = len(parts) == 5 and parts[1] == _HOST and parts[2].isdigit()
        dead = mine and not pid_alive(int(parts[2]))
        if dead or now - path.stat().st_mtime > stale_after_s:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


    return True


def iter_shards(root: Path, epoch: int | None = None) -> Iterator[tuple[int, str, Path]]:
    """``(epoch, split, path)`` of every shard file under ``root`` (or one epoch), sorted."""
    epochs = sorted(root.glob("epoch=*")) if epoch is None else [epoch_dir(root, epoch)]
    for edir in epochs:
        ematch = _EPOCH_RE.match(edir.name)
        if ematch is None or not edir.is_dir():
            continue
        for sdir in sorted(edir.glob("split=*")):
            smatch = _SPLIT_RE.match(sdir.name)
            if smatch is None or not sdir.is_dir():
                continue
            for path in sorted(sdir.glob(f"*{SHARD_SUFFIX}")):
                yield int(ematch["epoch"]), smatch["split"], path


def shard_summary(path: Path, crypto: ShardCrypto | None = None) -> dict[str, Any]:
    """Rows, row groups, ``flywheel.shard`` metadata, plaintext SHA-256 and encryption
    record (None when plaintext) of a shard; reads the footer only (decrypting it)."""
    try:
        meta = open_parquet(path, crypto).metadata
        shard = read_shard_metadata(meta.metadata)
    except (OSError, pa.ArrowException, ShardFormatError, KeyAccessError) as exc:
        raise ShardError(f"cannot read the Parquet footer of {path}: {exc}") from exc
    kv = meta.metadata or {}
    encryption = kv.get(KEY_ENCRYPTION)
    plain = kv.get(KEY_PLAINTEXT_SHA256)
    return {"rows": meta.num_rows, "row_groups": meta.num_row_groups,
            "created_by": meta.created_by, "shard": shard,
            "plaintext_sha256": plain.decode() if plain else sha256_file(path),
            "encryption": None if encryption is None else json.loads(encryption)}


def read_window_ids(path: Path) -> list[str]:
    """The distinct window ids of one shard, in row order."""
    try:
        column = read_parquet(path, ["window_id"]).column("window_id")
    except (OSError, pa.ArrowException, KeyAccessError) as exc:
        raise ShardError(f"cannot read window ids from {path}: {exc}") from exc
    return list(dict.fromkeys(column.to_pylist()))
