"""The consent ledger read from Kafka, and the one writer of ledger entries.

:class:`ConsentBook` reads the compacted consent topic to its end when loaded, then
incrementally (only records past what it has read). It refreshes before answering
when its view is older than ``max_age_s`` (so a revoke or an expiry reaches a running
stage within that time), and once per ``refresh_interval_s`` per owner it does not
allow (so a grant written just before an owner's first record is seen). Every reading
role may read the topic (``streams.acls``); a missing topic or a refused read raises
:class:`ConsentError`: no ledger means no consent, never "allow".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from hebrus_flywheel.core import kafka
from hebrus_flywheel.streams.consent import CONSENT_TOPIC, Consent, ConsentCheck, ConsentLedger
from hebrus_flywheel.streams.exceptions import ConsentError

log = logging.getLogger(__name__)
_LOG = "streams.consent.librdkafka"


class ConsentBook:
    """``allows(owner, scope, at_ms)`` over the consent topic (see module doc)."""

    def __init__(self, *, bootstrap: kafka.KafkaTarget, topic: str = CONSENT_TOPIC,
                 max_age_s: float = 5.0, refresh_interval_s: float = 2.0,
                 timeout_s: float = 15.0) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.max_age_s = max_age_s
        self.refresh_interval_s = refresh_interval_s
        self.timeout_s = timeout_s
        self.ledger = ConsentLedger()
        self._next: dict[tuple[str, int], int] = {}
        self._loaded_at = -1e18
        self._misses: dict[str, float] = {}
        self._load_lock = threading.Lock()  # one reader at a time: records apply in order
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def load(self) -> int:
        """Read the topic from where this book stopped to its current end; returns how
        many records were read."""
        with self._load_lock:
            return self._load()

    def start_refresher(self) -> None:
        """Refresh from a daemon thread every ``max_age_s / 2``, so that :meth:`allows`
        on a hot path (the runtime publisher) rarely waits for a read; a failed refresh
        is logged and leaves the view stale, so the next :meth:`allows` reads (or fails)
        itself. :meth:`close` stops it."""
        def run() -> None:
            while not self._stop.wait(self.max_age_s / 2):
                try:
                    self.load()
                except ConsentError as exc:
                    if not self._stop.is_set():
                        log.warning("consent ledger refresh failed: %s", exc)
        self._refresher = threading.Thread(target=run, name="consent-refresh", daemon=True)
        self._refresher.start()

    def close(self) -> None:
        """Stop the refresher; a read that is retrying gives up at its next back-off (a
        closed publisher must not go on calling an unreachable broker for minutes)."""
        self._stop.set()

    def _pause(self, delay_s: float) -> None:
        """The retry back-off of this book's reads: cut short, with an error, by close."""
        if self._stop.wait(delay_s):
            raise ConsentError(f"the consent book of {self.topic} was closed during a retry")

    def _load(self) -> int:
        config = kafka.client_config(self.bootstrap)
        config = dataclasses.replace(config, retry=dataclasses.replace(config.retry,
                                                                       sleep=self._pause))
        try:
            ends = kafka.end_watermarks(config, [self.topic], timeout_s=self.timeout_s,
                                        log_name=_LOG)
            ranges = {tp: (max(low, self._next.get(tp, low)), high)
                      for tp, (low, high) in ends.items()}
            read = 0
            for msg in kafka.read_ranges(config, ranges, timeout_s=self.timeout_s,
                                         what=f"reading the consent ledger {self.topic}",
                                         log_name=_LOG):
                self.ledger.apply(msg.key(), msg.value())
                read += 1
        except kafka.MissingTopicError as exc:
            raise ConsentError(f"the consent ledger {self.topic} does not exist; create the "
                               "topics (`flywheel topics create`) and grant consent "
                               "(`flywheel consent grant`)") from exc
        except kafka.KafkaIOError as exc:
            raise ConsentError(f"cannot read the consent ledger {self.topic} on "
                               f"{_where(self.bootstrap)}: {exc}") from exc
        self._next.update({tp: high for tp, (_, high) in ranges.items()})
        self._loaded_at = time.monotonic()
        return read

    def allows(self, owner: str, scope: str, at_ms: int) -> bool:
        now = time.monotonic()
        if now - self._loaded_at >= self.max_age_s:
            self.load()
        if self.ledger.allows(owner, scope, at_ms):
            return True
        if now - self._misses.get(owner, -1e18) >= self.refresh_interval_s:
            self._misses[owner] = now
            self.load()
            return self.ledger.allows(owner, scope, at_ms)
        return False

    def get(self, owner: str) -> Consent | None:
        return self.ledger.get(owner)


def write_entries(target: kafka.KafkaTarget, entries: list[Consent], *,
                  topic: str = CONSENT_TOPIC, timeout_s: float = 30.0) -> None:
    """Append ledger entries (keyed by owner) and wait until the broker has them all."""
    producer = kafka.CheckedProducer(kafka.client_config(target), log_name=_LOG)
    try:
        for entry in entries:
            producer.produce(topic, entry.encode(), key=entry.owner.encode())
        producer.flush(timeout_s, what=f"consent entries for {topic}")
    except kafka.KafkaIOError as exc:
        raise ConsentError(f"cannot write the consent ledger {topic} on {_where(target)}: "
                           f"{exc}; only the admin role may write it") from exc


def _where(target: kafka.KafkaTarget) -> str:
    return target if isinstance(target, str) else target.bootstrap_servers


class CaptureGate:
    """The runtime publisher's consent check: thread-safe and fail closed. A ledger that
    cannot be read refuses every record, and is retried after ``retry_s`` (so a broker
    outage does not block every publish call for the read timeout)."""

    def __init__(self, consent: ConsentCheck, *, retry_s: float = 5.0) -> None:
        self.consent = consent
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._down_until = 0.0
        if isinstance(consent, ConsentBook):
            consent.start_refresher()

    def close(self) -> None:
        if isinstance(self.consent, ConsentBook):
            self.consent.close()

    def allows(self, owner: str, at_ms: int) -> bool:
        with self._lock:
            if time.monotonic() < self._down_until:
                return False
            try:
                return self.consent.allows(owner, "capture", at_ms)
            except ConsentError as exc:
                self._down_until = time.monotonic() + self.retry_s
                log.warning("consent ledger unreadable, refusing capture for %.0fs: %s",
                            self.retry_s, exc)
                return False


def capture_gate(consent: ConsentCheck | None, *, enabled: bool, bootstrap: kafka.KafkaTarget,
                 topic: str, who: str) -> CaptureGate | None:
    """The gate of a publisher: ``consent`` or a :class:`ConsentBook` over ``topic``;
    None, with a loud warning, when ``enabled`` is False (tests and benchmarks only)."""
    if not enabled:
        log.warning("%s runs WITHOUT the consent check (consent_check=False): records are "
                    "published whatever the consent ledger says; tests and benchmarks only",
                    who)
        return None
    return CaptureGate(consent if consent is not None else
                       ConsentBook(bootstrap=bootstrap, topic=topic))
