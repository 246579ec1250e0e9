"""The pinned Parquet encoding of a shard, plaintext or encrypted.

Every writer option is fixed (format version, zstd level, dictionary and page sizes,
fixed row-group size, page checksums, sorting-columns metadata), so the same rows give
the same *plaintext encoding* byte for byte. An encrypted shard is that encoding with
encryption properties added; its plaintext SHA-256 (the digest of the bytes the same
rows give without encryption) is what rebuild parity and ``flywheel verify --keys``
compare, since random data keys and nonces make the ciphertext differ on every write.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hebrus_flywheel.core.snapshot.errors import ShardFormatError
from hebrus_flywheel.core.snapshot.shard import sort_columns_for


@dataclass(frozen=True, kw_only=True)
class ParquetSettings:
    """The writer options a dataset may choose (``determinism.shard`` of a manifest).

    Fields:
        row_group_rows: rows per row group.
        compression_level: zstd level.
        data_page_bytes: data page size target.
    """

    row_group_rows: int = 8192
    compression_level: int = 3
    data_page_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("row_group_rows", "compression_level", "data_page_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ShardFormatError(f"ParquetSettings.{name} must be a positive integer, "
                                       f"got {value!r}")

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any]) -> ParquetSettings:
        """The settings out of a ``determinism.shard`` record (other keys ignored)."""
        return cls(**{k: value[k] for k in ("row_group_rows", "compression_level",
                                            "data_page_bytes") if k in value})


def open_writer(sink: Any, schema: pa.Schema, settings: ParquetSettings,
                encryption_properties: Any = None) -> pq.ParquetWriter:
    """A ParquetWriter with every option pinned (``sink``: a path or an output stream)."""
    return pq.ParquetWriter(
        sink, schema, version="2.6", compression="zstd",
        compression_level=settings.compression_level, use_dictionary=True,
        write_statistics=True, data_page_size=settings.data_page_bytes,
        data_page_version="1.0", dictionary_pagesize_limit=1 << 20, write_batch_size=1024,
        store_schema=True, write_page_index=False, write_page_checksum=True,
        sorting_columns=[pq.SortingColumn(schema.get_field_index(c))
                         for c in sort_columns_for(schema)],
        encryption_properties=encryption_properties,
    )


def write_row_groups(writer: pq.ParquetWriter, table: pa.Table, settings: ParquetSettings,
                     after_group: Callable[[], None] | None = None) -> None:
    """Write ``table`` in fixed row groups of ``settings.row_group_rows``."""
    step = settings.row_group_rows
    for start in range(0, table.num_rows, step):
        writer.write_table(table.slice(start, step), row_group_size=step)
        if after_group is not None:
            after_group()


def plaintext_encoding(table: pa.Table, settings: ParquetSettings) -> bytes:
    """The bytes of ``table``'s plaintext shard file."""
    sink = pa.BufferOutputStream()
    writer = open_writer(sink, table.schema, settings)
    try:
        write_row_groups(writer, table, settings)
    finally:
        writer.close()
    return bytes(sink.getvalue())


def plaintext_sha256(table: pa.Table, settings: ParquetSettings) -> str:
    """Hex SHA-256 of :func:`plaintext_encoding`."""
    return hashlib.sha256(plaintext_encoding(table, settings)).hexdigest()
