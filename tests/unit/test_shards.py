"""Shard rows, writer determinism, atomicity, quantisation error, compactness and blocks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hebrus_flywheel.consumers.epochs import EpochBoundary, EpochPlan, freeze_offsets
from hebrus_flywheel.consumers.exceptions import ShardError
from hebrus_flywheel.consumers.intake import PartitionLog, classify
from hebrus_flywheel.consumers.labels import SourceRef, pack_rows, quantize_weights_u8
from hebrus_flywheel.consumers.shards import (
    STAGING_DIR,
    ShardConfig,
    ShardName,
    clean_staging,
    write_shard,
)
from hebrus_flywheel.core.snapshot import (
    METADATA_KEYS,
    SHARD_FORMAT,
    U8_MAX_ABS_ERROR,
    ParquetSettings,
    ShardLayout,
    dequantize_weights_u8,
    open_parquet,
    read_parquet,
    read_shard_metadata,
    sha256_file,
    shard_layout,
    shard_metadata,
    shard_schema,
)
from hebrus_flywheel.core.snapshot.encode import plaintext_encoding
from hebrus_flywheel.schemas import codec
from tests.support.windows import (
    make_window,
    router_labels,
    synthetic_labels,
    synthetic_layout,
)

L, K, D, H = 4, 10, 16, 64
GEOMETRY = synthetic_layout(layers=L, top_k=K, feature_dim=D, hidden_dim=H)
TOPIC = "flywheel.windows.train.v1"


def items(n: int = 3, anchors: int = 5) -> list[tuple[Any, SourceRef]]:
    return [(synthetic_labels(f"w{i}", anchors, seed=i, first=10 * i, hidden=i == 1),
             SourceRef(topic=TOPIC, partition=0, offset=i)) for i in range(n)]


def table_for(rows: list[tuple[Any, SourceRef]], geometry: ShardLayout = GEOMETRY) -> pa.Table:
    table = pack_rows(rows, geometry)
    info = {"epoch": 0, "rows": table.num_rows, "identity_id": "i" * 64}
    return table.replace_schema_metadata(shard_metadata(geometry, info))


# --- rows and schema -------------------------------------------------------------------


def test_rows_have_the_explicit_schema_sorted_by_offset_then_ordinal() -> None:
    shuffled = list(reversed(items()))
    table = pack_rows(shuffled, GEOMETRY)
    assert table.schema.equals(shard_schema(GEOMETRY))
    assert table.num_rows == 15
    offsets = table.column("source_offset").to_pylist()
    ordinals = table.column("token_ordinal").to_pylist()
    assert list(zip(offsets, ordinals, strict=True)) == sorted(zip(offsets, ordinals, strict=True))
    assert table.column("hidden").null_count == 10
    assert pa.types.is_uint16(table.schema.field("expert_ids").type.value_type.value_type)
    assert pa.types.is_uint8(table.schema.field("weights_u8").type.value_type.value_type)
    assert pa.types.is_float16(table.schema.field("features").type.value_type.value_type)


def test_labels_survive_the_round_trip_exactly(tmp_path: Path) -> None:
    rows = items()
    info = write_shard(tmp_path, "epoch=0/split=train/a.parquet", table_for(rows),
                       ShardConfig(), windows=3)
    back = read_parquet(tmp_path / info.relpath)
    ids = np.asarray(back.column("expert_ids").to_pylist(), dtype=np.uint16)
    q = np.asarray(back.column("weights_u8").to_pylist(), dtype=np.uint8)
    want_ids = np.concatenate([lab.expert_ids_ALK for lab, _ in rows])
    want_w = np.concatenate([lab.weights_ALK for lab, _ in rows])
    assert np.array_equal(ids, want_ids)
    assert np.abs(dequantize_weights_u8(q) - want_w).max() <= U8_MAX_ABS_ERROR + 1e-7


def test_malformed_labels_are_refused() -> None:
    bad = dataclasses.replace(synthetic_labels("w", 3),
                              features_ALD=np.full((3, L, D), np.inf, dtype=np.float16))
    with pytest.raises(ShardError, match="non-finite"):
        pack_rows([(bad, SourceRef(topic=TOPIC, partition=0, offset=0))], GEOMETRY)
    wrong = synthetic_labels("w", 3, layers=L + 1)
    with pytest.raises(ShardError, match="shape"):
        pack_rows([(wrong, SourceRef(topic=TOPIC, partition=0, offset=0))], GEOMETRY)


# --- determinism and atomicity ---------------------------------------------------------


def test_same_rows_give_byte_identical_plaintext_encodings(tmp_path: Path) -> None:
    config = ShardConfig(row_group_rows=4)
    a = write_shard(tmp_path / "a", "epoch=0/split=train/x.parquet", table_for(items()), config,
                    windows=3)
    b = write_shard(tmp_path / "b", "epoch=0/split=train/x.parquet",
                    table_for(list(reversed(items()))), config, windows=3)
    plain = write_shard(tmp_path / "p", "epoch=0/split=train/x.parquet", table_for(items()),
                        config, windows=3, crypto=None)
    # Encrypted by default: fresh data keys and nonces, so only the plaintext is identical.
    assert a.encrypted and b.encrypted and not plain.encrypted
    assert a.sha256 == sha256_file(tmp_path / "a" / a.relpath) != b.sha256
    assert a.plaintext_sha256 == b.plaintext_sha256 == plain.sha256 == plain.plaintext_sha256
    assert plain.sha256 == sha256_file(tmp_path / "p" / plain.relpath)
    meta = open_parquet(tmp_path / "a" / a.relpath).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [4, 4, 4, 3]
    assert meta.created_by == f"parquet-cpp-arrow version {pa.__version__}"
    assert set(meta.metadata) == {b"ARROW:schema", *METADATA_KEYS, b"flywheel.plaintext_sha256",
                                  b"flywheel.encryption"}
    assert set(pq.read_metadata(tmp_path / "p" / plain.relpath).metadata) == {
        b"ARROW:schema", *METADATA_KEYS}
    record = read_shard_metadata(meta.metadata)
    assert record["format"] == SHARD_FORMAT and (record["epoch"], record["rows"]) == (0, 15)
    assert shard_layout(meta.metadata) == GEOMETRY
    assert json.loads(meta.metadata[b"flywheel.routed_layers"]) == [0, 1, 2, 3]
    assert meta.metadata[b"flywheel.expert_count"] == b"512"
    assert json.loads(meta.metadata[b"flywheel.weight_quantization"])["max_abs_error"] == (
        U8_MAX_ABS_ERROR)


def test_rewrite_of_identical_plaintext_is_accepted_and_different_content_refused(
    tmp_path: Path,
) -> None:
    rel = "epoch=0/split=train/x.parquet"
    first = write_shard(tmp_path, rel, table_for(items()), ShardConfig(), windows=3)
    again = write_shard(tmp_path, rel, table_for(items()), ShardConfig(), windows=3)
    assert again.sha256 == first.sha256
    with pytest.raises(ShardError, match="not deterministic"):
        write_shard(tmp_path, rel, table_for(items(n=2)), ShardConfig(), windows=2)
    assert sha256_file(tmp_path / rel) == first.sha256
    assert list((tmp_path / STAGING_DIR).iterdir()) == []


def test_a_failed_write_leaves_nothing_visible(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    original = pq.ParquetWriter.write_table

    def failing(self: Any, table: pa.Table, row_group_size: int | None = None) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        original(self, table, row_group_size=row_group_size)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", failing)
    with pytest.raises(ShardError, match="disk full"):
        write_shard(tmp_path, "epoch=0/split=train/x.parquet", table_for(items()),
                    ShardConfig(row_group_rows=4), windows=3)
    assert not (tmp_path / "epoch=0/split=train/x.parquet").exists()
    assert list((tmp_path / STAGING_DIR).iterdir()) == []


_KILL_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_shards import items, table_for
from hebrus_flywheel.consumers.shards import ShardConfig, write_shard
write_shard(Path({root!r}), "epoch=0/split=train/x.parquet", table_for(items()),
            ShardConfig(row_group_rows=4), windows=3)
"""


