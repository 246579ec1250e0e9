"""Secrets and tool outputs (issue 13), against the real broker and the tiny teacher.

Windows whose decoded text holds a planted secret (an AWS key, a private key block, an
e-mail address) or that overlap a turn of an excluded role are dropped before replay:
counted by reason, never replayed, never in a shard, never in the quarantine, and their
offsets are committed like any other (no loss, no redelivery).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import duckdb
import pytest

from hebrus_flywheel.consumers.content_policy import ContentPolicyConfig
from hebrus_flywheel.consumers.kafka_io import committed_offsets, end_offsets
from hebrus_flywheel.consumers.shards import ShardConfig
from hebrus_flywheel.consumers.worker import ReplayWorker, ReplayWorkerConfig
from hebrus_flywheel.core.progress import WatchdogConfig, health_path
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


def test_windows_with_secrets_or_tool_outputs_are_dropped_before_replay(
    topic_factory: Any, teacher_dir: Path, tmp_path: Path,
) -> None:
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher
    from hebrus_flywheel.replay.tokenizer import load_tokenizer

    teacher = load_teacher(teacher_dir)
    identity_id = str(build_runtime_identity(teacher)["identity_id"])
    tok = load_tokenizer(teacher_dir)
    tokens = corpus_token_ids(teacher_dir)
    bootstrap = topic_factory.bootstrap
    prefix = f"{topic_factory.prefix}policy."
    topic_factory.create(catalogue(prefix))
    valid = [w for i in range(4) for w in thread_windows(
        tokens, identity_id=identity_id, owner=f"ok{i}", thread="t", count=1, start=80 * i)]
    dropped = [_secret_window(tok, o, text, identity_id) for o, (_, text) in SECRETS.items()]
    dropped.append(_tool_window(tokens, identity_id))
    # 8 messages on train[0]: two blocks of 4, the dropped ones between valid windows
    order = [valid[0], dropped[0], valid[1], dropped[1], dropped[2], valid[2], dropped[3],
             valid[3]]
    publish_windows(bootstrap, prefix, order, partition=0)

    root = tmp_path / "dataset"
    worker = ReplayWorker(ReplayWorkerConfig(
        teacher=teacher_dir, dataset=root, bootstrap=bootstrap, prefix=prefix,
        shard=ShardConfig(offsets_per_shard=4, row_group_rows=4), batch_windows=2,
        torch_threads=1, watchdog=WatchdogConfig(drain=True),
        content_policy=ContentPolicyConfig(excluded_roles=("tool",))), teacher=teacher)
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "worker did not stop"

    counts = worker.stats.report()["counts"]
    by_reason = {k: v for k, v in counts.items() if k.startswith("policy_dropped/")}
    print(f"dropped by the content policy: {by_reason}")
    expected = {f"policy_dropped/{reason}": 1 for reason, _ in SECRETS.values()}
    expected["policy_dropped/tool_output"] = 1
    assert by_reason == expected, counts

    rows = _shard_rows(root, tmp_path / "plain")
    assert {r[0] for r in rows} == {w["window_id"] for w in valid}
    assert len(rows) == len(valid) * ANCHORS
    assert not {r[1] for r in rows} & {w["owner"] for w in dropped}
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
    assert record["policy_dropped"] == {k.split("/", 1)[1]: v for k, v in expected.items()}
    dataset = json.loads((root / "dataset.json").read_text())
    assert dataset["determinism"]["content_policy"]["excluded_roles"] == ["tool"]
