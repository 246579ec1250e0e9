"""The snapshot dataset: verification, lazy open, work division, determinism, decoding."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hebrus_flywheel.core.snapshot import content_digest, manifest_digest, read_parquet
from hebrus_flywheel.core.snapshot import read as read_module
from hebrus_flywheel.train.data import Snapshot, SnapshotDataset, StreamConfig, make_loader
from hebrus_flywheel.train.exceptions import SnapshotError
from tests.support.planted import (
    PlantedConfig,
    PlantedSnapshot,
    make_writable,
    write_planted_snapshot,
)

CONFIG = PlantedConfig(threads={"train": 5, "validation": 2, "stress_holdout": 1},
                       tokens_per_thread=24, anchors_per_window=6, offsets_per_shard=3,
                       row_group_rows=8, layers=3, experts=32, top_k=4, hidden_dim=8,
                       feature_dim=12)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlantedSnapshot]:
    root = tmp_path_factory.mktemp("planted")
    yield write_planted_snapshot(root, CONFIG)
    make_writable(root)


def keys(batches: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    return [(t, int(o), int(layer)) for b in batches
            for t, o, layer in zip(b["thread"], b["ordinal_B"], b["layer_B"], strict=True)]


def first_train(planted: PlantedSnapshot) -> dict[str, Any]:
    return next(s for s in planted.manifest["shards"] if s["split"] == "train")


def stream(snapshot: Snapshot, **fields: Any) -> SnapshotDataset:
    rank, world = fields.pop("rank", None), fields.pop("world_size", None)
    return SnapshotDataset(snapshot, StreamConfig(**fields), rank=rank, world_size=world)


def test_open_reads_the_manifest_and_plans_shard_row_group_units(planted: PlantedSnapshot) -> None:
    snapshot = Snapshot(planted.directory, expected_id=planted.snapshot_id)
    assert snapshot.geometry["layers"] == 3 and snapshot.expert_count == 32
    # 5 threads x 4 windows = 20 windows -> 7 shards of <= 3 windows (18 rows) -> 3 groups
    units = snapshot.units(["train"])
    assert len(units) == sum(-(-e["rows"] // 8) for e in planted.manifest["shards"]
                             if e["split"] == "train")
    assert snapshot.feature_contract["projection_digest"] == planted.projection.digest


def test_a_manifest_of_10000_shards_opens_without_touching_a_shard(
        planted: PlantedSnapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = json.loads((planted.directory / "manifest.json").read_text())
    template = next(s for s in manifest["shards"] if s["split"] == "train")
    manifest["shards"] = [{**template, "path": f"split=train/missing-{i:05d}.parquet"}
                          for i in range(10_000)]
    manifest["content_id"] = content_digest(manifest)
    manifest["snapshot_id"] = manifest_digest(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    touched: list[Any] = []
    monkeypatch.setattr(read_module, "sha256_file", lambda p: touched.append(p))
    monkeypatch.setattr(read_module, "open_parquet", lambda *a, **k: touched.append(a))
    monkeypatch.setattr(read_module, "read_parquet", lambda *a, **k: touched.append(a))
    monkeypatch.setattr(read_module, "is_encrypted", lambda *a, **k: touched.append(a))
    snapshot = Snapshot(tmp_path)  # none of the 10,000 files exists
    dataset = stream(snapshot, splits=("train",))
    assert len(dataset.units) == 10_000 * -(-template["rows"] // 8) and touched == []
    with pytest.raises(SnapshotError, match="missing"):
        next(iter(dataset))


def test_every_unit_goes_to_exactly_one_rank_and_worker(planted: PlantedSnapshot) -> None:
    dataset = stream(Snapshot(planted.directory), splits=("train",), seed=3)
    for slots in (1, 2, 3, 4, 7):
        for epoch in (0, 1):
            dealt = [u for s in range(slots) for u in dataset.assigned(epoch, s, slots)]
            assert sorted(dealt, key=lambda u: (u.shard, u.row_group)) == sorted(
                dataset.units, key=lambda u: (u.shard, u.row_group))


def test_ranks_and_loader_workers_read_disjoint_rows_covering_the_split(
        planted: PlantedSnapshot) -> None:
    snapshot = Snapshot(planted.directory)
    everything = keys(list(stream(snapshot, splits=("train",), batch_size=50, shuffle=False)))
    seen: list[tuple[str, int, int]] = []
    for rank in (0, 1):
        dataset = stream(snapshot, splits=("train",), batch_size=50, rank=rank, world_size=2)
        seen += keys(list(make_loader(dataset, num_workers=2)))
    assert len(seen) == len(set(seen)) == len(everything)
    assert set(seen) == set(everything) and len(everything) == 5 * 24 * 3


def test_the_order_is_a_function_of_seed_and_epoch(planted: PlantedSnapshot) -> None:
    snapshot = Snapshot(planted.directory)

    def run(**fields: Any) -> list[dict[str, Any]]:
        return list(stream(snapshot, splits=("train",), batch_size=64, shuffle_buffer=128,
                           **fields))

    first, again = run(seed=1), run(seed=1)
    assert keys(first) == keys(again)
    for a, b in zip(first, again, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    other_epoch, other_seed = run(seed=1, epoch=1), run(seed=2)
    assert keys(other_epoch) != keys(first) and keys(other_seed) != keys(first)
    assert Counter(keys(other_epoch)) == Counter(keys(first)) == Counter(keys(other_seed))


def test_endless_streams_move_to_the_next_epoch(planted: PlantedSnapshot) -> None:
    snapshot = Snapshot(planted.directory)
    one_epoch = keys(list(stream(snapshot, splits=("validation",), batch_size=16)))
    endless = iter(stream(snapshot, splits=("validation",), batch_size=16, epochs=None))
    two = keys([next(endless) for _ in range(2 * -(-len(one_epoch) // 16))])
    assert Counter(two[:len(one_epoch)]) == Counter(one_epoch)
    assert two[len(one_epoch):2 * len(one_epoch)] != one_epoch


def test_splits_are_selected_by_name(planted: PlantedSnapshot) -> None:
    snapshot = Snapshot(planted.directory)
    batches = list(stream(snapshot, splits=("validation", "stress_holdout"), batch_size=40))
    assert {s for b in batches for s in b["split"]} == {"validation", "stress_holdout"}
    assert len(keys(batches)) == (2 + 1) * 24 * 3


def test_unshuffled_streams_keep_each_thread_in_ordinal_order(planted: PlantedSnapshot) -> None:
    rows = keys(list(stream(Snapshot(planted.directory), splits=("train",), batch_size=7,
                            shuffle=False)))
    last: dict[str, tuple[int, int]] = {}
    for thread, ordinal, layer in rows:
        assert (ordinal, layer) > last.get(thread, (-1, -1))
        last[thread] = (ordinal, layer)


def test_batches_decode_the_shard_rows(planted: PlantedSnapshot) -> None:
    snapshot = Snapshot(planted.directory)
    batch = next(iter(stream(snapshot, splits=("train",), batch_size=10_000, shuffle=False,
                             layer_offsets=(0, 1))))
    entry = first_train(planted)
    table = read_parquet(planted.directory / entry["path"])
    ids = np.array(table.column("expert_ids").to_pylist())  # (n, L, K)
    weights = np.array(table.column("weights_u8").to_pylist()) / 255.0
    features = np.array(table.column("features").to_pylist(), dtype=np.float16)
    n = len(ids)
    assert batch["feature_BD"].dtype == torch.float16 and batch["layer_B"].dtype == torch.int64
    assert np.array_equal(batch["target_ids_BK"][: 3 * n].numpy(), ids.reshape(3 * n, 4))
    assert np.allclose(batch["target_weights_BK"][: 3 * n].numpy(), weights.reshape(3 * n, 4))
    assert np.array_equal(batch["feature_BD"][: 3 * n].numpy(), features.reshape(3 * n, 12))
    assert batch["thread"][0] == f"{table.column('owner')[0]}/{table.column('thread')[0]}#0"
    next_ids, valid = batch["offset_target_ids_BOK"][:, 1], batch["offset_valid_BO"][:, 1]
    assert valid.tolist()[:6] == [True, True, False, True, True, False]
    assert np.array_equal(next_ids[: 3 * n].numpy().reshape(n, 3, 4)[:, :2], ids[:, 1:])
    assert torch.equal(batch["offset_target_ids_BOK"][:, 0], batch["target_ids_BK"])


def _copy(planted: PlantedSnapshot, tmp_path: Path) -> Path:
    target = tmp_path / "epoch=0"
    shutil.copytree(planted.directory, target)
    make_writable(target)
    return target


def test_a_flipped_byte_in_a_shard_is_refused(planted: PlantedSnapshot, tmp_path: Path) -> None:
    target = _copy(planted, tmp_path)
    shard = target / first_train(planted)["path"]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    snapshot = Snapshot(target)  # lazy: the manifest is intact, the shard is checked on read
    with pytest.raises(SnapshotError, match="differs from its manifest"):
        list(stream(snapshot, splits=("train",), shuffle=False))
    with pytest.raises(SnapshotError, match="SHA-256"):
        Snapshot(target, verify="full")


def test_a_missing_shard_or_an_extra_file_is_refused(planted: PlantedSnapshot,
                                                     tmp_path: Path) -> None:
    target = _copy(planted, tmp_path)
    (target / "split=train" / "stray.parquet").write_bytes(b"x")
    with pytest.raises(SnapshotError, match="extra file"):
        Snapshot(target, verify="full")
    (target / first_train(planted)["path"]).unlink()
    with pytest.raises(SnapshotError, match="missing"):
        list(stream(Snapshot(target), splits=("train",), shuffle=False))


def test_an_edited_manifest_or_an_unexpected_id_is_refused(planted: PlantedSnapshot,
                                                           tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="expected"):
        Snapshot(planted.directory, expected_id="0" * 64)
    target = _copy(planted, tmp_path)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["shards"][0]["rows"] += 1
    (target / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match="edited or damaged"):
        Snapshot(target)
