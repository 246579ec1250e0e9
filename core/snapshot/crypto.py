"""Encryption at rest of shards: Parquet modular encryption with keys from a provider.

Every column and the footer are encrypted with AES-GCM (``AES_GCM_V1``) under random
256-bit data keys, two column keys plus a footer key:

* ``flywheel.footer``: the footer (schema, row counts, the ``flywheel.*`` metadata);
* ``flywheel.lineage``: who and where (:data:`LINEAGE_KEY_COLUMNS`: owner, thread,
  window and source coordinates, identity, tags, ordinals);
* ``flywheel.content``: what was said and routed (token ids, expert ids, weights,
  margins, features, hidden states).

Data keys are wrapped by a KEK from a :class:`~hebrus_flywheel.core.snapshot.keys.KeyProvider`
(double wrapping: pyarrow wraps data keys with per-process intermediate keys and only those
go to the provider, so a remote KMS sees a few calls per process, not per file). A file
holds wrapped keys and master key ids only; the manifest records the provider, the KEK id
(a fingerprint) and this key split, never a key.

Random data keys and nonces make the ciphertext differ on every write. The writer
therefore also records the SHA-256 of the *plaintext encoding* (the same rows written
with the same pinned options and no encryption, :mod:`hebrus_flywheel.core.snapshot.encode`):
rebuild parity and ``flywheel verify --keys`` compare that; ``flywheel verify`` without
keys compares the ciphertext SHA-256.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pyarrow.parquet.encryption as pe

from hebrus_flywheel.core.snapshot.errors import KeyAccessError
from hebrus_flywheel.core.snapshot.keys import KEK_FILE_ENV, KeyProvider, LocalKeyFile

ALGORITHM = "AES_GCM_V1"
SCHEME = "parquet-modular-encryption"
FOOTER_KEY = "flywheel.footer"
LINEAGE_KEY = "flywheel.lineage"
CONTENT_KEY = "flywheel.content"
DATA_KEY_BITS = 256
LINEAGE_KEY_COLUMNS: tuple[str, ...] = (
    "source_topic", "source_partition", "source_offset", "window_id", "split", "owner",
    "thread", "generation", "identity_id", "domain_tags", "token_ordinal")
KEY_PLAINTEXT_SHA256 = b"flywheel.plaintext_sha256"
"""Footer key of an encrypted shard: SHA-256 of its plaintext encoding."""
KEY_ENCRYPTION = b"flywheel.encryption"
"""Footer key of an encrypted shard: canonical JSON of its :func:`encryption_record`."""
_ENCRYPTED_MAGIC = b"PARE"


class _ProviderClient(pe.KmsClient):
    """pyarrow's KMS client interface over a :class:`KeyProvider`."""

    def __init__(self, provider: KeyProvider) -> None:
        super().__init__()
        self._provider = provider

    def wrap_key(self, key_bytes: bytes, master_key_identifier: str) -> str:
        return self._provider.wrap_key(key_bytes, master_key_identifier)

    def unwrap_key(self, wrapped_key: str, master_key_identifier: str) -> bytes:
        return self._provider.unwrap_key(wrapped_key, master_key_identifier)


def column_keys(names: Sequence[str]) -> dict[str, list[str]]:
    """Master key id -> the top-level columns it encrypts (every column gets one)."""
    lineage = [n for n in names if n in LINEAGE_KEY_COLUMNS]
    content = [n for n in names if n not in LINEAGE_KEY_COLUMNS]
    return {k: v for k, v in ((LINEAGE_KEY, lineage), (CONTENT_KEY, content)) if v}


class ShardCrypto:
    """Encryption and decryption properties for shards, bound to one key provider."""

    def __init__(self, provider: KeyProvider) -> None:
        self.provider = provider
        self._factory = pe.CryptoFactory(lambda _config: _ProviderClient(provider))
        self._kms = pe.KmsConnectionConfig(kms_instance_id=provider.name)

    def record(self, names: Sequence[str]) -> dict[str, Any]:
        """What the manifest and footer say about the encryption of a file with ``names``."""
        return {"scheme": SCHEME, "algorithm": ALGORITHM, "footer": "encrypted",
                "footer_key": FOOTER_KEY, "column_keys": column_keys(names),
                "data_key_bits": DATA_KEY_BITS, "double_wrapping": True,
                "provider": self.provider.name, "kek_id": self.provider.kek_id}

    def encryption_properties(self, names: Sequence[str]) -> Any:
        config = pe.EncryptionConfiguration(
            footer_key=FOOTER_KEY, column_keys=column_keys(names),
            encryption_algorithm=ALGORITHM, plaintext_footer=False, double_wrapping=True,
            data_key_length_bits=DATA_KEY_BITS,
            cache_lifetime=datetime.timedelta(hours=1))
        return self._factory.file_encryption_properties(self._kms, config)

    def decryption_properties(self) -> Any:
        config = pe.DecryptionConfiguration(cache_lifetime=datetime.timedelta(hours=1))
        return self._factory.file_decryption_properties(self._kms, config)