@pytest.mark.parametrize("point", ["mid_write", "before_rename"])
def test_kill_during_a_write_leaves_no_partial_shard(tmp_path: Path, point: str) -> None:
    script = _KILL_SCRIPT.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    env = {**os.environ, "FLYWHEEL_FAULT": point}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          timeout=120, check=False)
    assert proc.returncode == 137, proc.stderr.decode()
    assert not (tmp_path / "epoch=0").exists() or not any((tmp_path / "epoch=0").rglob("*.*"))
    leftovers = list((tmp_path / STAGING_DIR).iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".tmp")
    assert clean_staging(tmp_path) == 1
    clean = write_shard(tmp_path / "clean", "epoch=0/split=train/x.parquet", table_for(items()),
                        ShardConfig(row_group_rows=4), windows=3)
    again = write_shard(tmp_path, "epoch=0/split=train/x.parquet", table_for(items()),
                        ShardConfig(row_group_rows=4), windows=3)
    assert again.plaintext_sha256 == clean.plaintext_sha256


# --- quantisation and compactness ------------------------------------------------------


def test_uint8_weight_error_is_bounded_as_documented() -> None:
    rng = np.random.default_rng(7)
    for std in (0.5, 2.0, 6.0):  # flat, default-teacher and peaked routers
        _, weights, _ = router_labels(rng, 2000, layers=4, logit_std=std)
        err = dequantize_weights_u8(quantize_weights_u8(weights)) - weights
        assert np.abs(err).max() <= U8_MAX_ABS_ERROR + 1e-7
        assert np.abs(err.sum(-1)).max() <= K * U8_MAX_ABS_ERROR + 1e-6
    with pytest.raises(ShardError, match="outside"):
        quantize_weights_u8(np.array([1.5], dtype=np.float32))
    with pytest.raises(ShardError, match="NaN"):
        quantize_weights_u8(np.array([np.nan], dtype=np.float32))


