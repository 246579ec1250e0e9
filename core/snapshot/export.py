"""A plaintext copy of a sealed, encrypted snapshot for tools without the project's keys.

Outside readers such as DuckDB cannot read shards whose data keys are wrapped by our
KEK (DuckDB knows only its own Parquet key configuration). ``flywheel export-plaintext``
decrypts every shard through :class:`~hebrus_flywheel.core.snapshot.read.SealedSnapshot`
(checked against the manifest first) and writes its *plaintext encoding*, so each exported
file's SHA-256 must equal the manifest's ``plaintext_sha256``: the copy is checked, not
trusted. The copy is unencrypted; keep it in a private directory and delete it after use.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hebrus_flywheel.core.files import atomic_write_bytes
from hebrus_flywheel.core.snapshot.crypto import ShardCrypto
from hebrus_flywheel.core.snapshot.encode import ParquetSettings, plaintext_encoding
from hebrus_flywheel.core.snapshot.errors import VerifyError
from hebrus_flywheel.core.snapshot.read import open_snapshot
from hebrus_flywheel.core.snapshot.shard import PRODUCTS


def export_plaintext(snapshot: Path | str, out: Path, *,
                     crypto: ShardCrypto | None = None) -> list[Path]:
    """Write every shard of ``snapshot`` unencrypted under ``out`` (same relative paths).

    VerifyError when a decrypted shard does not re-encode to its ``plaintext_sha256``;
    KeyAccessError without the snapshot's KEK.
    """
    sealed = open_snapshot(snapshot, verify="full", crypto=crypto, products=PRODUCTS)
    settings = ParquetSettings.from_mapping(sealed.manifest["determinism"].get("shard") or {})
    out = Path(out)
    written = []
    for index, entry in enumerate(sealed.manifest.shards):
        data = plaintext_encoding(sealed.read_shard(index, None), settings)
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.plaintext_sha256:
            raise VerifyError(f"snapshot {sealed.snapshot_id}: {entry.path} decrypts to "
                              f"plaintext SHA-256 {digest}, the manifest says "
                              f"{entry.plaintext_sha256}; do not use it")
        target = out / entry.path
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write_bytes(target, data)
        os.chmod(target, 0o600)
        written.append(target)
    return written
