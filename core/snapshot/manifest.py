"""The manifest of a sealed snapshot: versioned format, ``Manifest`` type, parse/validate.

A snapshot is one epoch directory ``ROOT/epoch=N/`` with its shards under ``split=S/``
and ``manifest.json``. The snapshot id is the hex SHA-256 of the manifest's canonical
JSON without the ``snapshot_id`` field; the manifest holds no timestamps or host names,
so sealing the same shard files twice gives the same id.

Shards are encrypted with random data keys, so a rebuild writes different ciphertext
(other ``sha256`` and, by a few bytes, other ``bytes``) and hence gets another snapshot
id. What a rebuild reproduces is the *content*: ``content_id`` is the SHA-256 of the
canonical JSON without the ids, the ``encryption`` record, the ``consent`` measurement
(taken at seal time against the consent ledger), the ``replay_throughput`` measurement
(how fast this machine replayed), and every ciphertext-dependent
field (each shard's ``sha256`` and ``bytes``, ``totals.bytes``, ``splits.*.bytes``); it
covers each shard's ``plaintext_sha256``, the digest of its deterministic plaintext
encoding.
``docs/snapshot-manifest.schema.json`` is the JSON Schema of the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.jsonio import canonical_digest
from hebrus_flywheel.core.snapshot.errors import ManifestError, ShardFormatError
from hebrus_flywheel.core.snapshot.shard import (
    CONTRACT_VERSION,
    PRODUCTS,
    ShardLayout,
    shard_product,
)

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = f"hebrus-flywheel-snapshot/v{CONTRACT_VERSION}"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_ENTRY_INTS = ("bytes", "rows", "windows", "partition", "first_offset", "last_offset")
_ENTRY_STRS = ("path", "sha256", "plaintext_sha256", "split", "topic")
_REQUIRED = ("format", "epoch", "snapshot_id", "identity", "determinism", "writer", "source",
             "geometry", "shards", "splits", "totals", "parity", "parity_override",
             "previous_snapshot", "label_encoding", "teacher", "tokenizer", "content_id",
             "encryption")
_CIPHERTEXT_ENTRY_KEYS = ("sha256", "bytes")


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    """One shard as the manifest lists it (path relative to the epoch directory)."""

    path: str
    sha256: str
    plaintext_sha256: str
    bytes: int
    rows: int
    windows: int
    split: str
    topic: str
    partition: int
    first_offset: int
    last_offset: int


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """The snapshot id: SHA-256 of the canonical JSON without ``snapshot_id``."""
    return canonical_digest({k: v for k, v in manifest.items() if k != "snapshot_id"})


def content_digest(manifest: Mapping[str, Any]) -> str:
    """The content id: what a rebuild reproduces, whatever the keys (see the module doc)."""
    view = {k: v for k, v in manifest.items()
            if k not in ("snapshot_id", "content_id", "encryption", "consent",
                         "replay_throughput")}
    view["shards"] = [{k: v for k, v in s.items() if k not in _CIPHERTEXT_ENTRY_KEYS}
                      for s in manifest.get("shards") or []]
    view["totals"] = {k: v for k, v in (manifest.get("totals") or {}).items() if k != "bytes"}
    view["splits"] = {name: {k: v for k, v in split.items() if k != "bytes"}
                      for name, split in (manifest.get("splits") or {}).items()}
    return canonical_digest(view)


def manifest_path(snapshot: Path) -> Path:
    """``snapshot`` itself when it is a manifest file, else ``snapshot/manifest.json``."""
    snapshot = Path(snapshot)
    return snapshot if snapshot.name == MANIFEST_FILE else snapshot / MANIFEST_FILE


class Manifest(Mapping[str, Any]):
    """A parsed, digest-checked manifest: read-only mapping of the JSON plus typed views."""

    def __init__(self, raw: Mapping[str, Any], shards: tuple[ShardEntry, ...],
                 layout: ShardLayout | None) -> None:
        self._raw = dict(raw)
        self.shards = shards
        self.layout = layout

    def __getitem__(self, key: str) -> Any:
        return self._raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __repr__(self) -> str:
        return f"Manifest(snapshot_id={self.snapshot_id!r}, epoch={self.epoch})"

    @property
    def snapshot_id(self) -> str:
        return str(self._raw["snapshot_id"])

    @property
    def product(self) -> str:
        """``clean_path`` or ``candidate_path``; manifests without the field are clean."""
        return shard_product(self._raw)

    @property
    def content_id(self) -> str:
        return str(self._raw["content_id"])

    @property
    def encryption(self) -> dict[str, Any] | None:
        """How the shards are encrypted (provider, KEK id, key split); None if plaintext."""
        value = self._raw.get("encryption")
        return dict(value) if isinstance(value, dict) else None

    @property
    def epoch(self) -> int:
        return int(self._raw["epoch"])

    @property
    def identity(self) -> dict[str, Any]:
        return dict(self._raw["identity"])

    @property
    def row_group_rows(self) -> int | None:
        """Rows per Parquet row group the writer used (None when not recorded)."""
        value = (self._raw["determinism"].get("shard") or {}).get("row_group_rows")
        return value if isinstance(value, int) and value >= 1 else None

    @property
    def feature_contract(self) -> dict[str, Any] | None:
        """The replay's feature contract (projection seed, H, D, digest), if recorded."""
        replay = self._raw["determinism"].get("replay_config") or {}
        contract = replay.get("feature_contract")
        return dict(contract) if isinstance(contract, dict) else None

    def to_dict(self) -> dict[str, Any]:
        """A deep, JSON-ready copy."""
        return json.loads(json.dumps(self._raw))