def _column_bytes(path: Path) -> dict[str, int]:
    meta = open_parquet(path).metadata
    out: dict[str, int] = {}
    for rg in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            col = meta.row_group(rg).column(c)
            name = col.path_in_schema.split(".")[0]
            out[name] = out.get(name, 0) + col.total_compressed_size
    return out


@pytest.mark.parametrize("encoding", ["uint8", "float16"])
def test_bytes_per_token_layer_label_at_48_layers_top10(tmp_path: Path, encoding: str) -> None:
    geometry = synthetic_layout(layers=48, top_k=K, feature_dim=D, hidden_dim=H,
                                weight_encoding=encoding)
    rows = [(synthetic_labels(f"w{i}", 128, seed=i, first=128 * i, layers=48),
             SourceRef(topic=TOPIC, partition=0, offset=i)) for i in range(8)]
    info = write_shard(tmp_path, "x.parquet", table_for(rows, geometry),
                       ShardConfig(weight_encoding=encoding), windows=8)
    sizes = _column_bytes(tmp_path / info.relpath)
    labels_bytes = sizes["expert_ids"] + sizes[geometry.weight_column]
    per_label = labels_bytes / (info.rows * 48)
    print(f"\n{encoding}: {per_label:.2f} bytes per (token, layer) label "
          f"(ids {sizes['expert_ids'] / (info.rows * 48):.2f}, weights "
          f"{sizes[geometry.weight_column] / (info.rows * 48):.2f}); design note: 80")
    if encoding == "uint8":
        assert per_label <= 25.0
    assert per_label < 80.0


# --- names, blocks, intake ---------------------------------------------------------------


def test_shard_names_round_trip_and_refuse_strangers() -> None:
    name = ShardName(topic="t-1.flywheel.windows.train.v1", partition=3, first_offset=256,
                     last_offset=511)
    assert ShardName.parse(name.filename) == name
    with pytest.raises(ShardError, match="not a shard name"):
        ShardName.parse("notes.txt")


def _boundary(epoch: int, start: int, end: int) -> EpochBoundary:
    return EpochBoundary(epoch=epoch, start=freeze_offsets({TOPIC: {0: start}}),
                         end=freeze_offsets({TOPIC: {0: end}}))