_DEFAULT: dict[tuple[str, str], ShardCrypto] = {}


def default_crypto(*, create: bool = False) -> ShardCrypto:
    """The process's :class:`ShardCrypto` over the default local key file.

    ``create`` (writers only) makes the key file on first use; readers pass False and
    get :class:`KeyAccessError` when it is missing.
    """
    provider = LocalKeyFile(create=create)
    cache_key = (str(provider.path), provider.kek_id)
    if cache_key not in _DEFAULT:
        _DEFAULT[cache_key] = ShardCrypto(provider)
    return _DEFAULT[cache_key]


def is_encrypted(path: Path) -> bool:
    """True when ``path`` is a Parquet file with an encrypted footer (magic ``PARE``)."""
    with Path(path).open("rb") as handle:
        handle.seek(0, 2)
        if handle.tell() < 8:
            return False
        handle.seek(-4, 2)
        return handle.read(4) == _ENCRYPTED_MAGIC


def check_kek(record: dict[str, Any] | None, crypto: ShardCrypto, where: str) -> None:
    """KeyAccessError when ``crypto``'s KEK is not the one ``record`` names."""
    if record is None:
        return
    if (record.get("provider"), record.get("kek_id")) != (crypto.provider.name,
                                                          crypto.provider.kek_id):
        raise KeyAccessError(
            f"{where} is encrypted under KEK {record.get('kek_id')} ({record.get('provider')}) "
            f"but this reader holds {crypto.provider.kek_id} ({crypto.provider.name}): point "
            f"${KEK_FILE_ENV} at the key file the snapshot was sealed with")


def _decryption(path: Path, crypto: ShardCrypto | None) -> Any:
    if not is_encrypted(path):
        return None
    return (crypto or default_crypto()).decryption_properties()


def _failed(path: Path, exc: Exception) -> KeyAccessError | None:
    text = str(exc)
    if "decrypt" in text.lower() or "encrypted" in text.lower():
        return KeyAccessError(f"cannot decrypt {path}: {text}. Readers need the key file the "
                              f"snapshot was sealed with (${KEK_FILE_ENV})")
    return None


def open_parquet(path: Path, crypto: ShardCrypto | None = None) -> pq.ParquetFile:
    """A ``ParquetFile`` of a shard, decrypting when it is encrypted.

    KeyAccessError when it is encrypted and no (or the wrong) key is at hand; OSError
    and ArrowException pass through for other faults.
    """
    try:
        return pq.ParquetFile(path, decryption_properties=_decryption(path, crypto))
    except (OSError, pa.ArrowException) as exc:
        if (error := _failed(path, exc)) is not None:
            raise error from exc
        raise


def writer_table(table: pa.Table) -> pa.Table:
    """``table`` with the schema metadata its writer gave it: without the footer keys
    only an encrypted file has (pyarrow merges footer metadata into the schema)."""
    meta = table.schema.metadata
    if not meta or not {KEY_PLAINTEXT_SHA256, KEY_ENCRYPTION} & set(meta):
        return table
    return table.replace_schema_metadata(
        {k: v for k, v in meta.items() if k not in (KEY_PLAINTEXT_SHA256, KEY_ENCRYPTION)})


def read_parquet(path: Path, columns: Sequence[str] | None = None,
                 crypto: ShardCrypto | None = None, row_group: int | None = None) -> pa.Table:
    """Rows of a shard (``columns`` or all; one row group or all), decrypting when it is
    encrypted, with the schema metadata the writer gave them."""
    handle = open_parquet(path, crypto)
    cols = None if columns is None else list(columns)
    try:
        table = (handle.read(columns=cols) if row_group is None
                 else handle.read_row_group(row_group, columns=cols))
    except (OSError, pa.ArrowException) as exc:
        if (error := _failed(path, exc)) is not None:
            raise error from exc
        raise
    return writer_table(table)
