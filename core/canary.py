"""Byte scans for a canary token sequence: the proof that an erasure left no plaintext.

A canary is a sequence of token ids planted in one owner's traffic. After the owner is
erased, no file under the scanned roots may hold it in any encoding this project (or
Kafka, or Parquet) writes token ids in:

* ``int32le`` / ``int64le``: little-endian fixed-width integers (Parquet PLAIN pages,
  numpy buffers, torch tensors);
* ``zigzag``: Avro ``int``/``long`` zigzag varints, one after the other (an Avro array
  block of the sequence);
* ``text``: decimal numbers separated by commas and/or whitespace (JSON arrays, logs,
  CSV), not glued to other digits.

Compressed or encrypted bytes are not decoded: that is the point (ciphertext under a
destroyed key counts as erased). The scan reads every regular file, symlinks are not
followed, unreadable files are reported, not skipped silently.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

FORMS: tuple[str, ...] = ("int32le", "int64le", "zigzag", "text")
_CHUNK = 1 << 22


def _zigzag(value: int) -> bytes:
    n = (value << 1) ^ (value >> 63)
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def binary_forms(tokens: Sequence[int]) -> dict[str, bytes]:
    """The canary's fixed byte encodings, by form name."""
    return {"int32le": b"".join(struct.pack("<i", t) for t in tokens),
            "int64le": b"".join(struct.pack("<q", t) for t in tokens),
            "zigzag": b"".join(_zigzag(t) for t in tokens)}


def text_pattern(tokens: Sequence[int]) -> re.Pattern[bytes]:
    """Decimal text of the canary, separated by commas and/or whitespace, not followed by
    a digit. It starts with a literal (so ``re`` searches fast); that no digit precedes
    it is checked by :func:`text_matches`."""
    sep = rb"(?:[ \t\r\n]*,[ \t\r\n]*|[ \t\r\n]+)"
    body = sep.join(str(int(t)).encode() for t in tokens)
    return re.compile(body + rb"(?![0-9])")


def text_matches(pattern: re.Pattern[bytes], data: bytes) -> list[int]:
    """Start offsets of ``pattern`` in ``data`` not preceded by a digit (overlaps too)."""
    out = []
    match = pattern.search(data)
    while match is not None:
        at = match.start()
        if at == 0 or not data[at - 1:at].isdigit():
            out.append(at)
        match = pattern.search(data, at + 1)
    return out


@dataclass(frozen=True, kw_only=True)
class Hit:
    path: str
    offset: int
    form: str


@dataclass(kw_only=True)
class ScanResult:
    """What a scan found: hits, files and bytes read, files it could not read."""

    hits: list[Hit] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    unreadable: list[str] = field(default_factory=list)

    def by_form(self) -> dict[str, int]:
        return {form: sum(1 for h in self.hits if h.form == form) for form in FORMS}

    def to_json(self) -> dict[str, object]:
        return {"hits": len(self.hits), "by_form": self.by_form(), "files": self.files,
                "bytes": self.bytes, "unreadable": list(self.unreadable),
                "hit_files": sorted({h.path for h in self.hits})}


class CanaryScanner:
    """Scans files for one canary (at least 2 tokens, so a single common id is no hit)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        if len(tokens) < 2:
            raise ValueError("a canary needs at least 2 token ids")
        self.tokens = [int(t) for t in tokens]
        self._binary = binary_forms(self.tokens)
        self._text = text_pattern(self.tokens)
        longest_text = sum(len(str(t)) + 16 for t in self.tokens)
        self._overlap = max(max(len(b) for b in self._binary.values()), longest_text)

    def scan_bytes(self, data: bytes, *, path: str = "<bytes>", base: int = 0,
                   start: int = 0) -> list[Hit]:
        """Hits in ``data`` that begin at or after ``start`` (offsets shifted by ``base``)."""
        hits = []
        for form, needle in self._binary.items():
            at = data.find(needle, start)
            while at != -1:
                hits.append(Hit(path=path, offset=base + at, form=form))
                at = data.find(needle, at + 1)
        hits += [Hit(path=path, offset=base + at, form="text")
                 for at in text_matches(self._text, data) if at >= start]
        return hits

    def scan_file(self, path: Path) -> list[Hit]:
        """Every hit in one file, read in overlapping chunks."""
        hits: list[Hit] = []
        with open(path, "rb") as handle:
            tail, base = b"", 0
            while chunk := handle.read(_CHUNK):
                data = tail + chunk
                # a hit inside the carried tail is found twice: the set below drops it
                hits += self.scan_bytes(data, path=str(path), base=base - len(tail))
                tail = data[-self._overlap:]
                base += len(chunk)
        return sorted(set(hits), key=lambda h: (h.offset, h.form))

    def scan(self, roots: Iterable[Path]) -> ScanResult:
        """Scan every regular file under ``roots`` (files or directories)."""
        result = ScanResult()
        for path in _files(roots):
            try:
                result.hits += self.scan_file(path)
                result.files += 1
                result.bytes += path.stat().st_size
            except OSError as exc:
                result.unreadable.append(f"{path}: {exc.strerror or exc}")
        return result


def _files(roots: Iterable[Path]) -> Iterable[Path]:
    for root in roots:
        root = Path(root)
        if root.is_file() and not root.is_symlink():
            yield root
            continue
        for dirpath, _dirs, names in os.walk(root):
            for name in sorted(names):
                path = Path(dirpath) / name
                if path.is_file() and not path.is_symlink():
                    yield path
