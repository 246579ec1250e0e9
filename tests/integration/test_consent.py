"""The consent ledger against the real broker: the CLI writes it, the runtime publisher
refuses owners without a live capture grant (never granted, revoked, expired), and a
record injected past the publisher is quarantined ``no_consent`` by the streams worker,
metadata only."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.consent import CONSENT_TOPIC, now_ms
from hebrus_flywheel.streams.consent_book import ConsentBook
from hebrus_flywheel.streams.consent_cli import consent_app
from hebrus_flywheel.streams.processors.accounting import account
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.publisher import PublisherConfig, RuntimePublisher
from hebrus_flywheel.streams.topics import describe_topics
from tests.support.consent import grant_owners, revoke_owners
from tests.support.sealing import owner_pseudonym
from tests.support.streams_harness import (
    WorkerProcess,
    produce,
    producer,
    read_windows,
    wait_until,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    ThreadSpec,
    identity_message,
    make_identity,
    thread_messages,
)

pytestmark = pytest.mark.integration

IDENTITY = make_identity(layers=4, experts=64, top_k=4)
FLAGS = {"validation_fraction": 0.0, "runtime_holdout_fraction": 0.0, "stress_rate": 0.0}


def _cli(*args: str) -> Any:
    return CliRunner().invoke(consent_app, list(args))


def test_cli_grants_revokes_and_lists_by_pseudonym(topic_factory: Any,
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_OWNER_KEYS", str(tmp_path / "keys"))
    topic_factory.catalogue()
    prefix, bootstrap = topic_factory.prefix, topic_factory.bootstrap
    common = ["--prefix", prefix, "--bootstrap-servers", bootstrap]
    got = _cli("grant", "--owner", "alice", "--scopes", "capture,train",
               "--policy-version", "2026-01", "--expires", "30d", *common)
    assert got.exit_code == 0, got.output
    alice = Pseudonymizer(LocalOwnerKeyStore()).owner("alice")
    assert alice in got.output and "alice" not in got.output.replace(alice, "")
    bob = "o" + uuid.uuid4().hex
    assert _cli("grant", "--owner-pseudonym", bob, "--policy-version", "v", *common).exit_code == 0
    assert _cli("revoke", "--owner-pseudonym", bob, "--reason", "owner request",
                *common).exit_code == 0
    listed = json.loads(_cli("list", "--json", *common).output)
    status = {row["owner"]: row for row in listed["owners"]}
    assert status[alice]["status"] == "live" and status[alice]["scopes"] == ["capture", "train"]
    assert status[bob]["status"] == "revoked" and status[bob]["reason"] == "owner request"
    # compaction-friendly: every ledger record is keyed by the owner it describes
    for msg in read_topic(bootstrap, prefix + CONSENT_TOPIC):
        _, record = codec.decode(msg.value() or b"")
        assert msg.key() == record["owner"].encode()
    info = describe_topics(bootstrap, [prefix + CONSENT_TOPIC])[prefix + CONSENT_TOPIC]
    assert info.configs["cleanup.policy"] == "compact"


@pytest.mark.parametrize("args, message", [
    (["--owner", "a", "--owner-pseudonym", "o" + "0" * 32], "exactly one"),
    (["--owner-pseudonym", "alice"], "not an owner pseudonym"),
    (["--owner", "a"], "--policy-version is required"),
])
def test_cli_errors_say_what_to_do(args: list[str], message: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_OWNER_KEYS", str(tmp_path / "keys"))
    result = _cli("grant", *args)
    assert result.exit_code == 2 and message in result.output, result.output


def _turn(owner: str, index: int, wall: int) -> dict[str, Any]:
    return {
        "owner": owner, "thread": "t", "turn_index": index, "generation": 0,
        "sequence_id": f"r{index}", "role": "user", "token_offset": index * 4,
        "token_ids": [1, 2, 3, 4],
        "segments": [{"kind": "content", "start": 0, "end": 4, "generated": False}],
        "sampling": {"mode": "forced", "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0,
                     "max_new_tokens": 4},
        "identity_id": IDENTITY["identity_id"], "domain_tags": [], "closes_thread": False,
        "wall_time_ms": wall,
    }


def test_publisher_refuses_without_a_live_grant(topic_factory: Any) -> None:
    topic_factory.catalogue()
    prefix, bootstrap = topic_factory.prefix, topic_factory.bootstrap
    granted, never, expired = (f"o-{name}-{uuid.uuid4().hex[:6]}"
                               for name in ("granted", "never", "expired"))
    now = now_ms()
    grant_owners(bootstrap, [granted], prefix=prefix)
    grant_owners(bootstrap, [expired], prefix=prefix, granted_at_ms=now - 60_000,
                 expires_at_ms=now - 1)
    book = ConsentBook(bootstrap=bootstrap, topic=prefix + CONSENT_TOPIC, max_age_s=0.0)
    config = PublisherConfig(bootstrap_servers=bootstrap, transcripts_topic=topic_factory("tr"),
                             identities_topic=topic_factory("id"), max_block_ms=1000,
                             consent_topic=prefix + CONSENT_TOPIC)
    with RuntimePublisher(config, identity=IDENTITY, consent=book) as pub:
        assert pub.publish_turn(_turn(granted, 0, now_ms()))
        assert not pub.publish_turn(_turn(never, 0, now_ms()))
        assert not pub.publish_turn(_turn(expired, 0, now_ms()))
        revoke_owners(bootstrap, [granted], prefix=prefix)
        assert not pub.publish_turn(_turn(granted, 1, now_ms()))  # later records: refused
        assert pub.flush(30) == 0
        stats = pub.stats()
    assert stats.delivered == 1 and stats.refused_no_consent == 3
    assert sum(1 for _ in read_topic(bootstrap, config.transcripts_topic)) == 1


def test_default_publisher_reads_the_ledger_itself(topic_factory: Any) -> None:
    topic_factory.catalogue()
    prefix, bootstrap = topic_factory.prefix, topic_factory.bootstrap
    owner = f"o-default-{uuid.uuid4().hex[:6]}"
    config = PublisherConfig(bootstrap_servers=bootstrap, transcripts_topic=topic_factory("tr"),
                             identities_topic=topic_factory("id"), max_block_ms=1000,
                             consent_topic=prefix + CONSENT_TOPIC)
    with RuntimePublisher(config, identity=IDENTITY) as pub:
        assert not pub.publish_turn(_turn(owner, 0, now_ms()))
        grant_owners(bootstrap, [owner], prefix=prefix)
        # the first refusal re-read the ledger; the next re-read comes after the interval
        wait_until(lambda: pub.publish_turn(_turn(owner, 0, now_ms())), timeout_s=30,
                   what="the grant to reach the publisher")
        assert pub.flush(30) == 0
    assert pub.stats().delivered == 1


@pytest.mark.slow
def test_streams_worker_quarantines_records_without_consent(topic_factory: Any,
                                                           tmp_path: Path) -> None:
    prefix, topics = topic_factory.streams_namespace("consent", "flywheel-streams")
    clock = ProducerClock()
    ok = list(thread_messages(ThreadSpec(owner="ok", thread="t1"), IDENTITY, clock))
    refused = list(thread_messages(ThreadSpec(owner="nobody", thread="t1"), IDENTITY, clock))
    prod = producer(topic_factory.bootstrap)
    produce(prod, topics, [identity_message(IDENTITY), *ok])  # grants "ok"
    produce(prod, topics, refused, consent=False)  # injected past the publisher
    worker = WorkerProcess(bootstrap=topic_factory.bootstrap, prefix=prefix,
                           app_id="flywheel-streams", log_path=tmp_path / "worker.log",
                           flags=FLAGS, home=tmp_path / "home", extra=["--drain"]).start()
    try:
        assert worker.proc is not None and worker.proc.wait(timeout=180) == 0, \
            worker.log_path.read_text(errors="replace")[-3000:]
    finally:
        worker.stop()
    assert {w["owner"] for w in read_windows(topic_factory.bootstrap, topics)} == {
        owner_pseudonym("ok")}
    records = [codec.decode(m.value() or b"")[1]
               for m in read_topic(topic_factory.bootstrap, topics.quarantine)]
    assert len(records) == len(refused)
    for rec in records:
        assert rec["reason"] == "no_consent" and rec["reference_only"]
        assert rec["value"] == b"" and rec["value_size"] > 0
        assert rec["owner"] is None and rec["thread"] is None and rec["source_key"] is None
    totals = account(topic_factory.bootstrap, prefix=prefix, app_id="flywheel-streams")["totals"]
    assert totals["quarantined"] == len(refused) and totals["unaccounted"] == 0, totals
