"""Measured replay throughput: each closed block records the teacher's prefill tokens and
seconds beside its shard, the seal sums them into the manifest (outside ``content_id``)
and the documented schema accepts the result."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from hebrus_flywheel.consumers.blocks import BlockSettings, close_block
from hebrus_flywheel.consumers.epochs import Block
from hebrus_flywheel.consumers.intake import Accepted
from hebrus_flywheel.consumers.labels import SourceRef
from hebrus_flywheel.consumers.manifest import build_manifest, describe_shards
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.throughput import THROUGHPUT_DIR, record_path, summarize
from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.snapshot import content_digest
from tests.support.windows import synthetic_labels, synthetic_layout
from tests.unit.test_manifest import BOUNDARY, DATASET, TOPIC

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs"
                     / "snapshot-manifest.schema.json").read_text())
LAYOUT = synthetic_layout(layers=4, top_k=10, feature_dim=16, hidden_dim=64)


class CountingEngine:
    """A replay engine returning synthetic labels: 3 anchors per window."""

    def __init__(self) -> None:
        self.seen_tokens = 0

    def replay(self, windows: Sequence[Any]) -> list[Any]:
        self.seen_tokens += sum(len(w["token_ids"]) for w in windows)
        return [synthetic_labels(w["window_id"], 3, seed=i, first=i * 3)
                for i, w in enumerate(windows)]


def close(root: Path, first: int, last: int, engine: CountingEngine) -> None:
    items = [Accepted(source=SourceRef(topic=TOPIC, partition=0, offset=o),
                      window={"window_id": f"w{o}", "token_ids": list(range(5 + o))})
             for o in range(first, last + 1)]
    settings = BlockSettings(root=root, shard=ShardConfig(), batch_windows=2,
                             route=LAYOUT.route, identity_id="i" * 64, config_digest="d" * 64)
    block = Block(topic=TOPIC, partition=0, epoch=0, first=first, end=last + 1, final=True)
    close_block(engine, settings, block, "train", items, Counters())


def test_blocks_record_tokens_and_the_seal_sums_them_outside_the_content_id(
        tmp_path: Path) -> None:
    engine = CountingEngine()
    close(tmp_path, 0, 3, engine)
    close(tmp_path, 4, 5, engine)
    shards = describe_shards(tmp_path, 0)
    records = [json.loads(record_path(tmp_path, 0, s["path"]).read_text()) for s in shards]
    assert sum(r["tokens"] for r in records) == engine.seen_tokens == sum(5 + o for o in range(6))
    assert [r["batches"] for r in records] == [2, 1] and all(r["seconds"] > 0 for r in records)
    assert oct(os.stat(record_path(tmp_path, 0, shards[0]["path"])).st_mode & 0o777) == "0o640"
    assert not (tmp_path / "epoch=0" / THROUGHPUT_DIR).exists()  # never inside the snapshot

    measured = summarize(tmp_path, 0, shards)
    assert measured is not None
    assert (measured["tokens"], measured["windows"], measured["rows"]) == (45, 6, 18)
    assert measured["shards_measured"] == measured["shards"] == 2
    # both figures are rounded from the unrounded seconds
    assert measured["tokens_per_s"] == pytest.approx(45 / measured["seconds"], rel=1e-3)
    kwargs: dict[str, Any] = {"epoch": 0, "dataset": DATASET, "boundary": BOUNDARY,
                              "splits_by_topic": {TOPIC: "train"}, "shards": shards,
                              "parity": {"authoritative": True}, "parity_override": None,
                              "previous_snapshot": None}
    with_speed = build_manifest(**kwargs, replay_throughput=measured)
    without = build_manifest(**kwargs)
    assert with_speed["replay_throughput"] == measured and "replay_throughput" not in without
    assert with_speed["content_id"] == without["content_id"] == content_digest(with_speed)
    assert with_speed["snapshot_id"] != without["snapshot_id"]
    jsonschema.validate(with_speed["replay_throughput"],
                        {**SCHEMA["properties"]["replay_throughput"], "$defs": SCHEMA["$defs"]})


def test_shards_without_a_matching_record_are_left_out(tmp_path: Path) -> None:
    engine = CountingEngine()
    close(tmp_path, 0, 3, engine)
    shards = describe_shards(tmp_path, 0)
    assert summarize(tmp_path, 0, [{**shards[0], "rows": 999}]) is None  # another write
    record_path(tmp_path, 0, shards[0]["path"]).write_text("{not json")
    assert summarize(tmp_path, 0, shards) is None
