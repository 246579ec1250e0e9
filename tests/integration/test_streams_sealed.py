"""Crypto-shredding of what the stream workers write (issue 13), against the real broker.

* After a run over pseudonymous owners, the raw bytes of the capture and window topics,
  the threads and decisions topics and both changelog topics (as consumers read them,
  and the broker's segment files on disk) hold no plaintext occurrence of a canary
  token sequence: not as int32 little-endian, not as Avro zigzag varints, not as
  decimal text; the same windows encoded unsealed do (the scan finds what is there).
* The windows on the topics are exactly the windows of the in-process chain sealed
  with the owners' keys (same ids, same content digests, byte-identical): a rebuild
  from capture regenerates them.
* Destroying one owner's key, then starting a worker on a fresh data directory (which
  restores its tables from the changelogs): it restores them without that owner's
  state (and without crashing), and goes on with the other owners' threads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.broker import BrokerConfig
from hebrus_flywheel.streams.owner_seal import OwnerSealer
from hebrus_flywheel.streams.processors.accounting import account
from hebrus_flywheel.streams.processors.app import CAPTURE_TABLE, DEDUP_TABLE
from hebrus_flywheel.streams.processors.inspect import read_topic
from hebrus_flywheel.streams.processors.state_codec import SealedState, StateDecodeError, loads
from hebrus_flywheel.streams.processors.state_seal import owner_of_key
from hebrus_flywheel.streams.processors.topology import StreamTopics
from hebrus_flywheel.streams.processors.window_seal import encode_window, readable_window
from hebrus_flywheel.streams.topics import catalogue
from tests.support.sealing import session_keys
from tests.support.streams_harness import (
    WorkerProcess,
    expected_pipeline,
    last_logged,
    produce,
    producer,
    wait_until,
    worker_processor_config,
)
from tests.support.streams_synthetic import (
    ProducerClock,
    ThreadSpec,
    encode_message,
    identity_message,
    make_identity,
    random_specs,
    thread_messages,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDENTITY = make_identity(layers=4, experts=32, top_k=2)
FLAGS = {"validation_fraction": 0.3, "runtime_holdout_fraction": 0.3, "stress_rate": 0.0}
CANARY = (4091, 13, 4073, 29, 4057, 31, 4049, 37, 4021, 41, 4019, 43, 4013, 47, 4007, 53)


def _zigzag(n: int) -> bytes:
    z, out = (n << 1) ^ (n >> 63), bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def canary_forms(tokens: tuple[int, ...] = CANARY, n: int = 4) -> dict[str, bytes]:
    """``n`` consecutive canary tokens in every plaintext form they could be written in."""
    part = tokens[:n]
    return {
        "int32_le": b"".join(t.to_bytes(4, "little", signed=True) for t in part),
        "avro_zigzag": b"".join(_zigzag(t) for t in part),
        "decimal_compact": ",".join(map(str, part)).encode(),
        "decimal_spaced": ", ".join(map(str, part)).encode(),
    }


def hits(blobs: list[bytes]) -> dict[str, int]:
    forms = canary_forms()
    return {name: sum(len(re.findall(re.escape(form), b)) for b in blobs)
            for name, form in forms.items()}


def topic_bytes(bootstrap: str, topic: str) -> list[bytes]:
    out = []
    for msg in read_topic(bootstrap, topic):
        out.append((msg.key() or b"") + (msg.value() or b""))
        out.extend(v if isinstance(v, bytes) else str(v).encode()
                   for _, v in (msg.headers() or []) if v is not None)
    return out


def holds_sealed_state(bootstrap: str, topic: str) -> bool:
    """Whether a changelog record of ``topic`` is a sealed owner value."""
    return any(_is_sealed(msg.value()) for msg in read_topic(bootstrap, topic))


def _is_sealed(value: bytes | None) -> bool:
    if value is None:
        return False
    try:
        return isinstance(loads(value), SealedState)
    except StateDecodeError:
        return False


def disk_bytes(topic: str) -> list[bytes]:
    """Every file of the topic's partition directories in the embedded broker's log dir."""
    data = BrokerConfig().data_dir
    return [p.read_bytes() for d in data.glob(f"{topic}-*") if d.is_dir()
            for p in d.iterdir() if p.is_file()]


class Run:
    """A uuid-prefixed catalogue, an owner key store and two pseudonymous owners."""

    def __init__(self, topic_factory: Any, tmp_path: Path) -> None:
        self.bootstrap = topic_factory.bootstrap
        self.prefix = f"{topic_factory.prefix}sealed{uuid.uuid4().hex[:6]}."
        self.app_id = "flywheel-streams"
        topic_factory.create(catalogue(self.prefix))
        self.topics = StreamTopics.from_prefix(self.prefix, self.app_id)
        full = self.prefix + self.app_id
        self.changelogs = [f"{full}-{CAPTURE_TABLE}-changelog", f"{full}-{DEDUP_TABLE}-changelog"]
        topic_factory.track([self.topics.threads, self.topics.decisions, self.topics.ticks,
                             self.topics.crashes, *self.changelogs, f"{full}-__assignor-__leader"])
        # the session's key store (what the capture records are sealed with); raw owner
        # names unique to this run, since the test destroys their keys
        self.keys_dir = session_keys().directory
        self.writer = LocalOwnerKeyStore(self.keys_dir, create=True, max_age_s=0)
        self.pz = Pseudonymizer(self.writer)
        tag = uuid.uuid4().hex[:8]
        self.raw = {"alice": f"alice-{tag}", "bob": f"bob-{tag}"}
        self.alice, self.bob = self.pz.owner(self.raw["alice"]), self.pz.owner(self.raw["bob"])
        self.tmp_path = tmp_path

    def owners_specs(self, name: str, n: int, seed: int) -> list[ThreadSpec]:
        """Specs with the runtime's raw ids (thread_messages pseudonymizes them)."""
        raw_owner = self.raw[name]
        self.writer.data_key(self.pz.owner(raw_owner), create=True)
        return [dataclasses.replace(s, owner=raw_owner, thread=f"{seed}-{s.thread}")
                for s in random_specs(n, n_owners=1, seed=seed, assistant_tokens=16)]

    def canary_spec(self) -> ThreadSpec:
        return ThreadSpec(owner=self.raw["alice"], thread="canary",
                          turns=(("user", len(CANARY)), ("assistant", len(CANARY))),
                          tokens=(CANARY, CANARY[::-1]), seed=99)

    def worker(self, tag: str, *, home: str = "home") -> WorkerProcess:
        """A worker on ``home``'s data directory: the same one as an earlier worker keeps
        its RocksDB tables (a restart reads only newer changelog records); a fresh one is
        another machine, which restores the tables from the changelogs."""
        worker = WorkerProcess(bootstrap=self.bootstrap, prefix=self.prefix, app_id=self.app_id,
                               log_path=self.tmp_path / f"worker-{tag}.log", flags=FLAGS,
                               home=self.tmp_path / home)
        worker.env["FLYWHEEL_OWNER_KEYS"] = str(self.keys_dir)
        return worker

    def window_messages(self) -> list[Any]:
        return [m for t in self.topics.windows.values() for m in read_topic(self.bootstrap, t)]


