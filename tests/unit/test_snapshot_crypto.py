"""Encryption at rest of sealed shards: what is hidden, who can read, what verify checks."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import duckdb
import pyarrow.parquet as pq
import pytest

from hebrus_flywheel.core.snapshot import (
    KeyAccessError,
    LocalKeyFile,
    ShardCrypto,
    VerifyError,
    default_kek_path,
    load_manifest,
    open_snapshot,
    read_parquet,
    shard_schema,
    verify_snapshot,
)
from hebrus_flywheel.core.snapshot.crypto import CONTENT_KEY, FOOTER_KEY, LINEAGE_KEY
from hebrus_flywheel.core.snapshot.export import export_plaintext
from hebrus_flywheel.core.snapshot.keys import KEK_FILE_ENV
from tests.support.planted import (
    PlantedConfig,
    PlantedSnapshot,
    make_writable,
    write_planted_snapshot,
)

CONFIG = PlantedConfig(threads={"train": 2, "runtime_holdout": 1}, tokens_per_thread=16,
                       layers=3, experts=16, top_k=4, hidden_dim=8, feature_dim=8)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlantedSnapshot]:
    root = tmp_path_factory.mktemp("crypt")
    yield write_planted_snapshot(root, CONFIG)
    make_writable(root)


@pytest.fixture
def copy(planted: PlantedSnapshot, tmp_path: Path) -> Path:
    """A writable copy of the sealed epoch (for byte flips)."""
    out = tmp_path / "epoch=0"
    for path in planted.directory.rglob("*"):
        if path.is_file():
            target = out / path.relative_to(planted.directory)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    return out


def _shard_bytes(planted: PlantedSnapshot) -> list[bytes]:
    return [(planted.directory / s["path"]).read_bytes() for s in planted.manifest["shards"]]


def test_footer_and_columns_are_ciphertext(planted: PlantedSnapshot) -> None:
    record = planted.manifest["encryption"]
    assert record["footer"] == "encrypted" and record["algorithm"] == "AES_GCM_V1"
    assert record["kek_id"] == LocalKeyFile().kek_id
    owners = {row for s in planted.manifest["shards"]
              for row in read_parquet(planted.directory / s["path"], ["owner"])
              .column("owner").to_pylist()}
    identity = planted.manifest["identity"]["identity_id"]
    needles = [o.encode() for o in owners] + [identity.encode(), b"flywheel.shard",
                                              b"expert_ids", b"window_id", b"routed_layers"]
    for data in _shard_bytes(planted):
        assert data[-4:] == b"PARE"  # encrypted-footer magic
        assert [n for n in needles if n in data] == []
    assert "train-owner0" in owners  # the needle is real


def test_every_column_has_a_key_and_columns_are_unwrapped_per_key(
        planted: PlantedSnapshot) -> None:
    keys = planted.manifest["encryption"]["column_keys"]
    names = shard_schema(load_manifest(planted.directory).layout).names  # type: ignore[arg-type]
    assert sorted(keys) == [CONTENT_KEY, LINEAGE_KEY]
    assert sorted(c for cols in keys.values() for c in cols) == sorted(names)
    assert "owner" in keys[LINEAGE_KEY] and "expert_ids" in keys[CONTENT_KEY]

    class Recording(LocalKeyFile):
        unwrapped: ClassVar[list[str]] = []

        def unwrap_key(self, wrapped_key: str, master_key_identifier: str) -> bytes:
            self.unwrapped.append(master_key_identifier)
            return super().unwrap_key(wrapped_key, master_key_identifier)

    crypto = ShardCrypto(Recording())
    path = planted.directory / planted.manifest["shards"][0]["path"]
    read_parquet(path, ["owner"], crypto)
    assert Recording.unwrapped == [FOOTER_KEY, LINEAGE_KEY]  # the content key stays wrapped
    read_parquet(path, ["expert_ids"], crypto)
    assert Recording.unwrapped == [FOOTER_KEY, LINEAGE_KEY, CONTENT_KEY]


def test_verify_without_keys_checks_ciphertext(copy: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEK_FILE_ENV, str(tmp_path / "no-such-key.json"))
    summary = verify_snapshot(copy)
    assert summary["encrypted"] and not summary["plaintext_checked"]
    shard = copy / load_manifest(copy).shards[0].path
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match="SHA-256"):
        verify_snapshot(copy)
    assert not (tmp_path / "no-such-key.json").exists()  # readers never create a key


def test_verify_with_keys_checks_the_plaintext_digests(planted: PlantedSnapshot) -> None:
    summary = verify_snapshot(planted.directory, keys=True)
    assert summary["plaintext_checked"] and summary["shards"] == len(planted.manifest["shards"])


def test_reader_with_keys_reads_the_rows_the_writer_encoded(planted: PlantedSnapshot,
                                                            tmp_path: Path) -> None:
    written = export_plaintext(planted.directory, tmp_path / "plain")
    sealed = open_snapshot(planted.directory, verify="full")
    for index, (entry, path) in enumerate(zip(sealed.manifest.shards, written, strict=True)):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.plaintext_sha256
        assert sealed.read_shard(index, None).equals(pq.read_table(path))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    rows = duckdb.sql(f"SELECT count(*) FROM read_parquet('{tmp_path}/plain/split=*/*.parquet')"
                      ).fetchall()[0][0]
    assert rows == planted.manifest["totals"]["rows"]


def test_reader_without_the_key_file_gets_a_clear_error(
        planted: PlantedSnapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "keys" / "gone.json"
    monkeypatch.setenv(KEK_FILE_ENV, str(missing))
    sealed = open_snapshot(planted.directory)
    with pytest.raises(KeyAccessError, match=f"no key file at {missing}.*{KEK_FILE_ENV}"):
        sealed.read_shard(0, ["expert_ids"])
    with pytest.raises(KeyAccessError, match="no key file"):
        verify_snapshot(planted.directory, keys=True)
    with pytest.raises(KeyAccessError, match="no key file"):
        read_parquet(planted.directory / planted.manifest["shards"][0]["path"])
    assert not missing.exists()


def test_reader_with_another_kek_gets_a_clear_error(
        planted: PlantedSnapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = LocalKeyFile(tmp_path / "other.json", create=True)
    assert other.kek_id != planted.manifest["encryption"]["kek_id"]
    monkeypatch.setenv(KEK_FILE_ENV, str(other.path))
    with pytest.raises(KeyAccessError, match=r"encrypted under KEK .* point"):
        open_snapshot(planted.directory).read_shard(0, ["owner"])
    # Without the manifest's KEK id, the provider itself refuses to unwrap.
    path = planted.directory / planted.manifest["shards"][0]["path"]
    with pytest.raises(KeyAccessError, match="cannot unwrap"):
        read_parquet(path, ["owner"], ShardCrypto(other))


def test_key_file_is_private_and_refused_when_it_is_not(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(KEK_FILE_ENV, raising=False)
    path = default_kek_path()
    assert path == tmp_path / "home" / "keys" / "snapshot-kek.json"
    provider = LocalKeyFile(create=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert LocalKeyFile(create=True).kek_id == provider.kek_id  # created once
    key = provider.unwrap_key(provider.wrap_key(b"k" * 32, "m"), "m")
    assert key == b"k" * 32
    with pytest.raises(KeyAccessError, match="cannot unwrap"):
        provider.unwrap_key(provider.wrap_key(b"k" * 32, "m"), "other-master-key")
    os.chmod(path, 0o644)
    with pytest.raises(KeyAccessError, match="chmod 600"):
        LocalKeyFile()


def test_an_open_snapshot_pickles_without_its_keys(planted: PlantedSnapshot) -> None:
    import pickle

    sealed = open_snapshot(planted.directory)
    first = sealed.read_shard(0, ["owner"])
    again = pickle.loads(pickle.dumps(sealed))  # e.g. into a spawned DataLoader worker
    assert again.read_shard(0, ["owner"]).equals(first)
