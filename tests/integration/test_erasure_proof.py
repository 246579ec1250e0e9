"""Proof by scan over the whole pipeline (issue 13).

A real capture of synthetic threads (the runtime publisher pseudonymizes and seals),
the stream worker, the replay worker, the seal with its parity gate, verify and one
training step run on a private namespace (``flywheel selftest``). Then one owner is
erased with ``flywheel erase --owner RAW``, and every byte of the run (dataset,
checkpoint, logs, the erasure's home) and of the broker's log directories of every
topic of the run (capture, windows, quarantine, internal, changelog, consent) is
scanned for a canary: eight consecutive token ids that only that owner's threads
contain, in every plaintext form (int32/int64 little-endian, Avro zigzag, decimal
text). 0 hits, 0 rows of the owner's pseudonym in the live snapshot, and the
superseding snapshot verifies; the owner did have rows before, and the scanner finds the
canary in a plaintext file, so neither check is vacuous.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.consumers.supersede import snapshot_owner_rows
from hebrus_flywheel.core.canary import CanaryScanner
from hebrus_flywheel.core.snapshot import default_kek_path, verify_snapshot
from hebrus_flywheel.replay.capture import load_threads
from hebrus_flywheel.replay.render import render_thread
from hebrus_flywheel.replay.teacher import init_teacher
from hebrus_flywheel.replay.tokenizer import load_tokenizer
from hebrus_flywheel.selftest import SelftestConfig, private_namespace, run_selftest
from hebrus_flywheel.streams.broker import BrokerConfig
from tests.support.planted import make_writable
from tests.support.sealing import owner_pseudonym

pytestmark = [pytest.mark.integration, pytest.mark.slow]

THREADS, SEED, CANARY_TOKENS = 6, 0, 8


def unique_canary(teacher: Path) -> tuple[str, list[int]]:
    """(raw owner, canary): the owner with the most synthetic threads and the first run
    of ``CANARY_TOKENS`` token ids that no other owner's thread contains."""
    tokenizer = load_tokenizer(teacher)
    threads = list(load_threads(None, THREADS, seed=SEED))
    owner = Counter(t.owner for t in threads).most_common(1)[0][0]
    others = [render_thread(t, tokenizer).token_ids for t in threads if t.owner != owner]
    other_grams = {seq[i:i + CANARY_TOKENS] for seq in others
                   for i in range(len(seq) - CANARY_TOKENS + 1)}
    for thread in (t for t in threads if t.owner == owner):
        tokens = render_thread(thread, tokenizer).token_ids
        for i in range(len(tokens) - CANARY_TOKENS + 1):
            gram = tokens[i:i + CANARY_TOKENS]
            if gram not in other_grams and len(set(gram)) > 2:
                return owner, list(gram)
    raise AssertionError(f"owner {owner} has no token run of its own")


def test_erased_owner_leaves_no_plaintext_and_no_live_rows(kafka_bootstrap: str,
                                                           tmp_path: Path) -> None:
    teacher = tmp_path / "teacher"
    init_teacher(teacher, family="qwen3_moe", seed=2)
    namespace = private_namespace("it-erasure-")
    run_dir = tmp_path / "run"
    lines: list[dict[str, Any]] = []
    verdict = run_selftest(SelftestConfig(
        teacher=teacher, bootstrap=kafka_bootstrap, work_dir=run_dir, namespace=namespace,
        threads=THREADS, seed=SEED, keep_topics=True), emit=lines.append)
    assert verdict["selftest"] == "passed", verdict
    raw_owner, canary = unique_canary(teacher)
    owner = owner_pseudonym(raw_owner)
    epoch = run_dir / "dataset" / "epoch=0"
    before, total = snapshot_owner_rows(epoch, owner)
    assert before > 0, f"owner {owner} has no rows in the sealed snapshot"

    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path / "erase-home"),
           "FLYWHEEL_KEK_FILE": str(default_kek_path())}  # the key the run sealed with
    done = subprocess.run(
        [sys.executable, "-m", "hebrus_flywheel.cli", "erase", "--owner", raw_owner,
         "--dataset", str(run_dir / "dataset"), "--checkpoints", str(run_dir / "checkpoint"),
         "--grace", "0", "--bootstrap-servers", kafka_bootstrap, "--changelog-prefix",
         namespace, "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    receipt = json.loads(done.stdout)
    try:
        assert receipt["owner"] == owner and raw_owner not in done.stdout
        assert receipt["owner_rows_after"] == 0
        assert snapshot_owner_rows(epoch, owner) == (0, total - before)
        verify_snapshot(epoch, keys=True)  # the superseding snapshot, now live, verifies

        scanner = CanaryScanner(canary)
        plain = tmp_path / "plaintext-canary.bin"
        plain.write_bytes(b"".join(t.to_bytes(4, "little") for t in canary))
        assert scanner.scan([plain]).hits, "the scanner must see a plaintext canary"
        topic_dirs = sorted(BrokerConfig().data_dir.glob(f"{namespace}*"))
        assert len(topic_dirs) > 10, topic_dirs  # capture, windows, internal, changelogs
        result = scanner.scan([run_dir, tmp_path / "erase-home", *topic_dirs])
        print(f"erased {before} rows of {owner}; scanned {result.files} files "
              f"({len(topic_dirs)} broker topic directories): {len(result.hits)} canary hits")
        assert result.files > 0 and result.unreadable == []
        assert result.hits == [], result.to_json()
    finally:
        make_writable(run_dir / "dataset")