def messages_of(specs: list[ThreadSpec], seed: int) -> list[Any]:
    clock = ProducerClock(producer_id=f"runtime-{seed}")
    out = [identity_message(IDENTITY)]
    for spec in specs:
        out.extend(thread_messages(spec, IDENTITY, clock))
    return out


def sealed_expected(messages: list[Any], keys_dir: Path) -> dict[str, bytes]:
    """window id → the bytes the worker must write: the in-process chain, sealed."""
    sealer = OwnerSealer(lambda: LocalOwnerKeyStore(keys_dir))
    pipeline = expected_pipeline(messages, worker_processor_config(FLAGS))
    encoded = [encode_window(w, sealer) for w in pipeline.windows]
    return {record["window_id"]: value for value, record in encoded}


def test_nothing_the_workers_write_holds_plaintext_and_erasure_drops_state(
    topic_factory: Any, tmp_path: Path
) -> None:
    run = Run(topic_factory, tmp_path)
    specs = [run.canary_spec(), *run.owners_specs("alice", 3, 1), *run.owners_specs("bob", 4, 2)]
    messages = messages_of(specs, 1)
    expected = sealed_expected(messages, run.keys_dir)
    produce(producer(run.bootstrap), run.topics, messages)
    worker = run.worker("0").start()
    try:
        wait_until(lambda: {m.value() for m in run.window_messages()} >= set(expected.values()),
                   timeout_s=240, what="every sealed window")
    finally:
        assert worker.stop() != 70, worker.log_path.read_text()[-3000:]

    # the windows: exactly the in-process chain's windows, sealed; they open again
    sealer = OwnerSealer(lambda: LocalOwnerKeyStore(run.keys_dir))
    on_topic = run.window_messages()
    assert {m.value() for m in on_topic} == set(expected.values())
    opened = []
    for msg in on_topic:
        schema, record = codec.decode_message(msg.value(), msg.headers())
        assert schema.version == 2 and record["owner"] in (run.alice, run.bob)
        opened.append(readable_window(schema.version, record, sealer))
    assert any(tuple(w["token_ids"][2:2 + len(CANARY)]) == CANARY for w in opened)

    # the scan: no plaintext canary in anything the workers wrote ...
    written = [*run.topics.windows.values(), run.topics.threads, run.topics.decisions,
               *run.changelogs]
    found = {t: hits(topic_bytes(run.bootstrap, t) + disk_bytes(t)) for t in written}
    print("canary hits in worker output:", json.dumps(found))
    assert all(n == 0 for per_topic in found.values() for n in per_topic.values()), found
    # ... nor in the capture topics (sealed by the runtime publisher) ...
    capture = {t: hits(topic_bytes(run.bootstrap, t) + disk_bytes(t))
               for t in (run.topics.transcripts, run.topics.observations)}
    print("canary hits in the capture topics:", json.dumps(capture))
    assert all(n == 0 for per_topic in capture.values() for n in per_topic.values()), capture
    # ... while the scan does find it in the clear (the same window, unsealed): not vacuous
    plain = [codec.encode_entry(codec.default_registry().get("Window.v1"), w, validate=False)
             for w in opened]
    control = hits(plain)
    print("canary hits in the opened windows encoded unsealed:", control)
    assert control["avro_zigzag"] >= 1
    for name in run.changelogs:  # not vacuous: the changelogs hold sealed owner values
        assert holds_sealed_state(run.bootstrap, name), name

    # accounting reads the sealed capture-state headers: every consumed record explained
    assert os.environ["FLYWHEEL_OWNER_KEYS"] == str(run.keys_dir)  # the session's store
    report = account(run.bootstrap, prefix=run.prefix, app_id=run.app_id)
    print("accounting:", report["totals"])
    assert report["refused_state_records"] == [] and report["totals"]["unaccounted"] == 0

    # erasure: alice's key is destroyed; a worker on another machine (a fresh data
    # directory, so it restores the tables from the changelogs) restores without her state
    run.writer.destroy(run.alice)
    more = run.owners_specs("bob", 2, 7)
    produce(producer(run.bootstrap), run.topics, messages_of(more, 7))
    expected_more = sealed_expected(messages_of(more, 7), run.keys_dir)
    again = run.worker("1", home="home-1").start()
    try:
        wait_until(lambda: {m.value() for m in run.window_messages()}
                   >= set(expected_more.values()), timeout_s=240, what="bob's later windows")
        wait_until(lambda: "erased_on_restore" in again.log_path.read_text(), timeout_s=60,
                   what="a counter log line after the restore")
    finally:
        status = again.stop()
    log = again.log_path.read_text()
    assert status != 70 and "crashed" not in log, log[-3000:]
    counters = _last_counters(again)
    sealing = {k: v for k, v in counters.items() if k.startswith("sealing/")}
    print("sealing counters of the restarted worker:", sealing)
    # every changelog record of alice's (her thread state and accounting; her 4 dedup
    # decisions and 4 sticky splits) was dropped on restore
    for table, changelog in zip((CAPTURE_TABLE, DEDUP_TABLE), run.changelogs, strict=True):
        alice_values = owner_values(run.bootstrap, changelog, run.alice)
        assert alice_values >= 4, (table, alice_values)
        assert sealing.get(f"sealing/{table}_erased_on_restore") == alice_values, sealing
    # her 4 decisions and 4 sticky splits, besides the summaries that waited for their
    # turn in decision order (``p``: how many did depends on when marks came)
    assert owner_values(run.bootstrap, run.changelogs[1], run.alice, kinds="ds") == 8


