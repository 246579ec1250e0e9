"""Key providers: who wraps and unwraps the data keys of encrypted shards.

A sealed shard's columns and footer are encrypted with random data keys (Parquet modular
encryption, :mod:`hebrus_flywheel.core.snapshot.crypto`). Those data keys are wrapped by a
key-encryption key (KEK) that never leaves its provider; the shard stores only wrapped
keys and master key ids. A provider is anything with ``name``, ``kek_id``, ``wrap_key``
and ``unwrap_key`` (:class:`KeyProvider`): the shape of Vault transit's encrypt/decrypt
endpoints or a cloud KMS's Encrypt/Decrypt with a key id, and of pyarrow's ``KmsClient``.

The default, :class:`LocalKeyFile`, keeps one random 256-bit KEK in
``$FLYWHEEL_HOME/keys/snapshot-kek.json`` (``$FLYWHEEL_KEK_FILE`` overrides the path),
created on first write with mode 0600 in a 0700 directory. Writers create it; readers
never do, so a reader without the file gets :class:`KeyAccessError`, not an empty key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Protocol, runtime_checkable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.core.snapshot.errors import KeyAccessError

KEK_FILE_ENV = "FLYWHEEL_KEK_FILE"
KEK_FILE_NAME = "snapshot-kek.json"
KEK_FORMAT = "hebrus-flywheel-kek/v1"
_NONCE_BYTES = 12


@runtime_checkable
class KeyProvider(Protocol):
    """Wraps and unwraps data keys under a named master key; never reveals its KEK.

    ``name`` says which kind of provider (``local-file``, ``vault-transit``, ...);
    ``kek_id`` names the KEK (a fingerprint, not the key) so a reader can tell before
    decrypting whether it holds the key a snapshot was sealed with.
    """

    @property
    def name(self) -> str: ...

    @property
    def kek_id(self) -> str: ...

    def wrap_key(self, key_bytes: bytes, master_key_identifier: str) -> str: ...

    def unwrap_key(self, wrapped_key: str, master_key_identifier: str) -> bytes: ...


def default_kek_path() -> Path:
    """``$FLYWHEEL_KEK_FILE``, else ``$FLYWHEEL_HOME/keys/snapshot-kek.json``."""
    override = os.environ.get(KEK_FILE_ENV)
    return Path(override) if override else flywheel_home() / "keys" / KEK_FILE_NAME


def _kek_id(key: bytes) -> str:
    return "local-" + hashlib.sha256(b"hebrus-flywheel/kek-id\0" + key).hexdigest()[:24]


def _create(path: Path) -> None:
    """Write a fresh KEK file (0600, directory 0700) unless one appears first."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = os.urandom(32)
    body = json.dumps({"format": KEK_FORMAT, "kek_id": _kek_id(key),
                       "key": base64.b64encode(key).decode()}, sort_keys=True).encode()
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic; loses quietly to a concurrent creator
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        raw = json.loads(path.read_text(encoding="utf-8"))
        key = base64.b64decode(raw["key"], validate=True)
    except FileNotFoundError as exc:
        raise KeyAccessError(
            f"no key file at {path}: the snapshot's shards are encrypted. Copy the key file "
            f"the snapshot was sealed with to {path} (mode 0600) or point ${KEK_FILE_ENV} "
            "at it") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KeyAccessError(f"the key file {path} is unreadable or damaged ({exc!r}); "
                             "restore it from your key backup") from exc
    if stat.S_IMODE(mode) & 0o077:
        raise KeyAccessError(f"the key file {path} has mode {stat.S_IMODE(mode):04o}; it must "
                             f"be private: run `chmod 600 {path}`")
    if raw.get("format") != KEK_FORMAT or len(key) != 32 or raw.get("kek_id") != _kek_id(key):
        raise KeyAccessError(f"the key file {path} is not a {KEK_FORMAT} file with a 256-bit "
                             "key; restore it from your key backup")
    return key


class LocalKeyFile:
    """The default provider: one AES-256 KEK in a private local file.

    ``wrap_key`` is AES-GCM under the KEK with a random nonce and the master key id as
    associated data (so a wrapped key cannot be moved to another column key); the result
    is base64 text, as pyarrow's ``KmsClient`` expects.
    """

    name = "local-file"

    def __init__(self, path: Path | None = None, *, create: bool = False) -> None:
        self.path = Path(path) if path is not None else default_kek_path()
        if create and not self.path.exists():
            _create(self.path)
        key = _load(self.path)
        self._aead = AESGCM(key)
        self._kek_id = _kek_id(key)

    @property
    def kek_id(self) -> str:
        return self._kek_id

    def wrap_key(self, key_bytes: bytes, master_key_identifier: str) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, bytes(key_bytes), master_key_identifier.encode())
        return base64.b64encode(nonce + sealed).decode("ascii")

    def unwrap_key(self, wrapped_key: str, master_key_identifier: str) -> bytes:
        try:
            raw = base64.b64decode(wrapped_key, validate=True)
            return self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:],
                                      master_key_identifier.encode())
        except (InvalidTag, ValueError) as exc:
            raise KeyAccessError(
                f"the key file {self.path} (KEK {self.kek_id}) cannot unwrap the data key of "
                f"master key {master_key_identifier!r}: the shard was encrypted under another "
                f"KEK. Point ${KEK_FILE_ENV} at the key file the snapshot was sealed with"
            ) from exc
