"""Secrets and tool outputs (issue 13), against the real broker and the tiny teacher.

Windows whose decoded text holds a planted secret (an AWS key, a private key block, an
e-mail address) or that overlap a turn of an excluded role are dropped before replay:
counted by reason, never replayed, never in a shard, never in the quarantine, and their
offsets are committed like any other (no loss, no redelivery). The sealed manifest
records the policy, and a rebuild drops the same windows and matches byte for byte.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import jsonschema
import pytest

from hebrus_flywheel.consumers.content_policy import ContentPolicyConfig
from hebrus_flywheel.consumers.kafka_io import committed_offsets, end_offsets
from hebrus_flywheel.consumers.rebuild import RebuildConfig, rebuild_snapshot
from hebrus_flywheel.consumers.seal import SealConfig, SealResult, seal_epoch
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core.progress import health_path
from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.streams.processors.window import content_digest
from hebrus_flywheel.streams.topics import QUARANTINE_TOPIC, catalogue, window_topic
from tests.support.plaintext import plaintext_copy
from tests.support.windows import (
    corpus_token_ids,
    make_window,
    publish_windows,
    thread_windows,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ANCHORS = 6
SECRETS = {
    "aws": ("secret:AWSKeyDetector", "Use the key AKIAIOSFODNN7EXAMPLE for the deploy step."),
    "pem": ("secret:PrivateKeyDetector", "-----BEGIN RSA PRIVATE KEY-----\n"
            "MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM2f\n-----END RSA PRIVATE KEY-----\nthanks"),
    "mail": ("pattern:email", "Please forward the report to jane.doe@example.org today."),
}


def _secret_window(tok: Any, owner: str, text: str, identity_id: str) -> dict[str, Any]:
    ids = list(tok.tokenizer.encode("Here is what I found. " + text + " Done.").ids)
    assert len(ids) > ANCHORS
    return make_window(token_ids=ids, anchors=list(range(len(ids) - ANCHORS, len(ids))),
                       identity_id=identity_id, owner=owner, thread="t")


def _tool_window(tokens: list[int], identity_id: str) -> dict[str, Any]:
    (window,) = thread_windows(tokens, identity_id=identity_id, owner="tool", thread="t",
                               count=1, start=400)
    window["turns"] = [
        {"turn_index": i, "role": role, "token_offset": 400 + 16 * i, "length": 16,
         "sequence_id": f"s{i}", "sampling_mode": "greedy", "generated": []}
        for i, role in enumerate(("user", "tool", "assistant"))]
    window["content_digest"] = content_digest(window)
    return window


def _shard_rows(root: Path, plain: Path) -> list[tuple[Any, ...]]:
    plaintext_copy(root, plain)  # shards are encrypted at rest: DuckDB reads a decrypted copy
    return duckdb.sql(
        f"SELECT window_id, owner FROM read_parquet('{plain}/epoch=*/split=*/*.parquet',"
        " hive_partitioning=true)").fetchall()


@dataclass
class Scenario:
    bootstrap: str
    teacher_dir: Path
    teacher: Any
    root: Path
    valid: list[dict[str, Any]]
    dropped: list[dict[str, Any]]
    worker: ReplayWorker
    sealed: SealResult


def _publish(bootstrap: str, prefix: str, teacher_dir: Path,
             identity_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from hebrus_flywheel.replay.tokenizer import load_tokenizer

    tok = load_tokenizer(teacher_dir)
    tokens = corpus_token_ids(teacher_dir)
    valid = [w for i in range(4) for w in thread_windows(
        tokens, identity_id=identity_id, owner=f"ok{i}", thread="t", count=1, start=80 * i)]
    dropped = [_secret_window(tok, o, text, identity_id) for o, (_, text) in SECRETS.items()]
    dropped.append(_tool_window(tokens, identity_id))
    # 8 messages on train[0]: two blocks of 4, the dropped ones between valid windows
    order = [valid[0], dropped[0], valid[1], dropped[1], dropped[2], valid[2], dropped[3],
             valid[3]]
    publish_windows(bootstrap, prefix, order, partition=0)
    return valid, dropped


@pytest.fixture(scope="module")
def scenario(topic_factory: Any, teacher_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    """A worker with ``excluded_roles=("tool",)`` runs while epoch 0 is sealed."""
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher

    teacher = load_teacher(teacher_dir)
    identity_id = str(build_runtime_identity(teacher)["identity_id"])
    bootstrap = topic_factory.bootstrap
    prefix = f"{topic_factory.prefix}policy."
    topic_factory.create(catalogue(prefix))
    valid, dropped = _publish(bootstrap, prefix, teacher_dir, identity_id)
    root = tmp_path_factory.mktemp("policy") / "dataset"
    worker = ReplayWorker(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=root, bootstrap=bootstrap, prefix=prefix,
        shard=ShardConfig(offsets_per_shard=4, row_group_rows=4), batch_windows=2,
        torch_threads=1, control_sync_s=0.3,
        content_policy=ContentPolicyConfig(excluded_roles=("tool",))), teacher=teacher)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        sealed = seal_epoch(SealConfig(
            dataset=root, epoch=0, bootstrap=bootstrap, timeout_s=120,
            override_parity="no runtime_holdout windows in this test"))
    finally:
        worker.stop()
        thread.join(timeout=120)
    assert not thread.is_alive(), "worker did not stop"
    yield Scenario(bootstrap=bootstrap, teacher_dir=teacher_dir, teacher=teacher, root=root,
                   valid=valid, dropped=dropped, worker=worker, sealed=sealed)
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)


def _expected() -> dict[str, int]:
    out = {f"policy_dropped/{reason}": 1 for reason, _ in SECRETS.values()}
    out["policy_dropped/tool_output"] = 1
    return out


def test_windows_with_secrets_or_tool_outputs_are_dropped_before_replay(
    scenario: Scenario, tmp_path: Path,
) -> None:
    worker = scenario.worker
    counts = worker.stats.report()["counts"]
    by_reason = {k: v for k, v in counts.items() if k.startswith("policy_dropped/")}
    seconds = worker.stats.report()["seconds"]
    print(f"dropped by the content policy: {by_reason}; seconds: policy "
          f"{seconds.get('policy')} intake {seconds.get('intake')} replay {seconds.get('replay')}")
    assert by_reason == _expected(), counts

    rows = _shard_rows(scenario.root, tmp_path / "plain")
    assert {r[0] for r in rows} == {w["window_id"] for w in scenario.valid}
    assert len(rows) == len(scenario.valid) * ANCHORS
    assert not {r[1] for r in rows} & {w["owner"] for w in scenario.dropped}
    prefix, bootstrap = worker.config.prefix, scenario.bootstrap
    quarantine = prefix + QUARANTINE_TOPIC
    assert sum(end_offsets(bootstrap, [quarantine])[quarantine].values()) == 0
    train = prefix + window_topic("train")
    assert committed_offsets(bootstrap, worker.config.full_group_id, [(train, 0)]) == \
        {(train, 0): 8}
    health = worker.monitor.write_health  # the file a clean stop removed: write one to read
    health()
    path = health_path(flywheel_home(), "replay", worker.config.full_group_id)
    try:
        record = json.loads(path.read_text())
    finally:
        path.unlink()
    assert record["policy_dropped"] == {k.split("/", 1)[1]: v for k, v in _expected().items()}


def test_the_sealed_manifest_records_the_policy_and_a_rebuild_drops_the_same_windows(
    scenario: Scenario, tmp_path: Path,
) -> None:
    manifest = scenario.sealed.manifest
    assert manifest["determinism"]["content_policy"]["excluded_roles"] == ["tool"]
    schema = Path(__file__).resolve().parents[2] / "docs" / "snapshot-manifest.schema.json"
    jsonschema.validate(manifest, json.loads(schema.read_text()))
    assert manifest["totals"]["windows"] == len(scenario.valid), manifest["totals"]
    report = rebuild_snapshot(RebuildConfig(
        snapshot=scenario.sealed.manifest_path.parent, out=tmp_path / "rebuilt",
        teacher=scenario.teacher_dir, bootstrap=scenario.bootstrap), teacher=scenario.teacher)
    print(f"rebuild: identical={report['identical']} stats={report['stats']['counts']}")
    assert report["identical"] and report["content_id_match"], report["differences"]
    dropped = {k: v for k, v in report["stats"]["counts"].items()
               if k.startswith("policy_dropped/")}
    assert dropped == _expected()