def owner_values(bootstrap: str, changelog: str, owner: str, kinds: str | None = None) -> int:
    """The changelog records holding a value (not a tombstone) of ``owner``'s keys (of
    the key ``kinds`` given, by their first letter)."""
    return sum(1 for msg in read_topic(bootstrap, changelog)
               if msg.value() is not None and msg.key() is not None
               and owner_of_key(key := json.loads(msg.key())) == owner
               and (kinds is None or key[0] in kinds))


def _last_counters(worker: WorkerProcess) -> dict[str, Any]:
    counters = last_logged(worker.log_path, "streams counters ")
    assert counters, worker.log_path.read_text()[-3000:]
    return counters


def test_the_worker_refuses_a_changelog_sealed_under_another_key_store(
    topic_factory: Any, tmp_path: Path
) -> None:
    """Fail closed: sealed state that does not open (and is not erased) stops the worker
    with the crash status; it is never dropped silently."""
    run = Run(topic_factory, tmp_path)
    messages = messages_of(run.owners_specs("bob", 2, 3), 3)
    expected = sealed_expected(messages, run.keys_dir)
    produce(producer(run.bootstrap), run.topics, messages)
    worker = run.worker("0").start()
    try:
        wait_until(lambda: {m.value() for m in run.window_messages()} >= set(expected.values()),
                   timeout_s=240, what="the sealed windows")
    finally:
        assert worker.stop() != 70, worker.log_path.read_text()[-3000:]
    stranger = run.worker("stranger", home="home-stranger")
    other = tmp_path / "other-keys"
    LocalOwnerKeyStore(other, create=True)
    stranger.env["FLYWHEEL_OWNER_KEYS"] = str(other)
    stranger.start()
    try:
        wait_until(lambda: not stranger.alive(), timeout_s=120, what="the refusing worker exit")
    finally:
        stranger.stop()
    log = stranger.log_path.read_text()
    assert stranger.proc is not None and stranger.proc.returncode == 70, log[-3000:]
    assert "sealed value that does not open" in log, log[-3000:]
    assert os.environ.get("FLYWHEEL_OWNER_KEYS") != str(other)


