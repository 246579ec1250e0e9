"""Proof by scan over the whole pipeline (issue 13).

The run gets a home of its own: its own ``FLYWHEEL_HOME`` and its own broker (whose log
directories are under that home), so "every byte" can mean every byte. In it, a real
capture of synthetic threads (the runtime publisher pseudonymizes and seals), the stream
worker, the replay worker, the seal with its parity gate, verify and one training step
run (``flywheel selftest``, as a user runs it). Then one owner is erased with
``flywheel erase --owner RAW``, and every file under the home (the broker's log
directories of every topic: capture, windows, quarantine, internal, changelogs,
consent; the dataset, checkpoint, worker state, logs, key stores, the erasure's
journal) is scanned for a canary: eight consecutive token ids that only that owner's
threads contain, in every plaintext form (int32/int64 little-endian, Avro zigzag,
decimal text). 0 hits, 0 rows of the owner's pseudonym in the live snapshot, and the
superseding snapshot verifies; the owner did have rows before, and the scanner finds
the canary in a plaintext file, so neither check is vacuous.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from hebrus_flywheel.consumers.supersede import snapshot_owner_rows
from hebrus_flywheel.core.canary import CanaryScanner
from hebrus_flywheel.core.kafka.security import ROLE_ENV, role_properties_path
from hebrus_flywheel.core.privacy.keystore import LocalOwnerKeyStore
from hebrus_flywheel.core.privacy.pseudonyms import Pseudonymizer
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV, HOME_ENV, KAFKA_CONFIG_ENV, PORT_ENV
from hebrus_flywheel.core.snapshot.keys import KEK_FILE_ENV
from hebrus_flywheel.replay.capture import load_threads
from hebrus_flywheel.replay.render import render_thread
from hebrus_flywheel.replay.teacher import init_teacher
from hebrus_flywheel.replay.tokenizer import load_tokenizer
from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker
from tests.support.planted import make_writable
from tests.support.ports import free_port

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


@pytest.fixture()
def own_home(tmp_path: Path, kafka_bootstrap: str) -> Iterator[tuple[Path, str, dict[str, str]]]:
    """(home, bootstrap, env): a FLYWHEEL_HOME with its own broker (the session broker's
    jars, nothing else shared) and the environment a command run in it gets."""
    home = tmp_path / "home"
    port = free_port()
    broker = EmbeddedBroker(BrokerConfig(home=home, port=port, controller_port=free_port(),
                                         heap_mb=512, libs_dir=BrokerConfig().jars_dir))
    broker.up()
    shared = (BOOTSTRAP_ENV, KAFKA_CONFIG_ENV, ROLE_ENV, KEK_FILE_ENV, "FLYWHEEL_OWNER_KEYS")
    env = {k: v for k, v in os.environ.items() if k not in shared}
    env.update({HOME_ENV: str(home), PORT_ENV: str(port),
                KAFKA_CONFIG_ENV: str(role_properties_path("admin", home))})
    try:
        yield home, broker.config.bootstrap, env
    finally:
        broker.down()


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "hebrus_flywheel.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"{argv[0]} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


def test_erased_owner_leaves_no_plaintext_in_its_home_and_no_live_rows(
        own_home: tuple[Path, str, dict[str, str]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    home, bootstrap, env = own_home
    monkeypatch.setenv(KEK_FILE_ENV, str(home / "keys" / "snapshot-kek.json"))  # row counts
    teacher = tmp_path / "teacher"  # the model, not user data: outside the scanned home
    init_teacher(teacher, family="qwen3_moe", seed=2)
    run_dir = home / "run"
    done = _run(["selftest", "--teacher", str(teacher), "--threads", str(THREADS), "--seed",
                 str(SEED), "--work-dir", str(run_dir), "--keep-topics",
                 "--bootstrap-servers", bootstrap], env)
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict["selftest"] == "passed", verdict
    raw_owner, canary = unique_canary(teacher)
    owner = Pseudonymizer(LocalOwnerKeyStore(home / "keys" / "owners")).owner(raw_owner)
    epoch = run_dir / "dataset" / "epoch=0"
    before, total = snapshot_owner_rows(epoch, owner)
    assert before > 0, f"owner {owner} has no rows in the sealed snapshot"

    done = _run(["erase", "--owner", raw_owner, "--dataset", str(run_dir / "dataset"),
                 "--checkpoints", str(run_dir / "checkpoint"), "--grace", "0",
                 "--bootstrap-servers", bootstrap, "--changelog-prefix",
                 verdict["namespace"], "--json"], env)
    receipt = json.loads(done.stdout)
    try:
        assert receipt["owner"] == owner and raw_owner not in done.stdout
        assert receipt["owner_rows_after"] == 0
        assert snapshot_owner_rows(epoch, owner) == (0, total - before)
        _run(["verify", str(epoch), "--keys"], env)  # the superseding snapshot, now live

        scanner = CanaryScanner(canary)
        plain = tmp_path / "plaintext-canary.bin"
        plain.write_bytes(b"".join(t.to_bytes(4, "little") for t in canary))
        assert scanner.scan([plain]).hits, "the scanner must see a plaintext canary"
        log_dir = BrokerConfig(home=home).data_dir
        topic_dirs = sorted(log_dir.glob(f"{verdict['namespace']}*"))
        assert log_dir.is_relative_to(home) and len(topic_dirs) > 10, topic_dirs
        result = scanner.scan([home])
        print(f"erased {before} rows of {owner}; scanned every file under the run's "
              f"FLYWHEEL_HOME: {result.files} files ({len(topic_dirs)} broker topic "
              f"directories of the run): {len(result.hits)} canary hits")
        assert result.files > 0 and result.unreadable == []
        assert result.hits == [], result.to_json()
    finally:
        make_writable(run_dir / "dataset")
