"""A local, file-based schema registry: every ``<Name>.v<N>.avsc`` kept in a directory.

The registry parses each file once, computes its parsing canonical form and its
CRC-64-AVRO (Rabin) fingerprint, and indexes it by name, version and fingerprint, so
that decoding a single-object message is one dictionary look-up plus the fastavro read.
Nothing here talks to a network; the ``.avsc`` files in ``schemas/`` are the source of
truth and every version ever published stays there.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from fastavro import parse_schema
from fastavro.schema import SchemaParseException, fingerprint, to_parsing_canonical_form

from hebrus_flywheel.schemas.exceptions import (
    SchemaConflictError,
    SchemaError,
    SchemaNotFoundError,
    SchemaParseError,
    UnknownFingerprintError,
)

log = logging.getLogger(__name__)

SCHEMA_DIR = Path(__file__).resolve().parent
"""Where the project's own ``.avsc`` files live (this package's directory)."""

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
FINGERPRINT_SIZE = 8
HEADER_SIZE = len(SINGLE_OBJECT_MAGIC) + FINGERPRINT_SIZE

_FILE_RE = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)\.v(?P<version>[1-9][0-9]*)\.avsc$")
_VERSION_SUFFIX_RE = re.compile(r"^(?P<name>.+)\.v(?P<version>[1-9][0-9]*)$")


class SchemaKey(NamedTuple):
    """A schema's Avro full name and its file version; ``str()`` gives ``<full name>.v<N>``."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name}.v{self.version}"


SchemaRef = SchemaKey | str
"""A ``SchemaKey``, or a string: short or full name (latest version), or either with ``.v<N>``."""


@dataclass(frozen=True, kw_only=True, eq=False)
class SchemaEntry:
    """One loaded schema version.

    Attributes:
        key: full name and version.
        path: the ``.avsc`` file it came from.
        definition: the JSON schema as written in the file.
        parsed: fastavro-parsed schema used to write (accepts logical-type values).
        plain: fastavro-parsed schema with logical types removed, used to read, so a
            ``timestamp-millis`` field decodes to the ``int`` that was written.
        canonical_form: Avro parsing canonical form.
        fingerprint: CRC-64-AVRO of the canonical form, 8 bytes little-endian, as on
            the wire.
        prefix: the 10-byte single-object header, ``C3 01`` + ``fingerprint``.
    """

    key: SchemaKey
    path: Path
    definition: dict[str, Any]
    parsed: Any
    plain: Any
    canonical_form: str
    fingerprint: bytes
    prefix: bytes

    @property
    def short_name(self) -> str:
        return self.key.name.rsplit(".", 1)[-1]

    @property
    def fingerprint_int(self) -> int:
        """The fingerprint as the unsigned 64-bit integer the Avro spec computes."""
        return int.from_bytes(self.fingerprint, "little")


def strip_logical_types(node: Any) -> Any:
    """A copy of a JSON schema with every ``logicalType`` attribute removed."""
    if isinstance(node, dict):
        return {k: strip_logical_types(v) for k, v in node.items() if k != "logicalType"}
    if isinstance(node, list):
        return [strip_logical_types(v) for v in node]
    return node


def _read_definition(path: Path) -> dict[str, Any]:
    try:
        definition = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SchemaParseError(
            f"cannot read schema file {path}: {exc}; fix the file or remove it"
        ) from exc
    if not isinstance(definition, dict) or definition.get("type") not in ("record", "enum"):
        raise SchemaParseError(
            f"schema file {path} must hold one named record or enum at top level"
        )
    return definition


def load_entry(path: Path) -> SchemaEntry:
    """Parse one ``<Name>.v<N>.avsc`` file into a :class:`SchemaEntry`."""
    match = _FILE_RE.match(path.name)
    if match is None:
        raise SchemaParseError(
            f"schema file {path} is misnamed: expected <Name>.v<N>.avsc, e.g. "
            "RouteObservation.v2.avsc; rename it"
        )
    definition = _read_definition(path)
    try:
        parsed: Any = parse_schema(definition, named_schemas={})
        plain = parse_schema(strip_logical_types(definition), named_schemas={})
        canonical = to_parsing_canonical_form(parsed)
    except (SchemaParseException, ValueError, TypeError, KeyError) as exc:
        raise SchemaParseError(f"{path} is not a valid Avro schema: {exc}") from exc
    full_name = parsed["name"]
    if full_name.rsplit(".", 1)[-1] != match["name"]:
        raise SchemaParseError(
            f"{path} defines {full_name!r} but its file name says {match['name']!r}; "
            "the file name must be the schema's short name"
        )
    fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
    return SchemaEntry(
        key=SchemaKey(full_name, int(match["version"])),
        path=path,
        definition=definition,
        parsed=parsed,
        plain=plain,
        canonical_form=canonical,
        fingerprint=fp,
        prefix=SINGLE_OBJECT_MAGIC + fp,
    )