def test_a_running_worker_stops_writing_an_owner_erased_mid_thread(
    topic_factory: Any, tmp_path: Path
) -> None:
    """An owner erased while the worker holds half of their thread: the rest of their
    records (sealed before the erasure, delivered after it) are quarantined as
    ``owner_erased`` within the key store's cache age, no summary or window of theirs
    is written, their changelog values are tombstones or sealed under the destroyed key,
    and the other owners go on."""
    run = Run(topic_factory, tmp_path)
    alice_msgs = messages_of(run.owners_specs("alice", 1, 4), 4)
    half = len(alice_msgs) // 2
    names = run.topics.capture_kinds()
    # sealed now, as the runtime sealed them before the erasure; delivered after it
    late = [(names[kind], key, *encode_message(kind, record))
            for kind, key, record in alice_msgs[half:]]
    prod = producer(run.bootstrap)
    produce(prod, run.topics, alice_msgs[:half])
    worker = run.worker("0").start()
    try:
        wait_until(lambda: holds_sealed_state(run.bootstrap, run.changelogs[0]),
                   timeout_s=180, what="alice's sealed state in the changelog")
        run.writer.destroy(run.alice)
        time.sleep(6)  # the worker's key cache (max_age_s=5) forgets the key
        for topic, key, value, headers in late:
            prod.produce(topic, key=key, value=value, headers=list(headers))
        bob = messages_of(run.owners_specs("bob", 2, 5), 5)
        expected = sealed_expected(bob, run.keys_dir)
        produce(prod, run.topics, bob[1:])
        wait_until(lambda: {m.value() for m in run.window_messages()}
                   >= set(expected.values()), timeout_s=180, what="bob's windows")
        wait_until(lambda: "owner_erased" in worker.log_path.read_text(), timeout_s=60,
                   what="a counter line with the erased owner's quarantined records")
    finally:
        status = worker.stop()
    log = worker.log_path.read_text()
    assert status != 70 and "crashed" not in log, log[-3000:]
    owners = {codec.decode(m.value())[1]["owner"] for m in run.window_messages()}
    assert owners == {run.bob}
    counters = _last_counters(worker)
    print("counters after a mid-thread erasure:",
          {k: v for k, v in counters.items() if "erased" in k})
    assert counters.get("quarantine/owner_erased", 0) == len(late), counters
    last: dict[bytes, bytes | None] = {}
    for msg in read_topic(run.bootstrap, run.changelogs[0]):
        last[msg.key() or b""] = msg.value()
    alice = {k: v for k, v in last.items() if run.alice.encode() in k}
    # values never rewritten stay sealed under the destroyed key (unreadable;
    # `flywheel erase` tombstones them too)
    assert alice and all(v is None or _is_sealed(v) for v in alice.values()), alice
