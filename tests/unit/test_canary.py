"""The canary byte scanner on files with planted canaries in every form it knows."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from hebrus_flywheel.core.canary import CanaryScanner, binary_forms

CANARY = [50211, 7, 131072, 99]


@pytest.mark.parametrize("form", ["int32le", "int64le", "zigzag"])
def test_scanner_finds_each_binary_form(tmp_path: Path, form: str) -> None:
    (tmp_path / "f.bin").write_bytes(os.urandom(100) + binary_forms(CANARY)[form] + b"x" * 10)
    hits = CanaryScanner(CANARY).scan([tmp_path]).hits
    assert [h.form for h in hits] == [form] and hits[0].offset == 100


@pytest.mark.parametrize("text", [b"[50211, 7, 131072, 99]", b"50211 7 131072 99\n",
                                  b"ids=50211,7,131072,99;", b"50211 ,\n 7,131072   99"])
def test_scanner_finds_decimal_text(tmp_path: Path, text: bytes) -> None:
    (tmp_path / "log.txt").write_bytes(b"prefix " + text + b" suffix")
    assert CanaryScanner(CANARY).scan([tmp_path]).by_form()["text"] == 1


@pytest.mark.parametrize("text", [b"150211, 7, 131072, 99", b"50211, 7, 131072, 990",
                                  b"50211, 7, 131072", b"50211;7;131072;99"])
def test_scanner_ignores_near_misses(tmp_path: Path, text: bytes) -> None:
    (tmp_path / "log.txt").write_bytes(text)
    assert CanaryScanner(CANARY).scan([tmp_path]).hits == []


def test_scanner_finds_a_canary_across_a_chunk_boundary_once(tmp_path: Path) -> None:
    needle = binary_forms(CANARY)["int32le"]
    body = b"\0" * ((1 << 22) - 7) + needle + b"\0" * 100
    (tmp_path / "big.bin").write_bytes(body)
    hits = CanaryScanner(CANARY).scan([tmp_path]).hits
    assert [(h.offset, h.form) for h in hits] == [((1 << 22) - 7, "int32le")]


def test_scanner_reports_unreadable_files_and_skips_symlinks(tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(binary_forms(CANARY)["zigzag"])
    (tmp_path / "link").symlink_to(secret)
    os.chmod(secret, 0)
    try:
        result = CanaryScanner(CANARY).scan([tmp_path])
    finally:
        os.chmod(secret, 0o600)
    if os.geteuid() != 0:
        assert result.hits == [] and len(result.unreadable) == 1
    assert result.files + len(result.unreadable) == 1  # the symlink is not followed


def test_scanner_needs_two_tokens() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        CanaryScanner([5])


def test_scanner_finds_overlapping_text_after_a_rejected_start(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_bytes(b"5021 21 21 21")
    assert [h.offset for h in CanaryScanner([21, 21, 21]).scan([tmp_path]).hits] == [5]


def test_int_forms_are_little_endian() -> None:
    assert binary_forms([1, 2])["int32le"] == struct.pack("<ii", 1, 2)
    assert binary_forms([-1, 64])["zigzag"] == bytes([1, 0x80, 0x01])