class SchemaRegistry:
    """Every schema version found in one directory, indexed for encoding and decoding.

    Loading fails closed: a misnamed or invalid file, two files with the same name and
    version, or two versions with the same fingerprint (a new version that changes
    only docs or defaults) raise instead of being skipped.
    """

    def __init__(self, directory: Path | str = SCHEMA_DIR) -> None:
        self.directory = Path(directory)
        paths = sorted(self.directory.glob("*.avsc"))
        if not paths:
            raise SchemaError(
                f"no .avsc files in {self.directory}; point the registry at the "
                "directory that holds the schemas"
            )
        self._by_key: dict[SchemaKey, SchemaEntry] = {}
        self._by_fingerprint: dict[bytes, SchemaEntry] = {}
        self._latest: dict[str, SchemaEntry] = {}
        self._short: dict[str, set[str]] = {}
        for path in paths:
            self._add(load_entry(path))
        log.debug("loaded %d schema versions from %s", len(self._by_key), self.directory)

    def _add(self, entry: SchemaEntry) -> None:
        if entry.key in self._by_key:
            raise SchemaConflictError(
                f"{entry.path} and {self._by_key[entry.key].path} both define {entry.key}"
            )
        clash = self._by_fingerprint.get(entry.fingerprint)
        if clash is not None:
            raise SchemaConflictError(
                f"{entry.path} has the same fingerprint {entry.fingerprint.hex()} as "
                f"{clash.path}: they write identical bytes. A new version must change "
                "the written shape (fields, types, order); remove the duplicate"
            )
        self._by_key[entry.key] = entry
        self._by_fingerprint[entry.fingerprint] = entry
        latest = self._latest.get(entry.key.name)
        if latest is None or latest.key.version < entry.key.version:
            self._latest[entry.key.name] = entry
        self._short.setdefault(entry.short_name, set()).add(entry.key.name)

    def __iter__(self) -> Iterator[SchemaEntry]:
        return iter(sorted(self._by_key.values(), key=lambda e: e.key))

    def __len__(self) -> int:
        return len(self._by_key)

    def keys(self) -> list[SchemaKey]:
        return sorted(self._by_key)

    def versions(self, name: str) -> list[int]:
        """Every kept version of a schema (short or full name), ascending."""
        full = self._full_name(name)
        return sorted(k.version for k in self._by_key if k.name == full)

    def get(self, ref: SchemaRef) -> SchemaEntry:
        """Resolve a key or name (latest version unless ``.v<N>`` is given)."""
        if isinstance(ref, SchemaKey):
            entry = self._by_key.get(ref)
            if entry is None:
                raise self._not_found(str(ref))
            return entry
        if not isinstance(ref, str):
            raise SchemaNotFoundError(
                f"schema reference must be a SchemaKey or a name string, got {type(ref).__name__}"
            )
        if ref in self._latest:
            return self._latest[ref]
        if ref in self._short:
            return self._latest[self._full_name(ref)]
        match = _VERSION_SUFFIX_RE.match(ref)
        if match is not None:
            try:
                key = SchemaKey(self._full_name(match["name"]), int(match["version"]))
            except SchemaNotFoundError:
                raise self._not_found(ref) from None
            if key in self._by_key:
                return self._by_key[key]
        raise self._not_found(ref)

    def by_fingerprint(self, fp: bytes) -> SchemaEntry:
        """The writer schema whose fingerprint (8 bytes, little-endian) is ``fp``."""
        entry = self._by_fingerprint.get(fp)
        if entry is None:
            raise UnknownFingerprintError(
                f"no kept schema has fingerprint {bytes(fp).hex()} (little-endian "
                f"CRC-64-AVRO) in {self.directory}; the writer used a schema version this "
                "reader does not know — add that version's .avsc file to the schemas "
                "directory (every published version must stay there)",
                fingerprint=bytes(fp),
            )
        return entry

    def _full_name(self, name: str) -> str:
        if name in self._latest:
            return name
        fulls = self._short.get(name)
        if not fulls:
            raise self._not_found(name)
        if len(fulls) > 1:
            raise SchemaNotFoundError(
                f"schema name {name!r} is ambiguous ({sorted(fulls)}); use the full name"
            )
        return next(iter(fulls))

    def _not_found(self, ref: str) -> SchemaNotFoundError:
        known = ", ".join(str(k) for k in self.keys())
        return SchemaNotFoundError(
            f"unknown schema {ref!r} in {self.directory}; known: {known}. Use one of "
            "these or add the .avsc file"
        )


@functools.cache
def default_registry() -> SchemaRegistry:
    """The registry of the project's own ``schemas/`` directory, loaded once per process."""
    return SchemaRegistry(SCHEMA_DIR)
