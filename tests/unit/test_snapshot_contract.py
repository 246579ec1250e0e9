"""The snapshot contract (core.snapshot) against the documented JSON Schema and footer keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from hebrus_flywheel.core.snapshot import (
    MANIFEST_FORMAT,
    ManifestError,
    ShardFormatError,
    load_manifest,
    open_parquet,
    open_snapshot,
    parse_manifest,
    read_shard_metadata,
)
from tests.support.planted import (
    PlantedConfig,
    PlantedSnapshot,
    make_writable,
    write_planted_snapshot,
)

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs"
                     / "snapshot-manifest.schema.json").read_text())
CONFIG = PlantedConfig(threads={"train": 2, "validation": 1}, tokens_per_thread=16, layers=3,
                       experts=16, top_k=4, hidden_dim=8, feature_dim=8)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlantedSnapshot]:
    root = tmp_path_factory.mktemp("contract")
    yield write_planted_snapshot(root, CONFIG)
    make_writable(root)


def test_a_written_manifest_validates_against_the_documented_schema(
        planted: PlantedSnapshot) -> None:
    raw = json.loads((planted.directory / "manifest.json").read_text())
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(raw, SCHEMA)
    assert SCHEMA["properties"]["format"]["const"] == MANIFEST_FORMAT == raw["format"]
    broken = {**raw, "shards": [{**raw["shards"][0], "sha256": "nothex"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)


def test_the_manifest_type_exposes_the_layout_and_refuses_edits(planted: PlantedSnapshot) -> None:
    manifest = load_manifest(planted.directory)
    assert manifest.layout is not None and manifest.layout.route.top_k == 4
    assert manifest.layout.projection_id == planted.projection.digest
    assert [s.path for s in manifest.shards] == [s["path"] for s in manifest["shards"]]
    edited = {**manifest.to_dict(), "epoch": 7}
    with pytest.raises(ManifestError, match="hashes to"):
        parse_manifest(edited)
    with pytest.raises(ManifestError, match=r"not a hebrus-flywheel-snapshot/v3"):
        parse_manifest({**manifest.to_dict(), "format": "hebrus-flywheel-snapshot/v1"})


def test_shards_describe_themselves_and_flat_keys_must_agree(planted: PlantedSnapshot) -> None:
    sealed = open_snapshot(planted.directory, expected_id=planted.snapshot_id)
    path = sealed.directory / sealed.manifest.shards[0].path
    meta = dict(open_parquet(path).metadata.metadata)
    record = read_shard_metadata(meta)
    assert record["route"]["routed_layers"] == [0, 1, 2] and record["contract_version"] == 3
    assert json.loads(meta[b"flywheel.feature_projection"]) == {
        "id": planted.projection.digest, "seed": 0}
    meta[b"flywheel.top_k"] = b"5"
    with pytest.raises(ShardFormatError, match=r"flywheel\.top_k"):
        read_shard_metadata(meta)
    assert sealed.read_shard(0, ["expert_ids"]).num_rows == sealed.manifest.shards[0].rows
