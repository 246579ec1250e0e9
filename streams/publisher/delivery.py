"""The publisher's background side: the drain thread, delivery reports and counters.

:class:`ProducerSide` is mixed into :class:`~streams.publisher.runtime.RuntimePublisher`;
it expects the attributes that class sets up (``_queue``, ``_producer``, ``_abort``,
``_stats_lock``, ``_counts``, ``_rejected``, ``_by_topic``, ``_first_error``,
``_fatal``, ``_last_warning``) and the hook ``_flush_due_chunks`` the idle loop calls so
an open chunk is published ``chunk_max_ms`` after its first token even when the caller
publishes nothing more.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

from confluent_kafka import KafkaError, KafkaException, Message, Producer

if TYPE_CHECKING:
    from confluent_kafka._types import HeadersType

log = logging.getLogger("hebrus_flywheel.streams.publisher")
IDLE_POLL_S = 0.02
BUFFER_RETRY_S = 0.05


class Item(NamedTuple):
    """One encoded record on the in-process queue; ``tokens``: observations it carries."""

    topic: str
    key: bytes
    value: bytes
    headers: HeadersType
    tokens: int = 1


class ProducerSide:
    """Drain thread, librdkafka callbacks and counters (see the module docstring)."""

    _queue: queue.Queue[Item]
    _producer: Producer
    _abort: threading.Event
    _stats_lock: threading.Lock
    _counts: Counter[str]
    _rejected: Counter[str]
    _by_topic: Counter[tuple[str, str]]
    _first_error: str | None
    _fatal: KafkaError | None
    _last_warning: float

    def _flush_due_chunks(self) -> None:  # pragma: no cover - overridden
        """Publish open chunks that are due (the publisher overrides this)."""

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                self._flush_due_chunks()
                self._producer.poll(0)
                if self._abort.is_set():
                    return
                continue
            try:
                if self._abort.is_set():
                    self._bump("dropped_on_close")
                else:
                    self._send(item)
            except Exception as exc:  # one bad record must not stop the drain thread
                self._record_failure(item.topic, f"unexpected: {exc!r}")
                log.exception("publisher thread failed on a record for %s", item.topic)
            finally:
                self._queue.task_done()
            self._producer.poll(0)

    def _send(self, item: Item) -> None:
        while True:
            try:
                self._producer.produce(item.topic, item.value, item.key, headers=item.headers,
                                       on_delivery=self._on_delivery)
                return
            except BufferError:
                if self._abort.is_set():
                    self._bump("dropped_on_close")
                    return
                self._producer.poll(BUFFER_RETRY_S)
            except KafkaException as exc:
                self._record_failure(item.topic, f"produce: {exc}")
                return

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        topic = msg.topic() or "?"
        if err is not None:
            self._record_failure(topic, f"delivery: {err}")
            return
        size = len(msg.value() or b"") + len(msg.key() or b"") + _headers_size(msg.headers())
        with self._stats_lock:
            self._counts["delivered"] += 1
            self._by_topic["delivered", topic] += 1
            self._by_topic["bytes", topic] += size

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = err
            self._record_failure("", f"fatal: {err}", count=False)
            log.error("Kafka producer fatal error: %s; the publisher refuses further records",
                      err)
            return
        self._warn_throttled("Kafka producer error (librdkafka keeps retrying): %s", err)

    # -- counters -----------------------------------------------------------------

    def _bump(self, name: str) -> None:
        with self._stats_lock:
            self._counts[name] += 1

    def _count_rejected(self, reason: str) -> None:
        with self._stats_lock:
            self._rejected[reason] += 1

    def _record_failure(self, topic: str, message: str, *, count: bool = True) -> None:
        with self._stats_lock:
            if count:
                self._counts["failed"] += 1
                self._by_topic["failed", topic] += 1
            if self._first_error is None:
                self._first_error = f"{topic}: {message}" if topic else message

    def _topic_counts(self, name: str) -> dict[str, int]:
        return {topic: n for (kind, topic), n in self._by_topic.items() if kind == name}

    def _warn_throttled(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning(fmt, *args)



def _headers_size(headers: HeadersType | None) -> int:
    pairs = headers.items() if isinstance(headers, dict) else headers or ()
    return sum(len(name) + len(value or b"") for name, value in pairs)
