"""Object stores: the few operations snapshot publication and reading need.

A snapshot root is either a local directory (today's layout, handled by the existing
POSIX code) or ``s3://bucket/prefix``. :class:`S3Store` talks to any S3-compatible
server over TLS with SigV4 (boto3); :class:`LocalStore` offers the same operations on a
directory so the publication protocol (:mod:`hebrus_flywheel.consumers.publish`) is unit
tested without a server. Keys are ``/``-separated and relative to the store's root.

Integrity: every upload sends ``Content-MD5`` (the server refuses a body that arrived
damaged) and every download is hashed (SHA-256) while it is written, so callers compare
with the manifest without reading the file twice.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from hebrus_flywheel.core.files import FILE_MODE, atomic_write_bytes, make_dirs
from hebrus_flywheel.core.storage.config import READ_ROLE, S3Target, s3_target
from hebrus_flywheel.core.storage.exceptions import StorageError

S3_SCHEME = "s3://"
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CHUNK = 1 << 20


def is_object_url(value: str | os.PathLike[str]) -> bool:
    """True for ``s3://...`` (a Path never is: ``Path('s3://b')`` collapses the slashes)."""
    return isinstance(value, str) and value.startswith(S3_SCHEME)


@dataclass(frozen=True, kw_only=True)
class S3Url:
    """``s3://bucket/prefix`` split (prefix without leading or trailing ``/``)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Url:
        if not is_object_url(url):
            raise StorageError(f"{url!r} is not an s3://bucket/prefix URL")
        bucket, _, prefix = url[len(S3_SCHEME):].partition("/")
        if not _BUCKET_RE.match(bucket):
            raise StorageError(f"{url!r}: {bucket!r} is not a valid bucket name (3-63 "
                               "lower-case letters, digits, '.' or '-')")
        prefix = prefix.strip("/")
        if ".." in prefix.split("/") or "//" in prefix:
            raise StorageError(f"{url!r}: the prefix must not contain '..' or empty parts")
        return cls(bucket=bucket, prefix=prefix)

    def child(self, *parts: str) -> str:
        """The URL of ``prefix/parts...``."""
        return S3_SCHEME + "/".join(p for p in (self.bucket, self.prefix, *parts) if p)

    def __str__(self) -> str:
        return self.child()


class ObjectStore(Protocol):
    """What the snapshot code needs of a store (keys relative to the store's root)."""

    location: str

    def put_file(self, key: str, path: Path) -> None: ...
    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool: ...
    def get_bytes(self, key: str) -> bytes | None: ...
    def download(self, key: str, dest: Path) -> str: ...
    def objects(self, prefix: str = "") -> dict[str, int]: ...
    def delete(self, keys: list[str]) -> None: ...
    def modified(self, key: str) -> float | None: ...


def _md5_b64(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return base64.b64encode(digest.digest()).decode()


def _copy_hashing(source: BinaryIO, dest: Path) -> str:
    """Copy ``source`` into a new ``dest`` (mode 0640); the SHA-256 of what was written."""
    digest = hashlib.sha256()
    make_dirs(dest.parent)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "wb") as out:
        for block in iter(lambda: source.read(_CHUNK), b""):
            digest.update(block)
            out.write(block)
    return digest.hexdigest()


class LocalStore:
    """The store operations on a local directory (tests; no server needed)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.location = str(self.root)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise StorageError(f"object key {key!r} leaves the store")
        return self.root / key

    def put_file(self, key: str, path: Path) -> None:
        target = self._path(key)
        make_dirs(target.parent)
        with Path(path).open("rb") as handle:
            atomic_write_bytes(target, handle.read())

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        target = self._path(key)
        make_dirs(target.parent)
        if not if_absent:
            atomic_write_bytes(target, data)
            return True
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
            tmp.write(data)
        try:
            os.link(tmp.name, target)  # atomic create-if-absent
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp.name)
        return True

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def download(self, key: str, dest: Path) -> str:
        try:
            with self._path(key).open("rb") as handle:
                return _copy_hashing(handle, dest)
        except FileNotFoundError as exc:
            raise StorageError(f"{self.location}/{key} does not exist") from exc

    def objects(self, prefix: str = "") -> dict[str, int]:
        out = {}
        for path in sorted(self.root.rglob("*")):
            key = path.relative_to(self.root).as_posix()
            if not key.startswith(prefix):
                continue
            try:
                found = path.stat()
            except FileNotFoundError:  # deleted since it was listed (a racing sealer's
                continue  # claim): not listed, as an object store would not list it
            if stat.S_ISREG(found.st_mode):
                out[key] = found.st_size
        return out

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def modified(self, key: str) -> float | None:
        """Seconds since the epoch the object was last written; None if absent."""
        try:
            return self._path(key).stat().st_mtime
        except FileNotFoundError:
            return None


def _client(target: S3Target) -> Any:
    import boto3  # heavy; only where a store is used
    from botocore.config import Config

    config = Config(signature_version="s3v4", s3={"addressing_style": "path"},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    retries={"max_attempts": 4, "mode": "standard"},
                    connect_timeout=10, read_timeout=60)
    return boto3.client("s3", endpoint_url=target.endpoint, region_name=target.region,
                        aws_access_key_id=target.access_key,
                        aws_secret_access_key=target.secret_key,
                        verify=str(target.ca_bundle) if target.ca_bundle else True,
                        config=config)


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str((response.get("Error") or {}).get("Code") or "")


class S3Store:
    """An ``s3://bucket/prefix`` root on an S3-compatible server (one role's keys)."""

    def __init__(self, url: str, target: S3Target | None = None) -> None:
        self.url = S3Url.parse(url)
        self.location = str(self.url)
        self.target = target or s3_target(READ_ROLE)
        self._s3 = _client(self.target)

    def _key(self, key: str) -> str:
        return f"{self.url.prefix}/{key}" if self.url.prefix else key

    def _fail(self, what: str, key: str, exc: Exception) -> StorageError:
        code = _error_code(exc)
        hint = {"SignatureDoesNotMatch": "the secret key is wrong",
                "InvalidAccessKeyId": "the access key is unknown",
                "AccessDenied": f"the role may not do this ({READ_ROLE} keys are read-only)",
                "NotImplemented": "the role's keys are read-only (some stores answer 501)",
                "501": "the role's keys are read-only (some stores answer 501)",
                "NoSuchBucket": "create the bucket (`flywheel storage up` makes "
                                "flywheel-snapshots)"}.get(code, "")
        return StorageError(f"cannot {what} {self.url.child(key)} as role {self.target.role}: "
                            f"{code or type(exc).__name__}{' — ' + hint if hint else ''} "
                            f"({exc})")

    def put_file(self, key: str, path: Path) -> None:
        try:
            with Path(path).open("rb") as body:
                self._s3.put_object(Bucket=self.url.bucket, Key=self._key(key), Body=body,
                                    ContentMD5=_md5_b64(Path(path)))
        except Exception as exc:  # botocore raises many unrelated types
            raise self._fail("upload", key, exc) from exc

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self._s3.put_object(Bucket=self.url.bucket, Key=self._key(key), Body=data,
                                ContentMD5=md5, **extra)
        except Exception as exc:
            if if_absent and _error_code(exc) in ("PreconditionFailed", "412",
                                                  "ConditionalRequestConflict"):
                return False
            raise self._fail("write", key, exc) from exc
        return True

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return bytes(self._s3.get_object(Bucket=self.url.bucket,
                                             Key=self._key(key))["Body"].read())
        except Exception as exc:
            if _error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise self._fail("read", key, exc) from exc

    def download(self, key: str, dest: Path) -> str:
        try:
            body = self._s3.get_object(Bucket=self.url.bucket, Key=self._key(key))["Body"]
            return _copy_hashing(body, dest)
        except Exception as exc:
            raise self._fail("download", key, exc) from exc

    def objects(self, prefix: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        root = self._key("")
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.url.bucket, Prefix=self._key(prefix))
            for page in pages:
                for item in page.get("Contents") or []:
                    key = str(item["Key"])
                    if not key.endswith("/"):  # some stores list directories as "dir/"
                        out[key[len(root):]] = int(item["Size"])
        except Exception as exc:
            raise self._fail("list", prefix, exc) from exc
        return out

    def delete(self, keys: list[str]) -> None:
        """One DELETE per key (some stores, S3Proxy among them, refuse the checksum header
        boto3 puts on the multi-object DeleteObjects); deleting an absent key is not an
        error."""
        for key in keys:
            try:
                self._s3.delete_object(Bucket=self.url.bucket, Key=self._key(key))
            except Exception as exc:
                if _error_code(exc) not in ("NoSuchKey", "404"):
                    raise self._fail("delete", key, exc) from exc

    def modified(self, key: str) -> float | None:
        try:
            head = self._s3.head_object(Bucket=self.url.bucket, Key=self._key(key))
        except Exception as exc:
            if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._fail("inspect", key, exc) from exc
        return float(head["LastModified"].timestamp())

    def ensure_bucket(self) -> None:
        """Create the bucket unless it exists (write role)."""
        try:
            self._s3.head_bucket(Bucket=self.url.bucket)
            return
        except Exception as exc:
            if _error_code(exc) not in ("404", "NoSuchBucket", "NotFound"):
                raise self._fail("check the bucket of", "", exc) from exc
        try:
            self._s3.create_bucket(Bucket=self.url.bucket)
        except Exception as exc:
            if _error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._fail("create the bucket of", "", exc) from exc


def open_store(root: str | Path, role: str = READ_ROLE) -> ObjectStore:
    """An :class:`S3Store` for ``s3://`` (with ``role``'s keys), else a :class:`LocalStore`."""
    if is_object_url(str(root)) and isinstance(root, str):
        return S3Store(root, s3_target(role))
    return LocalStore(Path(root))
