"""Manifests: canonical digest (snapshot id), read-only seal, verify on flip/missing/extra."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.consumers.epochs import EpochBoundary, freeze_offsets
from hebrus_flywheel.consumers.exceptions import ManifestError, SealError, VerifyError
from hebrus_flywheel.consumers.labels import SourceRef, pack_rows
from hebrus_flywheel.consumers.manifest import (
    build_manifest,
    check_ranges,
    describe_shards,
    make_read_only,
    write_manifest,
)
from hebrus_flywheel.consumers.seal import SealConfig, check_policy, resolve_parity
from hebrus_flywheel.consumers.shards import ShardConfig, ShardName, shard_relpath, write_shard
from hebrus_flywheel.core.snapshot import (
    MANIFEST_FILE,
    load_manifest,
    manifest_digest,
    shard_metadata,
    verify_snapshot,
)
from tests.support.windows import synthetic_labels, synthetic_layout

TOPIC = "flywheel.windows.train.v1"
GEOMETRY = synthetic_layout(layers=4, top_k=10, feature_dim=16, hidden_dim=64)
DATASET: dict[str, Any] = {
    "identity": {"identity_id": "i" * 64, "model_family": "qwen3_next",
                 "model_artifact_digest": "a" * 64, "tokenizer_digest": "t" * 64,
                 "chat_template_digest": "c" * 64, "dtype": "float32"},
    "determinism": {"shard": {"offsets_per_shard": 4}, "batch_windows": 2, "torch_threads": 1,
                    "geometry": {"layers": 4, "top_k": 10, "hidden_dim": 64}},
    "writer": {"pyarrow": "x"}, "source": {"prefix": "", "group_id": "flywheel-replay"},
}
BOUNDARY = EpochBoundary(epoch=0, start=freeze_offsets({TOPIC: {0: 0, 1: 0}}),
                         end=freeze_offsets({TOPIC: {0: 6, 1: 0}}))

CONSUMERS_CLI = (sys.executable, "-m", "hebrus_flywheel.consumers")


def write_block(root: Path, epoch: int, first: int, last: int) -> Path:
    rows = [(synthetic_labels(f"w{o}", 3, seed=o, first=o * 3), SourceRef(topic=TOPIC, partition=0,
                                                                  offset=o))
            for o in range(first, last + 1)]
    table = pack_rows(rows, GEOMETRY)
    info = {"epoch": epoch, "split": "train", "topic": TOPIC, "partition": 0,
            "first_offset": first, "last_offset": last, "identity_id": "i" * 64,
            "config_digest": "d" * 64, "windows": len(rows), "rows": table.num_rows}
    table = table.replace_schema_metadata(shard_metadata(GEOMETRY, info))
    name = ShardName(topic=TOPIC, partition=0, first_offset=first, last_offset=last)
    rel = shard_relpath(epoch, "train", name)
    write_shard(root, rel, table, ShardConfig(), windows=len(rows))
    return root / rel


def sealed(root: Path, *, parity: dict[str, Any] | None = None) -> dict[str, Any]:
    write_block(root, 0, 0, 3)
    write_block(root, 0, 4, 5)
    manifest = build_manifest(
        epoch=0, dataset=DATASET, boundary=BOUNDARY, splits_by_topic={TOPIC: "train"},
        shards=describe_shards(root, 0), parity=parity or {"authoritative": True},
        parity_override=None, previous_snapshot=None)
    write_manifest(root, root / "epoch=0", manifest)
    make_read_only(root / "epoch=0")
    return manifest


@pytest.fixture()
def snapshot(tmp_path: Path) -> Any:
    manifest = sealed(tmp_path)
    yield tmp_path / "epoch=0", manifest
    for dirpath, _, _ in os.walk(tmp_path):  # let pytest clean up
        os.chmod(dirpath, 0o755)


def test_manifest_lists_shards_counts_and_offsets(snapshot: Any) -> None:
    directory, manifest = snapshot
    assert [s["path"] for s in manifest["shards"]] == [
        f"split=train/{TOPIC}.p000.o{0:020d}-{3:020d}.parquet",
        f"split=train/{TOPIC}.p000.o{4:020d}-{5:020d}.parquet"]
    assert manifest["totals"] == {"windows": 6, "rows": 18, "bytes": manifest["totals"]["bytes"],
                                  "shards": 2, "labels": 72}
    assert manifest["splits"]["train"]["rows"] == 18
    assert manifest["source"]["topics"][TOPIC]["partitions"]["0"] == {"start": 0, "end": 6}
    assert manifest["geometry"]["feature_dim"] == 16
    assert load_manifest(directory)["snapshot_id"] == manifest["snapshot_id"]


def test_snapshot_id_is_the_canonical_digest_of_the_content(snapshot: Any) -> None:
    _, manifest = snapshot
    reordered = dict(reversed(list(manifest.items())))
    assert manifest_digest(reordered) == manifest["snapshot_id"]
    changed = {**manifest, "epoch": 1}
    assert manifest_digest(changed) != manifest["snapshot_id"]


def test_sealed_files_are_read_only(snapshot: Any) -> None:
    directory, _ = snapshot
    for path in [directory, *directory.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) == 0, path


def test_verify_passes_on_an_intact_snapshot(snapshot: Any) -> None:
    directory, manifest = snapshot
    report = verify_snapshot(directory, expected_id=manifest["snapshot_id"])
    assert report["shards"] == 2 and report["rows"] == 18
    with pytest.raises(VerifyError, match="expected"):
        verify_snapshot(directory, expected_id="0" * 64)


def _writable(path: Path) -> None:
    os.chmod(path.parent, 0o755)
    if path.exists():
        os.chmod(path, 0o644)


def test_verify_fails_on_a_byte_flip(snapshot: Any) -> None:
    directory, manifest = snapshot
    shard = directory / manifest["shards"][0]["path"]
    _writable(shard)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match="SHA-256"):
        verify_snapshot(directory)


def test_verify_fails_on_a_missing_file(snapshot: Any) -> None:
    directory, manifest = snapshot
    shard = directory / manifest["shards"][1]["path"]
    _writable(shard)
    shard.unlink()
    with pytest.raises(VerifyError, match="missing file"):
        verify_snapshot(directory)


@pytest.mark.parametrize("name", ["split=train/extra.parquet", ".hidden", "split=x/y.txt"])
def test_verify_fails_on_an_extra_file(snapshot: Any, name: str) -> None:
    directory, _ = snapshot
    extra = directory / name
    os.chmod(directory, 0o755)
    extra.parent.mkdir(exist_ok=True)
    _writable(extra)
    extra.write_bytes(b"x")
    with pytest.raises(VerifyError, match="extra file"):
        verify_snapshot(directory)


def test_verify_fails_on_an_edited_manifest(snapshot: Any) -> None:
    directory, manifest = snapshot
    path = directory / MANIFEST_FILE
    _writable(path)
    path.write_text(json.dumps({**manifest, "epoch": 7}), encoding="utf-8")
    with pytest.raises(VerifyError, match="edited or damaged"):
        verify_snapshot(directory)
    with pytest.raises(ManifestError):
        load_manifest(directory)


def test_verify_cli_exits_2_with_a_clear_message(snapshot: Any) -> None:
    directory, manifest = snapshot
    ok = subprocess.run([*CONSUMERS_CLI, "verify", str(directory)],
                        capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0 and manifest["snapshot_id"] in ok.stdout
    shard = directory / manifest["shards"][0]["path"]
    _writable(shard)
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    bad = subprocess.run([*CONSUMERS_CLI, "verify", str(directory)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2
    assert "failed verification" in bad.stderr and "flywheel rebuild" in bad.stderr


def test_a_shard_across_the_boundary_is_refused(tmp_path: Path) -> None:
    write_block(tmp_path, 0, 4, 7)  # the epoch ends at 6
    with pytest.raises(SealError, match="across"):
        check_ranges(tmp_path, BOUNDARY)


def test_non_authoritative_identity_needs_an_override() -> None:
    check_policy({"authoritative": True}, None, "i" * 64)
    with pytest.raises(SealError, match="--override-parity"):
        check_policy({"authoritative": False, "pairs": 10, "mismatched_pairs": 1}, None, "i")
    check_policy({"authoritative": False}, "bf16 study, parity known to fail", "i" * 64)


def test_a_parity_refusal_names_its_mismatches_and_their_margins(
        caplog: pytest.LogCaptureFixture) -> None:
    example = {"window_id": "w1", "anchor_ordinal": 17, "layer_slot": 2, "kind": "rank_order",
               "primary": True, "boundary_margin": 0.31, "label_margin": 2.4e-07,
               "decode_ids": [5, 9, 1], "replay_ids": [9, 5, 1]}
    parity = {"authoritative": False, "pairs": 198, "mismatched_pairs": 4,
              "rank_only_mismatches": 4, "token_id_mismatches": 0,
              "examples": [example, *({**example, "anchor_ordinal": n} for n in (18, 19, 20))]}
    with caplog.at_level("ERROR", logger="hebrus_flywheel.consumers.seal"), \
            pytest.raises(SealError) as refused:
        check_policy(parity, None, "i")
    message = str(refused.value)
    assert "'rank_only_mismatches': 4" in message and "'token_id_mismatches': 0" in message
    assert "first mismatches: [{'window_id': 'w1', 'anchor_ordinal': 17" in message
    assert "'label_margin': 2.4e-07" in message and "'replay_ids': [9, 5, 1]" in message
    assert "and 1 more" in message and "'anchor_ordinal': 20" not in message
    logged = caplog.records[-1].getMessage()
    assert logged.startswith("parity refused for identity i: ") and '"anchor_ordinal": 20' in logged


def test_an_override_is_recorded_in_the_manifest(tmp_path: Path) -> None:
    write_block(tmp_path, 0, 0, 3)
    manifest = build_manifest(
        epoch=0, dataset=DATASET, boundary=BOUNDARY, splits_by_topic={TOPIC: "train"},
        shards=describe_shards(tmp_path, 0), parity={"authoritative": False},
        parity_override="operator accepted", previous_snapshot="p" * 64)
    assert manifest["parity_override"] == {"reason": "operator accepted"}
    assert manifest["previous_snapshot"] == "p" * 64


def test_a_parity_file_must_name_this_identity_and_say_authoritative(tmp_path: Path) -> None:
    def resolve(body: Any) -> dict[str, Any]:
        path = tmp_path / "parity.json"
        path.write_text(json.dumps(body), encoding="utf-8")
        config = SealConfig(dataset=tmp_path, epoch=0, bootstrap="unused:1", parity_file=path)
        return resolve_parity(config, tmp_path, BOUNDARY, DATASET)

    good = {"authoritative": True, "identity_id": "i" * 64, "pairs": 10}
    assert resolve(good) == good
    with pytest.raises(SealError, match="for identity"):
        resolve({**good, "identity_id": "j" * 64})
    with pytest.raises(SealError, match="boolean 'authoritative'"):
        resolve({"identity_id": "i" * 64})