def _entry(value: Any, where: str) -> ShardEntry:
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: a shard entry must be an object, got {value!r}")
    bad = [k for k in _ENTRY_INTS if isinstance(value.get(k), bool)
           or not isinstance(value.get(k), int) or value[k] < 0]
    bad += [k for k in _ENTRY_STRS if not isinstance(value.get(k), str)]
    bad += [k for k in ("sha256", "plaintext_sha256")
            if k not in bad and not _HEX64.match(value[k])]
    if bad:
        raise ManifestError(f"{where}: shard entry {value.get('path')!r} has invalid "
                            f"fields {bad}")
    if value["path"].startswith("/") or ".." in value["path"].split("/"):
        raise ManifestError(f"{where}: shard path {value['path']!r} leaves the snapshot")
    return ShardEntry(**{k: value[k] for k in ShardEntry.__dataclass_fields__})


def _layout(value: Any, shards: tuple[ShardEntry, ...], where: str) -> ShardLayout | None:
    if value is None and not shards:
        return None
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: geometry must be an object when shards exist")
    try:
        return ShardLayout.from_dict(value)
    except (ShardFormatError, ValueError) as exc:
        raise ManifestError(f"{where}: {exc}") from exc


def parse_manifest(value: Any, *, where: str = "manifest") -> Manifest:
    """Validate a decoded manifest (format, fields, digest); ManifestError on any fault."""
    if not isinstance(value, dict) or value.get("format") != MANIFEST_FORMAT:
        found = value.get("format") if isinstance(value, dict) else type(value).__name__
        raise ManifestError(f"{where} is not a {MANIFEST_FORMAT} manifest (format {found!r}); "
                            "rebuild it with this version (`flywheel rebuild`)")
    missing = [k for k in _REQUIRED if k not in value]
    if missing:
        raise ManifestError(f"{where} lacks the fields {missing}; the manifest is damaged")
    digest = manifest_digest(value)
    if value.get("snapshot_id") != digest:
        raise ManifestError(
            f"{where} claims snapshot id {value.get('snapshot_id')} but its content hashes "
            f"to {digest}: the manifest was edited or damaged; restore it from a copy")
    if value.get("content_id") != content_digest(value):
        raise ManifestError(f"{where}: content_id {value.get('content_id')} does not match its "
                            "content; the manifest was edited or damaged; restore it from a copy")
    if not isinstance(value["shards"], list) or not isinstance(value["identity"], dict):
        raise ManifestError(f"{where}: shards must be a list and identity an object")
    if value.get("product", PRODUCTS[0]) not in PRODUCTS:
        raise ManifestError(f"{where} names the replay product {value.get('product')!r}; "
                            f"expected one of {PRODUCTS}")
    shards = tuple(_entry(s, where) for s in value["shards"])
    if len({s.path for s in shards}) != len(shards):
        raise ManifestError(f"{where} lists a shard path twice")
    return Manifest(value, shards, _layout(value["geometry"], shards, where))


def load_manifest(snapshot: Path) -> Manifest:
    """Read and :func:`parse_manifest` an epoch directory's (or a file's) manifest."""
    path = manifest_path(snapshot)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ManifestError(f"{path} does not exist; point at a sealed epoch directory") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"cannot read {path}: {exc}; the manifest is damaged") from exc
    return parse_manifest(value, where=str(path))
