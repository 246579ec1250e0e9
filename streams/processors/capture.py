"""Capture stage: validate → assemble for one capture record at a time (pure, no I/O).

:class:`CaptureStage` is what the faust capture agent runs for every message of the
transcripts and observations topics (and for idle ticks). It returns *emits*: quarantine
records for refused input, and one thread summary when a generation completes. The
caller sends them; nothing here talks to Kafka.

Redelivery (at-least-once) is absorbed here: every state entry knows the offsets it has
applied, so a record seen again gets its original verdict and changes nothing; when the
generation already finished, its last emits (the *outbox*) are returned again so that a
send lost in a crash is repeated with identical content.

Sealed capture (:mod:`streams.sealing`): right after Avro decode, turns and observations
are opened with the owner key store (a reader, opened once on the first record), so
every later step works on plaintext token ids held in memory only. A record that does
not open is quarantined (``owner_erased`` and ``unsealed_capture`` metadata-only, without
value bytes); the quarantine never holds plaintext token ids: other refusals keep the
sealed bytes as they were read. A key store that cannot be used stops the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.privacy import (
    KeyStoreError,
    LocalOwnerKeyStore,
    OwnerKeyStore,
    is_pseudonym,
)
from hebrus_flywheel.core.privacy.pseudonyms import OWNER, THREAD
from hebrus_flywheel.streams import quarantine
from hebrus_flywheel.streams.chunks import CHUNK_V1, ChunkError, ChunkTokens, unroll
from hebrus_flywheel.streams.exceptions import ConsentError
from hebrus_flywheel.streams.processors import assemble as asm
from hebrus_flywheel.streams.processors import expiry
from hebrus_flywheel.streams.processors.common import (
    SEP,
    counter_key,
    header_key,
    instance_id,
    thread_key,
)
from hebrus_flywheel.streams.processors.decision_order import EventClocks
from hebrus_flywheel.streams.processors.dedup import DedupConfig
from hebrus_flywheel.streams.processors.split import SplitConfig, may_hold_out_runtime
from hebrus_flywheel.streams.processors.validate import (
    PackedRoutes,
    Rejection,
    SourceRef,
    ValidateConfig,
    check_counter,
    check_identity_record,
    check_identity_ref,
    check_lengths,
    check_message_key,
    check_observation,
    check_turn,
    chunk_block_clean,
    decode_capture,
    quarantine_record,
)
from hebrus_flywheel.streams.rules import IdentityRules
from hebrus_flywheel.streams.sealing import METADATA_ONLY_REASONS, CaptureOpener, SealingError

log = logging.getLogger(__name__)
QUARANTINE = "quarantine"
SUMMARY = "summary"
OPEN_STATUSES = ("open", "ready")
"""Header statuses of a generation still in the capture stage (assembling, or complete
and awaiting its decision); the others (emitted, dropped, quarantined) are finished."""


class Emit(NamedTuple):
    """Something to send: ``kind`` (quarantine | summary), Kafka key, record dict."""

    kind: str
    key: str
    value: dict[str, Any]


class CaptureStage:
    """Validate and assemble capture records into completed thread generations."""

    def __init__(
        self,
        *,
        topics: Mapping[str, str],
        store: MutableMapping[str, Any],
        identities: MutableMapping[str, IdentityRules | None],
        validate_config: ValidateConfig | None = None,
        assemble_config: asm.AssembleConfig | None = None,
        dedup_config: DedupConfig | None = None,
        resolve_identity: Callable[[str], None] | None = None,
        counters: Counters | None = None,
        keys: OwnerKeyStore | None = None,
        capture_consent: Callable[[str, int], bool] | None = None,
        split_config: SplitConfig | None = None,
    ) -> None:
        """``capture_consent(owner, at_ms)``: whether the owner had a live ``capture``
        grant at the record's wall time (the worker passes its consent ledger); a
        record without one is quarantined ``no_consent`` by reference. None checks
        nothing (in-process reference pipelines of the tests).

        ``split_config``: the split stage's configuration; a thread whose runtime draw
        cannot make it a ``runtime_holdout`` (the only split whose windows carry
        captured routes) keeps no route payloads (:mod:`streams.processors.assemble`).
        None keeps every thread's."""
        self.kinds = {name: kind for kind, name in topics.items()}
        self.topics = dict(topics)
        self.store = store
        self.identities = identities
        self.vconf = validate_config or ValidateConfig()
        self.aconf = assemble_config or asm.AssembleConfig()
        self.dconf = dedup_config or DedupConfig()
        self.resolve_identity = resolve_identity
        self.counters = counters or Counters()
        self._keys = keys
        self._opener: CaptureOpener | None = None
        self.capture_consent = capture_consent
        self.sconf = split_config
        self.clocks = EventClocks()  # marks for the dedup stage's event-time order

    @property
    def opener(self) -> CaptureOpener:
        """Opens sealed records; the key store (``LocalOwnerKeyStore()`` unless given) is
        opened on first use, so a worker that never sees capture needs none."""
        if self._opener is None:
            self._opener = CaptureOpener(self._keys if self._keys is not None
                                         else LocalOwnerKeyStore())
        return self._opener

    # -- entry points -------------------------------------------------------------

    def process_safely(self, **message: Any) -> list[Emit]:
        """:meth:`process`, but an unexpected exception quarantines the record
        (``processing_error``) instead of stopping the worker. A key store that cannot be
        used (:class:`KeyStoreError`) is no fault of the record: it stops the worker."""
        try:
            return self.process(**message)
        except KeyStoreError:
            raise
        except ConsentError:
            raise  # an unreadable consent ledger is an outage, not a bad record: crash
        except Exception as exc:
            log.exception(
                "processing %s:%s:%s failed",
                message.get("topic"),
                message.get("partition"),
                message.get("offset"),
            )
            source = SourceRef(message["topic"], message["partition"], message["offset"])
            problem = Rejection("processing_error", f"{type(exc).__name__}: {exc}")
            return [
                self._quarantine(
                    source,
                    problem,
                    message.get("value"),
                    message.get("key"),
                    message.get("headers"),
                )
            ]

    def process(
        self,
        *,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, Any]] | None = None,
        now_ms: int = 0,
    ) -> list[Emit]:
        """Handle one capture message; returns what to send."""
        kind = self.kinds[topic]
        source = SourceRef(topic, partition, offset)
        self.counters.inc("validate", f"read_{kind}")
        decoded = decode_capture(value, headers, kind=kind, config=self.vconf)
        if isinstance(decoded, Rejection):
            return [self._quarantine(source, decoded, value, key, headers)]
        schema, record = decoded
        if kind == "identities":
            return self._identity(source, record, key, value, headers, schema)
        self.clocks.observe(partition, kind, record)
        too_long = check_lengths(record)  # hostile strings first, before any key lookup
        if too_long is not None:
            return [self._quarantine(source, too_long, value, key, headers, record, schema)]
        raw = (value, key, headers, schema)
        if schema == CHUNK_V1:
            return self._chunk(source, record, now_ms, raw)
        try:
            record = self.opener.open(schema, record)
        except SealingError as exc:
            return [self._sealing_quarantine(source, exc, value, key, headers, record, schema)]
        problem, routes = self._check_record(kind, record, key)
        if problem is None and kind == "observations" and _rejected_speculation(record):
            self.counters.inc("assemble", "speculative_rejected_skipped")
            return []
        if problem is None:
            problem = self._check_counter(source, record, now_ms)
        if problem is not None:
            return [self._quarantine(source, problem, value, key, headers, record, schema)]
        if not self._consented(record):
            return [self._no_consent(source, record, value)]
        self.counters.inc("validate", "passed")
        return self._assemble(source, kind, [(record, routes)], now_ms, raw)

    def _chunk(self, source: SourceRef, chunk: dict[str, Any], now_ms: int,
               raw: tuple[Any, ...]) -> list[Emit]:
        """A ``RouteObservationChunk``: opened, its tokens checked like single observations
        (at once as arrays when they are all clean, else unrolled token by token for the
        verdict); any refusal quarantines the chunk whole (the token's reason code, its
        position in the detail). Counter and consent are the chunk's; assembly applies all
        tokens or none."""
        value, key, headers, schema = raw
        try:
            opened = self.opener.open_chunk_arrays(chunk)
        except SealingError as exc:
            return [self._sealing_quarantine(source, exc, value, key, headers, chunk, schema)]
        except ChunkError as exc:
            return [self._quarantine(source, Rejection(exc.reason, exc.detail), value, key, headers,
                                     chunk, schema)]
        checked: list[tuple[dict[str, Any], Any]] | ChunkTokens = opened
        if not self._chunk_clean(chunk, opened, key):
            checked = []
            tokens = unroll(chunk, opened)
            for i, record in enumerate(tokens):
                problem, routes = self._check_record("observations", record, key)
                if problem is not None:
                    detail = f"token {i} of {len(tokens)} (ordinal {record['token_ordinal']}): "
                    return [self._quarantine(
                        source, problem._replace(detail=detail + problem.detail),
                        value, key, headers, chunk, schema)]
                checked.append((record, routes))
        problem = self._check_counter(source, chunk, now_ms)
        if problem is not None:
            return [self._quarantine(source, problem, value, key, headers, chunk, schema)]
        if not self._consented(chunk):
            return [self._no_consent(source, chunk, value)]
        self.counters.inc("validate", "passed")
        self.counters.inc("validate", "chunk_tokens", int(chunk["token_count"]))
        if isinstance(checked, ChunkTokens):
            return self._assemble(source, "observations", [(chunk, checked)], now_ms, raw,
                                  run=True)
        return self._assemble(source, "observations", checked, now_ms, raw)

    def _chunk_clean(self, chunk: dict[str, Any], opened: ChunkTokens,
                     key: bytes | None) -> bool:
        """Whether every token of the chunk passes the per-token checks (at once)."""
        identity = self._identity_of(chunk)
        return (not isinstance(identity, Rejection)
                and check_message_key(chunk, key) is None
                and chunk_block_clean(chunk, opened, identity))

    def tick(self, partition: int, now_ms: int) -> list[Emit]:
        """Sweep the partition's due expiry buckets (:mod:`streams.processors.expiry`):
        complete (or refuse) the open generations that went idle, repeat the summary of
        any that waited longer than the idle timeout for a decision (its first summary
        may have been lost in a crash), delete finished headers older than
        ``finished_ttl_ms`` and producer counters idle for ``counter_ttl_ms``. Only
        scheduled keys are looked at, never the whole table."""
        emits: list[Emit] = []

        def decide(key: str, at_ms: int) -> int | None:
            if key.startswith(f"c{SEP}"):
                return self._expire_counter(key, at_ms)
            if key.startswith(f"h{SEP}"):
                return self._tick_header(key, at_ms, emits)
            return None

        expiry.sweep(self.store, partition=partition, now_ms=now_ms,
                     bucket_ms=self.aconf.expiry_bucket_ms, decide=decide)
        return emits

    def _tick_header(self, key: str, now_ms: int, emits: list[Emit]) -> int | None:
        """One scheduled header: what :meth:`tick` does with it; when it falls due next."""
        stored = self.store.get(key)
        if stored is None:
            return None
        header = dict(stored)
        if header["status"] not in OPEN_STATUSES:
            due = int(header["last_ms"]) + self.aconf.finished_ttl_ms
            if due > now_ms:
                return due
            asm.drop_content(self.store, key[2:], header)
            del self.store[key]  # a tombstone: a restored worker does not see it again
            self.counters.inc("expiry", f"headers_{header['status']}")
            return None
        wait = self._wait_ms(header)
        if header["last_ms"] > now_ms - wait:
            return int(header["last_ms"]) + wait
        if header["status"] == "ready":
            self.counters.inc("assemble", "summaries_repeated")
            emits.extend(Emit(*e) for e in header["outbox"])
            header["repeats"] = int(header.get("repeats", 0)) + 1
        else:
            self.counters.inc("assemble", "idle_timeouts")
            emits.extend(self._finish(key[2:], header, idle=True))
        header["last_ms"] = now_ms
        self.store[key] = header
        ttl = self._wait_ms(header) if header["status"] in OPEN_STATUSES \
            else self.aconf.finished_ttl_ms
        return now_ms + ttl

    def _wait_ms(self, header: Mapping[str, Any]) -> int:
        """How long an open generation may stay idle, or a ready one wait for its decision
        before its summary is sent again: the idle timeout, doubled after each repeat (at
        most 64 times). The repeat only covers a summary lost in a crash; behind a slow
        dedup stage every repeat is one more summary for it to read (``bench/soak.py``
        with a fixed wait: 10,817 repeats for 20,000 threads)."""
        repeats = min(int(header.get("repeats", 0)), 6)
        return self.aconf.idle_timeout_ms << repeats

    def _expire_counter(self, key: str, now_ms: int) -> int | None:
        state = self.store.get(key)
        if state is None:
            return None
        due = int(state.get("at", 0)) + self.aconf.counter_ttl_ms
        if due > now_ms:
            return due
        del self.store[key]
        self.counters.inc("expiry", "producer_counters")
        return None

    # -- validation ---------------------------------------------------------------

    def _check_record(
        self, kind: str, record: Mapping[str, Any], key: bytes | None
    ) -> tuple[Rejection | None, PackedRoutes | None]:
        identity = self._identity_of(record)
        if isinstance(identity, Rejection):
            return identity, None
        if kind == "transcripts":
            problem, routes = check_turn(record, identity), None
        else:
            checked = check_observation(record, identity)
            problem, routes = (checked, None) if isinstance(checked, Rejection) else (None, checked)
        if problem is None:
            problem = check_message_key(record, key)
        return problem, routes

    def _identity_of(self, record: Mapping[str, Any]) -> IdentityRules | Rejection:
        identity_id = record.get("identity_id")
        if (
            isinstance(identity_id, str)
            and identity_id not in self.identities
            and self.resolve_identity is not None
        ):
            self.resolve_identity(identity_id)
        return check_identity_ref(record, self.identities)

    def _check_counter(self, source: SourceRef, record: Mapping[str, Any],
                       now_ms: int) -> Rejection | None:
        ckey = counter_key(record["producer_id"], source.topic, source.partition)
        old = self.store.get(ckey)
        verdict, new_state = check_counter(
            old, counter=record["counter"], offset=source.offset, config=self.vconf
        )
        if new_state is not None:
            new_state["at"] = now_ms  # expiry: counter_ttl_ms after the producer's last record
            self.store[ckey] = new_state
            if old is None:
                self._schedule(ckey, source.partition, now_ms + self.aconf.counter_ttl_ms)
        return verdict

    def _schedule(self, key: str, partition: int, due_ms: int) -> None:
        expiry.schedule(self.store, key, partition=partition, due_ms=due_ms,
                        bucket_ms=self.aconf.expiry_bucket_ms)

    def _identity(
        self,
        source: SourceRef,
        record: dict[str, Any],
        key: bytes | None,
        value: bytes | None,
        headers: Any,
        schema: str,
    ) -> list[Emit]:
        checked = check_identity_record(record, key)
        if isinstance(checked, Rejection):
            self.identities.setdefault(str(record.get("identity_id")), None)
            return [self._quarantine(source, checked, value, key, headers, None, schema)]
        self.identities[record["identity_id"]] = checked
        self.counters.inc("validate", "identities")
        return []

    # -- assembly -----------------------------------------------------------------

    def _assemble(
        self,
        source: SourceRef,
        kind: str,
        records: list[tuple[dict[str, Any], Any]],
        now_ms: int,
        raw: tuple[Any, ...],
        *,
        run: bool = False,
    ) -> list[Emit]:
        """Apply one message's records (one, or a chunk's tokens: all or none) to their
        thread generation. ``run``: ``records`` is one ``(chunk, ChunkTokens)`` of tokens
        checked at once."""
        record = records[0][0]
        iid = instance_id(record["owner"], record["thread"], record["generation"],
                          record["identity_id"])
        hkey = header_key(iid)
        stored = self.store.get(hkey)
        if stored is None:  # a new generation: looked at again once it could be idle
            self._schedule(hkey, source.partition, now_ms + self.aconf.idle_timeout_ms)
        header = dict(stored) if stored is not None else asm.new_header(
            record, source.partition, routes_kept=self._keeps_routes(record))
        redelivered, verdict = asm.redelivered_verdict(header, kind, source.offset)
        if redelivered:
            self.counters.inc("assemble", "redelivered")
            if verdict is not None:
                return [self._quarantine(source, verdict, raw[0], raw[1], raw[2], record, raw[3])]
            # the record that completed the generation repeats its emits (lost in a crash?)
            completing = header.get("completed_by") == [kind, source.offset]
            return [Emit(*e) for e in header["outbox"]] if completing else []
        verdict = self._apply_run(header, iid, *records[0]) if run \
            else self._apply(header, iid, kind, records)
        asm.mark_handled(header, kind, source.offset, verdict, self.aconf)
        header["last_ms"] = now_ms
        emits: list[Emit] = []
        if verdict is not None:
            emits.append(self._quarantine(source, verdict, raw[0], raw[1], raw[2], record, raw[3]))
        else:
            applied = int(record["token_count"]) if run else len(records)
            self.counters.inc("assemble", f"applied_{kind}", applied)
            header["end_ms"] = asm.latest_wall_ms(header.get("end_ms"), (r for r, _ in records))
            if asm.completion(header, self.aconf, idle=False) == "complete":
                emits.extend(self._finish(iid, header, idle=False))
                header["completed_by"] = [kind, source.offset]
        self.store[hkey] = header
        return emits

    def _keeps_routes(self, record: Mapping[str, Any]) -> bool:
        keep = self.sconf is None or may_hold_out_runtime(record["owner"], record["thread"],
                                                          self.sconf)
        if not keep:
            self.counters.inc("assemble", "generations_without_route_payloads")
        return keep

    def _apply(self, header: dict[str, Any], iid: str, kind: str,
               records: list[tuple[dict[str, Any], Any]]) -> Rejection | None:
        """Apply the records to ``header`` and the store, or (on the first refusal) none."""
        if kind == "transcripts":
            return asm.apply_turn(self.store, header, iid, records[0][0])
        if len(records) == 1:
            return asm.apply_observation(self.store, header, iid, *records[0])
        staged: dict[str, Any] = {}
        trial = dict(header)
        for i, (record, routes) in enumerate(records):
            verdict = asm.apply_observation(staged, trial, iid, record, routes)
            if verdict is not None:
                return verdict._replace(detail=f"token {i} of {len(records)} of a chunk: "
                                               f"{verdict.detail}")
        header.update(trial)
        self.store.update(staged)
        return None

    def _apply_run(self, header: dict[str, Any], iid: str, chunk: dict[str, Any],
                   opened: ChunkTokens) -> Rejection | None:
        """A clean chunk's tokens as one stored run; when one of them would be refused,
        token by token for the verdict (nothing is applied then)."""
        if asm.apply_run(self.store, header, iid, chunk, opened):
            return None
        layers, stages = tuple(chunk["layers"]), tuple(chunk["stages"])
        tokens = [(record, PackedRoutes(record["expert_ids"], record["weights"], layers, stages))
                  for record in unroll(chunk, opened)]
        return self._apply(header, iid, "observations", tokens)

    def _finish(self, iid: str, header: dict[str, Any], *, idle: bool) -> list[Emit]:
        state = asm.completion(header, self.aconf, idle=idle)
        if state == "wait":
            return []
        problem: Rejection | None = None
        if state == "incomplete":
            problem = Rejection(
                "incomplete_thread",
                f"idle for {self.aconf.idle_timeout_ms} ms with turns {header['turns']} and token "
                f"ranges {header['tokens']}; a turn is missing, so no window is cut",
            )
        thread = None
        if problem is None:
            thread = asm.load_thread(self.store, iid, header)
            problem = asm.route_consistency(thread, header["gen"])
        if problem is not None or thread is None:
            emit = self._thread_quarantine(header, problem)
            header["status"] = "quarantined"
            asm.drop_content(self.store, iid, header)
        else:
            summary = asm.summarize(iid, header, thread, self.dconf)
            emit = Emit(SUMMARY, thread_key(header["owner"], header["thread"]), summary)
            header["status"] = "ready"
            self.counters.inc("assemble", "completed_idle" if idle else "completed")
        header["outbox"] = [tuple(emit)]
        return [emit]

    # -- quarantine -----------------------------------------------------------------

    def _quarantine(
        self,
        source: SourceRef,
        rejection: Rejection,
        value: bytes | None,
        key: bytes | None,
        headers: Any,
        record: Mapping[str, Any] | None = None,
        schema: str | None = None,
    ) -> Emit:
        self.counters.inc("quarantine", rejection.reason)
        rec = quarantine_record(
            source=source,
            rejection=rejection,
            value=value,
            key=key,
            headers=headers,
            record=record,
            schema=schema,
            config=self.vconf,
        )
        qkey = (
            thread_key(rec["owner"], rec["thread"])
            if rec["owner"] and rec["thread"]
            else f"{source.topic}:{source.partition}:{source.offset}"
        )
        return Emit(QUARANTINE, qkey, rec)

    def _sealing_quarantine(
        self,
        source: SourceRef,
        error: SealingError,
        value: bytes | None,
        key: bytes | None,
        headers: Any,
        record: Mapping[str, Any],
        schema: str,
    ) -> Emit:
        """A record that did not open; erased and unsealed ones keep only metadata
        (pseudonyms, generation, size and SHA-256 of the value), never the value. Ids
        that are not pseudonyms (an unsealed record's raw ids) are not copied at all."""
        named = is_pseudonym(str(record.get("owner")), OWNER) and is_pseudonym(
            str(record.get("thread")), THREAD)
        kept = {k: record.get(k) for k in ("generation", "producer_id")}
        if named:
            kept.update(owner=record["owner"], thread=record["thread"])
        emit = self._quarantine(source, Rejection(error.reason, error.detail), value,
                                key if named else None, headers, kept, schema)
        if error.reason in METADATA_ONLY_REASONS:
            emit.value.update(value=b"", value_truncated=True, reference_only=True,
                              source_headers=[])
        return emit

    def _consented(self, record: Mapping[str, Any]) -> bool:
        if self.capture_consent is None:
            return True
        return self.capture_consent(record["owner"], record["wall_time_ms"])

    def _no_consent(self, source: SourceRef, record: Mapping[str, Any],
                    value: bytes | None) -> Emit:
        """A metadata-only quarantine record: where the record is, its size and SHA-256;
        no value bytes, key, headers, owner or thread."""
        self.counters.inc("quarantine", "no_consent")
        problem = Rejection("no_consent", f"no live capture grant at wall_time_ms="
                                          f"{record['wall_time_ms']}")
        full = quarantine_record(source=source, rejection=problem, value=value,
                                 config=self.vconf)
        rec = quarantine.reference(full, "no consent: metadata only")
        return Emit(QUARANTINE, f"{source.topic}:{source.partition}:{source.offset}", rec)

    def _thread_quarantine(self, header: Mapping[str, Any], problem: Rejection | None) -> Emit:
        rejection = problem or Rejection("incomplete_thread", "thread could not be assembled")
        wm = header["wm"].get("transcripts", header["wm"].get("observations", -1))
        source = SourceRef(self.topics["transcripts"], header["partition"], wm)
        self.counters.inc("quarantine", rejection.reason)
        rec = quarantine_record(
            source=source,
            rejection=rejection,
            value=b"",
            record=header,
            stage="assemble",
            config=self.vconf,
        )
        return Emit(QUARANTINE, thread_key(header["owner"], header["thread"]), rec)


def _rejected_speculation(record: Mapping[str, Any]) -> bool:
    spec = record.get("speculative")
    return spec is not None and not spec["accepted"]
