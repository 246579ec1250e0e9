"""The snapshot contract: shard row schema, Parquet footer keys, manifest, verification.

The writer (``consumers``) and every reader (``train``, qualification, outside tools)
import this package and nothing else to agree on what a sealed snapshot is.
``docs/snapshot-format.md`` is the same contract for readers with only DuckDB.
"""

from __future__ import annotations

from hebrus_flywheel.core.snapshot.crypto import (
    ShardCrypto,
    default_crypto,
    is_encrypted,
    open_parquet,
    read_parquet,
)
from hebrus_flywheel.core.snapshot.encode import ParquetSettings, plaintext_sha256
from hebrus_flywheel.core.snapshot.errors import (
    KeyAccessError,
    ManifestError,
    ProductError,
    ShardFormatError,
    SnapshotContractError,
    VerifyError,
)
from hebrus_flywheel.core.snapshot.keys import KeyProvider, LocalKeyFile, default_kek_path
from hebrus_flywheel.core.snapshot.manifest import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    Manifest,
    ShardEntry,
    content_digest,
    load_manifest,
    manifest_digest,
    manifest_path,
    parse_manifest,
)
from hebrus_flywheel.core.snapshot.read import (
    SealedSnapshot,
    open_snapshot,
    sha256_file,
    verify_snapshot,
)
from hebrus_flywheel.core.snapshot.shard import (
    CANDIDATE_SORT_COLUMNS,
    CONTRACT_VERSION,
    F16_MAX_REL_ERROR,
    FEATURE_DTYPES,
    METADATA_KEYS,
    PRODUCT_CANDIDATE,
    PRODUCT_CLEAN,
    PRODUCTS,
    SHARD_FORMAT,
    SORT_COLUMNS,
    U8_LEVELS,
    U8_MAX_ABS_ERROR,
    WEIGHT_ENCODINGS,
    ShardLayout,
    candidate_shard_schema,
    dequantize_weights_u8,
    read_shard_metadata,
    shard_layout,
    shard_metadata,
    shard_product,
    shard_schema,
    sort_columns_for,
)

__all__ = [
    "CANDIDATE_SORT_COLUMNS",
    "CONTRACT_VERSION",
    "F16_MAX_REL_ERROR",
    "FEATURE_DTYPES",
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "METADATA_KEYS",
    "PRODUCTS",
    "PRODUCT_CANDIDATE",
    "PRODUCT_CLEAN",
    "SHARD_FORMAT",
    "SORT_COLUMNS",
    "U8_LEVELS",
    "U8_MAX_ABS_ERROR",
    "WEIGHT_ENCODINGS",
    "KeyAccessError",
    "KeyProvider",
    "LocalKeyFile",
    "Manifest",
    "ManifestError",
    "ParquetSettings",
    "ProductError",
    "SealedSnapshot",
    "ShardCrypto",
    "ShardEntry",
    "ShardFormatError",
    "ShardLayout",
    "SnapshotContractError",
    "VerifyError",
    "candidate_shard_schema",
    "content_digest",
    "default_crypto",
    "default_kek_path",
    "dequantize_weights_u8",
    "is_encrypted",
    "load_manifest",
    "manifest_digest",
    "manifest_path",
    "open_parquet",
    "open_snapshot",
    "parse_manifest",
    "plaintext_sha256",
    "read_parquet",
    "read_shard_metadata",
    "sha256_file",
    "shard_layout",
    "shard_metadata",
    "shard_product",
    "shard_schema",
    "sort_columns_for",
    "verify_snapshot",
]
