"""Poison records: a record that crashes the streams worker N times in a row is
quarantined by reference (reason ``poison``) on the next start.

Crash-only workers (:mod:`streams.processors.crash`) never step past a record whose
processing failed, so a record that fails deterministically would stop its partition
forever. The *crash ledger* bounds that:

* When an agent crashes on a record, the crash path writes one entry to the group's
  crash ledger, a compacted topic ``<prefix><app id>-crashes-v1`` (1 partition), keyed
  ``topic|partition|offset``, whose value holds the number of crashes on that record
  (the count loaded at start plus one). The write is synchronous and bounded
  (:data:`LEDGER_FLUSH_S`); a broker that cannot take it leaves the count as it was, so
  an outage never counts towards poison. Kafka, not a local file, so a worker started
  on another machine sees the same counts.
* On start, before consuming, the worker reads the ledger and the group's committed
  offsets: an entry below its partition's committed offset was consumed since (the
  record was processed or skipped) and is deleted (a tombstone), so only crashes that
  were not followed by progress past the record count — "in a row". Entries with at
  least ``WorkerConfig.poison_after_crashes`` crashes are *poisoned*.
* An agent that reads a poisoned record does not process it: it sends a reference-only
  quarantine record (source coordinates, value size and SHA-256, reason ``poison``,
  the crash count and last error in ``detail``) and waits for its acknowledgement like
  any other output, so the record's offset is committed only after that. Its
  ``quarantine_id`` depends only on the source coordinates, so a repeat after another
  crash is the same record (``flywheel streams inspect`` counts it once). The capture
  topic still holds the original.

Limits: a crash whose record is unknown (a timer, the consumer loop) is not counted.
Each worker counts from the ledger it loaded at start, so with several workers of one
group crashing on the same record concurrently a count can be lower than the crashes
(never higher): poisoning then takes more restarts, it never comes early. A crash
caused by the infrastructure with the broker still writable (a quarantine topic that
refuses every record) counts too; the record stays on the capture topic.

Test-only fault injection: ``FLYWHEEL_STREAMS_FAULT=crash_on_key:<key>`` makes the
capture agent raise on every capture record whose Kafka key is ``<key>`` (a record that
deterministically crashes the worker). Unset, it costs one dictionary look-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from hebrus_flywheel.core import kafka
from hebrus_flywheel.streams import quarantine
from hebrus_flywheel.streams.processors.capture import QUARANTINE, Emit

log = logging.getLogger(__name__)
POISON = "poison"
LEDGER_FLUSH_S = 10.0
FAULT_ENV = "FLYWHEEL_STREAMS_FAULT"
Coordinates = tuple[str, int, int]


class InjectedFault(RuntimeError):
    """Raised by :func:`injected_fault` (tests only)."""


def injected_fault(key: bytes | None) -> None:
    """Raise :class:`InjectedFault` when ``FLYWHEEL_STREAMS_FAULT`` is
    ``crash_on_key:<key>`` and ``key`` is that key."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, _, target = spec.partition(":")
    if kind == "crash_on_key" and key is not None and key == target.encode():
        raise InjectedFault(f"fault injection ({FAULT_ENV}={spec}): crash on key {target!r}")


def ledger_key(where: Coordinates) -> bytes:
    return "|".join(map(str, where)).encode()


def _parse_key(raw: bytes | None) -> Coordinates | None:
    topic, _, rest = (raw or b"").decode("utf-8", "replace").rpartition("|")
    topic, _, partition = topic.rpartition("|")
    try:
        return topic, int(partition), int(rest)
    except ValueError:
        return None


class CrashLedger:
    """The group's crash counts per record, loaded at start and bumped on a crash."""

    def __init__(self, *, bootstrap: str, topic: str, group: str, threshold: int) -> None:
        self.config = kafka.client_config(bootstrap)
        self.topic, self.group, self.threshold = topic, group, threshold
        self.counts: dict[Coordinates, dict[str, Any]] = {}
        self._producer: Any = None

    def load(self, *, timeout_s: float = 30.0) -> None:
        """Read the ledger to its end and drop entries the group has consumed past."""
        for msg in kafka.read_to_end(self.config, [self.topic], timeout_s=timeout_s,
                                     missing_ok=True):
            where = _parse_key(msg.key())
            if where is None:
                continue
            value = msg.value()
            if value:
                self.counts[where] = json.loads(value)
            else:
                self.counts.pop(where, None)
        self._producer = kafka.make_producer(self.config)
        self._forget_consumed(timeout_s)
        for where, entry in sorted(self.poisoned().items()):
            log.warning("poison record %s[%d]@%d crashed the worker %d times (last: %s); it "
                        "will be quarantined by reference as %s", *where, entry["crashes"],
                        entry.get("error", "?"), POISON)

    def _forget_consumed(self, timeout_s: float) -> None:
        tps = sorted({(t, p) for t, p, _ in self.counts})
        if not tps:
            return
        done = kafka.committed_offsets(self.config, self.group, tps, timeout_s=timeout_s)
        stale = [w for w in self.counts if w[2] < done.get((w[0], w[1]), -1)]
        for where in stale:
            del self.counts[where]
            self._producer.produce(self.topic, key=ledger_key(where), value=None)
        if stale and self._producer.flush(timeout_s) > 0:
            log.warning("crash ledger: %d stale entries not deleted yet", len(stale))

    def poisoned(self) -> dict[Coordinates, dict[str, Any]]:
        return {w: e for w, e in self.counts.items() if int(e["crashes"]) >= self.threshold}

    def entry(self, where: Coordinates) -> dict[str, Any] | None:
        """The ledger entry of a poisoned record, None for any other."""
        found = self.counts.get(where)
        return found if found is not None and int(found["crashes"]) >= self.threshold else None

    def record_crash(self, where: Coordinates, error: str) -> int:
        """Count one more crash on ``where``, durably (bounded wait); the new count, or
        0 when the ledger could not be written."""
        crashes = int((self.counts.get(where) or {}).get("crashes", 0)) + 1
        value = {"topic": where[0], "partition": where[1], "offset": where[2],
                 "crashes": crashes, "error": error[:1024], "at_ms": int(time.time() * 1000)}
        if self._producer is None:
            return 0
        try:
            self._producer.produce(self.topic, key=ledger_key(where),
                                   value=json.dumps(value).encode())
            if self._producer.flush(LEDGER_FLUSH_S) > 0:
                return 0
        except Exception:  # the crash path must end the process whatever happens here
            log.exception("crash ledger: cannot record the crash on %s", where)
            return 0
        self.counts[where] = value
        return crashes


def poison_emit(where: Coordinates, value: bytes | None, entry: Mapping[str, Any],
                threshold: int) -> Emit:
    """The reference-only quarantine record of a poisoned record."""
    raw = bytes(value or b"")
    ident = "|".join(("validate", POISON, *map(str, where)))
    record = {
        "quarantine_id": hashlib.sha256(ident.encode()).hexdigest(),
        "reason": POISON, "stage": "validate",
        "source_topic": where[0], "source_partition": where[1], "source_offset": where[2],
        "value_size": len(raw), "value_sha256": hashlib.sha256(raw).hexdigest(),
        "detail": (f"crashed the streams worker {entry['crashes']} times in a row "
                   f"(threshold {threshold}); last error: {entry.get('error', '?')}"),
    }
    rec = quarantine.reference(record, f"{POISON}: the record itself is not processed")
    return Emit(QUARANTINE, ":".join(map(str, where)), rec)