def test_blocks_are_aligned_and_cut_at_epoch_boundaries() -> None:
    plan = EpochPlan(4, [_boundary(0, 0, 6), _boundary(1, 6, 13)])
    spans = [(b.epoch, b.first, b.end, b.final)
             for b in (plan.block(TOPIC, 0, o) for o in (0, 3, 4, 5, 6, 7, 8, 12, 13, 17))]
    assert spans == [(0, 0, 4, True), (0, 0, 4, True), (0, 4, 6, True), (0, 4, 6, True),
                     (1, 6, 8, True), (1, 6, 8, True), (1, 8, 12, True), (1, 12, 13, True),
                     (2, 13, 16, False), (2, 16, 20, False)]


def test_partition_log_drops_repeats_and_closes_full_blocks() -> None:
    plan = EpochPlan(3)
    plog = PartitionLog(topic=TOPIC, partition=0, split="train", base=0, written_ids={"old"})
    assert not plog.admit(0, {"window_id": "old"})
    assert plog.admit(1, {"window_id": "a"})
    assert plog.next_block(plan) is None
    assert not plog.admit(2, {"window_id": "a"})
    block = plog.next_block(plan)
    assert block is not None and (block.first, block.end) == (0, 3)
    assert [a.source.offset for a in plog.take(block)] == [1]
    assert plog.base == 3 and "a" in plog.written_ids


def test_classify_accepts_good_windows_and_names_the_reason_for_bad_ones() -> None:
    entry = codec.default_registry().get("Window.v1")
    headers = codec.kafka_headers(entry)
    good = make_window(token_ids=[1, 2, 3, 4], anchors=[2, 3], identity_id="a" * 64,
                       owner="o", thread="t")
    key = b"o/t"

    def verdict(window: dict[str, Any], **kw: Any) -> Any:
        args = {"split": "train", "identity_id": "a" * 64, "vocab_size": 100, **kw}
        return classify(codec.encode_entry(entry, window), headers, key, **args)

    assert verdict(good).accepted
    assert verdict(good, identity_id="b" * 64).reason == "identity_mismatch"
    assert verdict(good, vocab_size=3).reason == "token_id_out_of_range"
    assert verdict(good, split="validation").reason == "value_out_of_range"
    assert classify(codec.encode_entry(entry, good), headers, b"x/y", split="train",
                    identity_id="a" * 64, vocab_size=100).reason == "invalid_key"
    assert classify(b"garbage", headers, key, split="train", identity_id="a" * 64,
                    vocab_size=100).reason == "undecodable"


def test_duckdb_reads_decrypted_shards_as_an_independent_reader(tmp_path: Path) -> None:
    """DuckDB cannot use our KMS-wrapped keys: it refuses the encrypted shard (no garbage)
    and reads the plaintext encoding, whose digest the writer recorded."""
    rows = items()
    info = write_shard(tmp_path / "sealed", "epoch=0/split=train/x.parquet", table_for(rows),
                       ShardConfig(), windows=3)
    with pytest.raises(duckdb.Error, match="encrypted"):
        duckdb.sql(f"SELECT count(*) FROM read_parquet('{tmp_path}/sealed/{info.relpath}')"
                   ).fetchall()
    data = plaintext_encoding(read_parquet(tmp_path / "sealed" / info.relpath),
                              ParquetSettings())
    assert hashlib.sha256(data).hexdigest() == info.plaintext_sha256
    (tmp_path / "epoch=0/split=train").mkdir(parents=True)
    (tmp_path / "epoch=0/split=train/x.parquet").write_bytes(data)
    got = duckdb.sql(
        f"SELECT count(*), count(DISTINCT window_id), min(expert_ids[1][1]), "
        f"max(len(expert_ids)), max(len(features[1])) "
        f"FROM read_parquet('{tmp_path}/epoch=*/split=*/*.parquet', hive_partitioning=true) "
        f"WHERE epoch = 0 AND split = 'train'"
    ).fetchall()[0]
    first = min(int(lab.expert_ids_ALK[:, 0, 0].min()) for lab, _ in rows)
    assert got == (15, 3, first, L, D)
