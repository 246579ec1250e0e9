"""Shard digests and DuckDB-readable copies of (encrypted) dataset roots for tests.

Shards are encrypted at rest, so byte comparisons use each shard's plaintext SHA-256
(recorded in its encrypted footer) and DuckDB, the independent reader, reads plaintext
copies decrypted through the project's reader (``core.snapshot.read_parquet``).
"""

from __future__ import annotations

from pathlib import Path

from hebrus_flywheel.consumers.shards import iter_shards, shard_summary
from hebrus_flywheel.core.snapshot import ParquetSettings, read_parquet
from hebrus_flywheel.core.snapshot.encode import plaintext_encoding


def plaintext_digests(root: Path) -> dict[str, str]:
    """``epoch=N/split=S/name`` -> plaintext SHA-256 of every shard under ``root``."""
    return {str(p.relative_to(root)): shard_summary(p)["plaintext_sha256"]
            for _, _, p in iter_shards(root)}


def plaintext_copy(root: Path, out: Path) -> Path:
    """Decrypt every shard under ``root`` into the same layout under ``out``; ``out``."""
    for _, _, path in iter_shards(root):
        target = out / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(plaintext_encoding(read_parquet(path), ParquetSettings()))
    return out
