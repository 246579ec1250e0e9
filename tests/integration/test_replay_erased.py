"""The replay worker reads sealed windows (Window.v2) with the owner key store, and a
window whose owner was erased (key destroyed) is quarantined as ``owner_erased``,
metadata only, while the other owners' windows are written (issue 13)."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import duckdb
import pytest

from hebrus_flywheel.consumers.kafka_io import end_offsets, read_ranges
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer
from hebrus_flywheel.core.progress import WatchdogConfig
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.owner_seal import OwnerSealer
from hebrus_flywheel.streams.processors.window_seal import encode_window
from hebrus_flywheel.streams.topics import QUARANTINE_TOPIC, catalogue, window_topic
from tests.support.consent import grant_owners
from tests.support.plaintext import plaintext_copy
from tests.support.windows import corpus_token_ids, thread_windows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ANCHORS = 6  # per window of thread_windows


def _publish_sealed(bootstrap: str, prefix: str, values: list[tuple[bytes, dict[str, Any]]]
                    ) -> None:
    headers = codec.kafka_headers(codec.default_registry().get("Window.v2"))
    producer = kafka.make_producer(kafka.client_config(bootstrap),
                                   settings={"acks": "all", "enable.idempotence": True})
    for value, record in values:
        producer.produce(prefix + window_topic(record["split"]), partition=0, value=value,
                         key=f"{record['owner']}/{record['thread']}".encode(),
                         headers=[*headers, ("window_id", record["window_id"].encode())])
    assert producer.flush(30) == 0


def _quarantined(bootstrap: str, prefix: str) -> list[dict[str, Any]]:
    topic = prefix + QUARANTINE_TOPIC
    ends = end_offsets(bootstrap, [topic])[topic]
    return [codec.decode_message(m.value(), m.headers())[1] for m in read_ranges(
        bootstrap, {(topic, p): (0, e) for p, e in ends.items()})]


def _window_ids(root: Path) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:  # DuckDB cannot use our keys: read a copy
        plain = plaintext_copy(root, Path(tmp))
        return [r[0] for r in duckdb.sql(
            f"SELECT window_id FROM read_parquet('{plain}/epoch=*/split=*/*.parquet', "
            "hive_partitioning=true)").fetchall()]


def test_sealed_windows_replay_and_an_erased_owners_are_quarantined_metadata_only(
    topic_factory: Any, teacher_dir: Path, tmp_path: Path, monkeypatch: Any,
) -> None:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher

    keys_dir = tmp_path / "owner-keys"
    monkeypatch.setenv("FLYWHEEL_OWNER_KEYS", str(keys_dir))
    writer = LocalOwnerKeyStore(keys_dir, create=True, max_age_s=0)
    pz = Pseudonymizer(writer)
    alice, bob = pz.owner("alice"), pz.owner("bob")
    for owner in (alice, bob):
        writer.data_key(owner, create=True)
    teacher = load_teacher(teacher_dir)
    identity_id = str(build_runtime_identity(teacher)["identity_id"])
    tokens = corpus_token_ids(teacher_dir)
    sealer = OwnerSealer(lambda: LocalOwnerKeyStore(keys_dir))
    sealed = {owner: [encode_window(w, sealer) for w in thread_windows(
        tokens, identity_id=identity_id, owner=owner, thread=pz.thread(raw, "t"), count=2,
        start=100 * i)] for i, (raw, owner) in enumerate((("alice", alice), ("bob", bob)))}
    bootstrap = topic_factory.bootstrap
    prefix = f"{topic_factory.prefix}erased."
    topic_factory.create(catalogue(prefix))
    grant_owners(bootstrap, [alice, bob], prefix=prefix)  # only the erasure refuses here
    # train[0]: bob, alice, alice, bob (one block of 4)
    _publish_sealed(bootstrap, prefix, [sealed[bob][0], *sealed[alice], sealed[bob][1]])
    writer.destroy(alice)

    root = tmp_path / "dataset"
    worker = ReplayWorker(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=root, bootstrap=bootstrap, prefix=prefix,
        shard=ShardConfig(offsets_per_shard=4, row_group_rows=4), batch_windows=2,
        torch_threads=1, watchdog=WatchdogConfig(drain=True)), teacher=teacher)
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "worker did not stop"

    records = _quarantined(bootstrap, prefix)
    print("replay quarantine:", [(r["reason"], r["source_offset"], r["reference_only"])
                                 for r in records])
    assert sorted((r["reason"], r["source_offset"]) for r in records) == [
        ("owner_erased", 1), ("owner_erased", 2)]
    for r in records:  # metadata only: nothing of the erased owner's record is copied
        assert r["reference_only"] and r["value"] == b"" and r["owner"] is None
        assert r["source_key"] is None and r["source_headers"] == []
    ids = _window_ids(root)
    assert sorted(set(ids)) == sorted(rec["window_id"] for _, rec in sealed[bob])
    assert len(ids) == 2 * ANCHORS
    assert worker.stats.report()["counts"]["quarantine/owner_erased"] == 2
