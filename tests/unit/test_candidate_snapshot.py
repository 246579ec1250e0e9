"""The candidate-path snapshot product: schema, lineage rows, sealing, byte-identical
rebuild, DuckDB read-back, and readers that refuse the other product."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import jsonschema
import numpy as np
import pyarrow as pa
import pytest

from hebrus_flywheel.consumers.candidates import (
    CandidateBlock,
    candidate_layout,
    pack_candidate_rows,
    seal_candidate_epoch,
    write_candidate_shard,
)
from hebrus_flywheel.consumers.dataset import writer_versions
from hebrus_flywheel.consumers.epochs import EpochBoundary, freeze_offsets
from hebrus_flywheel.consumers.labels import SourceRef
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.core.snapshot import (
    PRODUCT_CANDIDATE,
    PRODUCT_CLEAN,
    ProductError,
    ShardFormatError,
    candidate_shard_schema,
    load_manifest,
    open_snapshot,
    read_shard_metadata,
    shard_schema,
    verify_snapshot,
)
from hebrus_flywheel.core.snapshot.crypto import open_parquet
from hebrus_flywheel.replay.candidates.drafters import DraftConfig, PromptLookupDrafter
from hebrus_flywheel.replay.candidates.replay import (
    AnchorCandidates,
    CandidateConfig,
    CandidateReplayer,
)
from hebrus_flywheel.replay.candidates.self_draft import TeacherSelfDrafter
from hebrus_flywheel.replay.teacher import load_teacher
from tests.support.plaintext import plaintext_copy, plaintext_digests
from tests.support.planted import PlantedConfig, make_writable, write_planted_snapshot
from tests.unit.test_candidate_replay import window

TOPIC = "flywheel.windows.train.v1"
COLUMNS = [
    "source_topic", "source_partition", "source_offset", "window_id", "split", "owner",
    "thread", "generation", "identity_id", "domain_tags", "proposal_id", "anchor_ordinal",
    "drafter_id", "path_id", "candidate_position", "candidate_token_id", "drafter_logprob",
    "expert_ids", "weights_f16", "features", "accepted_prefix_length",
    "accepted_prefix_digest", "accepted"]


@pytest.fixture(scope="module")
def labelled(teacher_dir: Path) -> dict[str, Any]:
    teacher = load_teacher(teacher_dir)
    config = CandidateConfig(draft=DraftConfig(width=2, depth=3))
    items: list[tuple[AnchorCandidates, SourceRef]] = []
    replayers = [CandidateReplayer(teacher, d, config)
                 for d in (TeacherSelfDrafter(teacher), PromptLookupDrafter(ngram=3))]
    windows = [window(replayers[0].identity_id, anchors=(50, 70)),
               window(replayers[0].identity_id, anchors=(60,), first=7)]
    for replayer in replayers:
        for offset, anchors in enumerate(replayer.replay(windows)):
            items += [(a, SourceRef(topic=TOPIC, partition=0, offset=offset)) for a in anchors]
    layout = candidate_layout(teacher.geometry, feature_dim=64,
                              projection=replayers[0].projection.contract("float16"))
    return {"items": items, "layout": layout, "identity": replayers[0].identity,
            "contract": replayers[0].candidate_contract()}


def write_epoch(root: Path, labelled: dict[str, Any]) -> dict[str, Any]:
    items, layout = labelled["items"], labelled["layout"]
    block = CandidateBlock(epoch=0, split="train", topic=TOPIC, partition=0, first_offset=0,
                           last_offset=1, windows=2)
    write_candidate_shard(root, block, items[::-1], layout,
                          identity_id=labelled["identity"]["identity_id"],
                          config_digest="0" * 64, shard=ShardConfig(row_group_rows=16))
    determinism = {"shard": {"row_group_rows": 16}, "batch_windows": 1, "torch_threads": 1,
                   "replay_config": labelled["contract"],
                   "geometry": {"layers": layout.layers, "top_k": layout.top_k}}
    dataset = {"identity": labelled["identity"], "determinism": json.loads(json.dumps(
        determinism)), "writer": writer_versions(),
        "source": {"prefix": "", "group_id": "candidates"}}
    boundary = EpochBoundary(epoch=0, start=freeze_offsets({TOPIC: {0: 0}}),
                             end=freeze_offsets({TOPIC: {0: 2}}))
    return seal_candidate_epoch(root, epoch=0, dataset=dataset, boundary=boundary,
                                splits_by_topic={TOPIC: "train"},
                                parity={"authoritative": True, "product": PRODUCT_CANDIDATE})


@pytest.fixture(scope="module")
def sealed(labelled: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("candidates")
    write_epoch(root, labelled)
    yield root
    make_writable(root)


def test_schema_has_exactly_the_contract_columns(labelled: dict[str, Any]) -> None:
    layout = labelled["layout"]
    schema = candidate_shard_schema(layout)
    assert schema.names == COLUMNS
    assert schema.field("expert_ids").type.value_type.value_type == pa.uint16()
    assert schema.field("weights_f16").type.value_type.value_type == pa.float16()
    assert schema.field("path_id").type == pa.int32()
    assert schema.field("anchor_ordinal").type == pa.int64()
    clean = shard_schema(candidate_layout(layout.route, feature_dim=64))
    assert clean.names[:12] == [*COLUMNS[:10], "token_ordinal", "token_id"]  # clean unchanged


def test_rows_keep_rejected_suffixes_and_their_lineage(labelled: dict[str, Any]) -> None:
    table = pack_candidate_rows(labelled["items"], labelled["layout"])
    rows = table.to_pylist()
    assert len(rows) == sum(len(a.path_id_R) for a, _ in labelled["items"])
    assert {r["drafter_id"] for r in rows} == {"teacher_self", "prompt_lookup/n3"}
    assert any(not r["accepted"] for r in rows) and any(r["accepted"] for r in rows)
    for r in rows:
        assert r["accepted"] == (r["candidate_position"] <= r["accepted_prefix_length"])
        assert 1 <= r["candidate_position"] <= 3 and 0 <= r["path_id"] < 2
        assert r["owner"] == "owner-a" and r["source_topic"] == TOPIC
    keys = [(r["source_offset"], r["anchor_ordinal"], r["drafter_id"], r["path_id"],
             r["candidate_position"]) for r in rows]
    assert keys == sorted(keys)
    anchor = labelled["items"][0][0]
    mine = [r for r in rows if r["proposal_id"] == anchor.proposal_id]
    np.testing.assert_array_equal(np.array([r["expert_ids"] for r in mine], np.uint16),
                                  anchor.expert_ids_RLK)


def test_sealed_epoch_verifies_and_names_its_product(sealed: Path) -> None:
    manifest = load_manifest(sealed / "epoch=0")
    assert manifest.product == PRODUCT_CANDIDATE
    assert manifest["product"] == "candidate_path"
    schema = Path(__file__).resolve().parents[2] / "docs" / "snapshot-manifest.schema.json"
    jsonschema.validate(manifest.to_dict(), json.loads(schema.read_text()))
    assert verify_snapshot(sealed / "epoch=0", keys=True)["plaintext_checked"] is True
    snapshot = open_snapshot(sealed / "epoch=0", products=(PRODUCT_CANDIDATE,))
    table = snapshot.read_shard(0, ["proposal_id", "accepted"])
    assert table.num_rows == manifest["totals"]["rows"]
    meta = open_parquet(sealed / "epoch=0" / manifest.shards[0].path,
                        snapshot.crypto()).metadata.metadata
    assert read_shard_metadata(meta)["product"] == PRODUCT_CANDIDATE


def test_rebuild_is_byte_identical(sealed: Path, labelled: dict[str, Any],
                                   tmp_path: Path) -> None:
    again = write_epoch(tmp_path / "again", labelled)
    try:
        assert plaintext_digests(tmp_path / "again") == plaintext_digests(sealed)
        assert again["content_id"] == load_manifest(sealed / "epoch=0").content_id
    finally:
        make_writable(tmp_path / "again")


def test_readers_refuse_the_other_product_unless_asked_for_both(
        sealed: Path, tmp_path: Path) -> None:
    with pytest.raises(ProductError, match="candidate_path snapshot"):
        open_snapshot(sealed / "epoch=0")  # a clean-path reader by default
    both = open_snapshot(sealed / "epoch=0", products=(PRODUCT_CLEAN, PRODUCT_CANDIDATE))
    assert both.manifest.product == PRODUCT_CANDIDATE
    planted = write_planted_snapshot(tmp_path / "clean", PlantedConfig(
        threads={"train": 1}, tokens_per_thread=8, anchors_per_window=8))
    try:
        assert open_snapshot(planted.directory).manifest.product == PRODUCT_CLEAN  # no field
        assert "product" not in planted.manifest
        with pytest.raises(ProductError, match="clean_path snapshot"):
            open_snapshot(planted.directory, products=(PRODUCT_CANDIDATE,))
        assert open_snapshot(planted.directory, products=(PRODUCT_CLEAN, PRODUCT_CANDIDATE))
        with pytest.raises(ProductError, match="subset"):
            open_snapshot(planted.directory, products=("both",))
    finally:
        make_writable(tmp_path / "clean")


def test_footer_naming_an_unknown_product_is_refused(labelled: dict[str, Any]) -> None:
    from hebrus_flywheel.core.snapshot import shard_metadata

    meta = shard_metadata(labelled["layout"], {"product": "mixed", "identity_id": "x"})
    with pytest.raises(ShardFormatError, match="unknown replay product"):
        read_shard_metadata(meta)


def test_duckdb_reads_a_candidate_shard_back(sealed: Path, tmp_path: Path) -> None:
    plain = plaintext_copy(sealed, tmp_path / "plain")
    got = duckdb.sql(
        f"SELECT count(*), count(DISTINCT proposal_id), max(candidate_position), "
        f"sum(CASE WHEN accepted THEN 1 ELSE 0 END), max(len(expert_ids)), "
        f"max(len(weights_f16[1])), min(len(accepted_prefix_digest)) "
        f"FROM read_parquet('{plain}/epoch=*/split=*/*.parquet', hive_partitioning=true) "
        f"WHERE split = 'train' AND drafter_id = 'teacher_self'"
    ).fetchall()[0]
    manifest = load_manifest(sealed / "epoch=0")
    table = open_snapshot(sealed / "epoch=0", products=(PRODUCT_CANDIDATE,)).read_shard(
        0, ["drafter_id", "accepted", "proposal_id"]).to_pylist()
    mine = [r for r in table if r["drafter_id"] == "teacher_self"]
    assert got == (len(mine), len({r["proposal_id"] for r in mine}), 3,
                   sum(r["accepted"] for r in mine),
                   manifest.layout.layers, manifest.layout.top_k, 64)
