"""Kafka reads and writes with one error discipline.

* Produce: every record gets a delivery callback, the producer is polled after each
  produce, and ``flush`` raises :class:`DeliveryError` listing what failed.
* Read to the end: the end offsets are taken when the read starts; a read that cannot
  reach them raises :class:`ReadIncompleteError`, never returns what it had so far.
* Every request goes through the config's :class:`RetryPolicy`, and every message error
  is looked at: ``_PARTITION_EOF`` is the end signal, retriable ones are retried, the
  rest raise with topic, partition and offset.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from typing import Any, Literal

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from hebrus_flywheel.core.kafka.clients import LIBRDKAFKA_LOG, make_consumer, make_producer
from hebrus_flywheel.core.kafka.config import KafkaClientConfig
from hebrus_flywheel.core.kafka.errors import (
    DeliveryError,
    KafkaIOError,
    MissingTopicError,
    NotAuthorizedError,
    ReadIncompleteError,
)
from hebrus_flywheel.core.kafka.retry import RetryPolicy, describe, is_retriable, kafka_error
from hebrus_flywheel.core.kafka.security import current_role

TP = tuple[str, int]
MessageKind = Literal["data", "eof", "retry"]


def _raise_partition_errors(tps: Iterable[TopicPartition]) -> None:
    for tp in tps:
        if tp.error is not None:
            # A KafkaException lets the retry policy decide, like a whole-request error.
            raise KafkaException(tp.error)


def _io_error(what: str, exc: KafkaException) -> KafkaIOError:
    err = kafka_error(exc)
    detail = describe(err) if err is not None else str(exc)
    return KafkaIOError(f"{what} failed: {detail}; check that the broker is up (`flywheel "
                        "broker status`) and that the Kafka config grants access")


class MessageCheck:
    """Classifies polled messages; consecutive retriable errors share one retry budget."""

    def __init__(self, retry: RetryPolicy, what: str) -> None:
        self.retry, self.what, self._retries = retry, what, 0

    def check(self, msg: Message) -> MessageKind:
        err = msg.error()
        if err is None:
            self._retries = 0
            return "data"
        if err.code() == KafkaError._PARTITION_EOF:
            return "eof"
        where = f"{self.what} at {msg.topic()}[{msg.partition()}]@{msg.offset()}"
        if is_retriable(err):
            self._retries += 1
            if self._retries >= self.retry.attempts:
                raise self.retry.give_up(where, err)
            self.retry.wait(self._retries, where, err)
            return "retry"
        raise KafkaIOError(f"{where}: Kafka error {describe(err)}"
                           f"{' (fatal)' if err.fatal() else ''}; fix the cause and run again")


def partitions_of(consumer: Any, topic: str, *, retry: RetryPolicy,
                  timeout_s: float) -> list[int] | None:
    """Sorted partition ids of ``topic``; None when it does not exist."""
    meta = retry.call(lambda: consumer.list_topics(topic, timeout=timeout_s),
                      what=f"metadata of {topic}").topics.get(topic)
    if meta is not None and meta.error is not None and \
            meta.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        raise NotAuthorizedError(
            f"the Kafka principal of this process ({current_role()} unless --kafka-config "
            f"names another) may not describe topic {topic}; use the role that owns this "
            "step or grant it the topic (streams/acls.py)")
    if meta is None or meta.error is not None or not meta.partitions:
        return None
    return sorted(meta.partitions)


def watermarks(consumer: Any, topics: Iterable[str], *, retry: RetryPolicy, timeout_s: float,
               missing_ok: bool = False) -> dict[TP, tuple[int, int]]:
    """(low, high) watermark of every partition of ``topics``; a missing topic raises
    :class:`MissingTopicError` unless ``missing_ok`` (then it is left out)."""
    out: dict[TP, tuple[int, int]] = {}
    for topic in topics:
        parts = partitions_of(consumer, topic, retry=retry, timeout_s=timeout_s)
        if parts is None:
            if missing_ok:
                continue
            raise MissingTopicError(f"topic {topic} does not exist; create the catalogue "
                                    "(`flywheel topics create`) or fix --prefix")
        for p in parts:
            out[(topic, p)] = retry.call(
                partial(consumer.get_watermark_offsets, TopicPartition(topic, p),
                        timeout=timeout_s), what=f"offsets of {topic}[{p}]")
    return out


def committed(consumer: Any, partitions: Iterable[TP], *, retry: RetryPolicy,
              timeout_s: float, group_id: str) -> dict[TP, int]:
    """The group's committed offset per partition; -1 where none is committed."""
    tps = [TopicPartition(t, p) for t, p in partitions]
    if not tps:
        return {}

    def attempt() -> list[TopicPartition]:
        got = consumer.committed(tps, timeout=timeout_s)
        _raise_partition_errors(got)
        return list(got)

    got = retry.call(attempt, what=f"committed offsets of group {group_id}")
    return {(tp.topic, tp.partition): tp.offset if tp.offset >= 0 else -1 for tp in got}


def drain(consumer: Any, ends: Mapping[TP, int], *, retry: RetryPolicy, timeout_s: float,
          what: str) -> Iterator[Message]:
    """Poll an assigned consumer until each partition reaches its end offset, yielding the
    messages below it. ``timeout_s`` bounds the wait for progress; past it
    :class:`ReadIncompleteError` says which partitions stopped where."""
    pending = dict(ends)
    # A previous drain on the same consumer paused the partitions it finished.
    consumer.resume([TopicPartition(t, p) for t, p in pending])
    reached: dict[TP, int] = {}
    check = MessageCheck(retry, what)
    last_progress = time.monotonic()
    while pending:
        if time.monotonic() - last_progress > timeout_s:
            raise ReadIncompleteError(
                f"{what}: no progress for {timeout_s:.0f}s; unfinished "
                + ", ".join(f"{t}[{p}] at {reached.get((t, p), '?')} of end {e}"
                            for (t, p), e in sorted(pending.items()))
                + "; the topic was truncated, is not readable, or the broker is unreachable")
        msg = consumer.poll(0.2)
        if msg is None or check.check(msg) == "retry":
            continue
        key, offset = (str(msg.topic()), int(msg.partition() or 0)), msg.offset()
        if key not in pending or offset is None:
            continue
        last_progress = time.monotonic()
        reached[key] = offset if msg.error() else offset + 1
        if msg.error() is None and offset < pending[key]:
            yield msg
        # Offsets arrive in order; at or past the end nothing below it is left (the
        # records just below it may be compacted away or be transaction markers).
        if reached[key] >= pending[key]:
            del pending[key]
            consumer.pause([TopicPartition(*key)])


def read_ranges(config: KafkaClientConfig, ranges: Mapping[TP, tuple[int, int]], *,
                timeout_s: float = 120.0, what: str = "reading offset ranges",
                log_name: str = LIBRDKAFKA_LOG) -> Iterator[Message]:
    """Every message with ``start <= offset < end`` per (topic, partition); messages of
    different partitions interleave."""
    pending = {tp: r for tp, r in ranges.items() if r[1] > r[0]}
    if not pending:
        return
    consumer = make_consumer(config, log_name=log_name)
    try:
        consumer.assign([TopicPartition(t, p, start) for (t, p), (start, _) in pending.items()])
        yield from drain(consumer, {tp: end for tp, (_, end) in pending.items()},
                         retry=config.retry, timeout_s=timeout_s, what=what)
    except KafkaException as exc:
        raise _io_error(what, exc) from exc
    finally:
        consumer.close()


def read_to_end(config: KafkaClientConfig, topics: Iterable[str], *, timeout_s: float = 30.0,
                missing_ok: bool = False, log_name: str = LIBRDKAFKA_LOG) -> Iterator[Message]:
    """Every message of ``topics`` up to their end offsets at the start of the read."""
    topics = list(topics)
    what = f"reading {', '.join(topics)} to its end"
    ranges = {tp: (low, high) for tp, (low, high) in
              end_watermarks(config, topics, timeout_s=timeout_s, missing_ok=missing_ok,
                             log_name=log_name).items()}
    yield from read_ranges(config, ranges, timeout_s=timeout_s, what=what, log_name=log_name)


def end_watermarks(config: KafkaClientConfig, topics: Iterable[str], *,
                   timeout_s: float = 15.0, missing_ok: bool = False,
                   log_name: str = LIBRDKAFKA_LOG) -> dict[TP, tuple[int, int]]:
    """:func:`watermarks` with a throw-away consumer."""
    topics = list(topics)
    consumer = make_consumer(config, log_name=log_name)
    try:
        return watermarks(consumer, topics, retry=config.retry, timeout_s=timeout_s,
                          missing_ok=missing_ok)
    except KafkaException as exc:
        raise _io_error(f"reading the offsets of {', '.join(topics)}", exc) from exc
    finally:
        consumer.close()


def committed_offsets(config: KafkaClientConfig, group_id: str, partitions: Iterable[TP], *,
                      timeout_s: float = 15.0, log_name: str = LIBRDKAFKA_LOG) -> dict[TP, int]:
    """:func:`committed` with a consumer of ``group_id`` that never joins the group."""
    consumer = make_consumer(config, group_id=group_id, log_name=log_name)
    try:
        return committed(consumer, partitions, retry=config.retry, timeout_s=timeout_s,
                         group_id=group_id)
    except KafkaException as exc:
        raise _io_error(f"reading the committed offsets of group {group_id}", exc) from exc
    finally:
        consumer.close()


class CheckedProducer:
    """A producer whose every record's delivery is checked at :meth:`flush`."""

    def __init__(self, config: KafkaClientConfig, *, settings: Mapping[str, Any] | None = None,
                 log_name: str = LIBRDKAFKA_LOG) -> None:
        self.producer = make_producer(config, settings=settings, log_name=log_name)
        self.failures: list[str] = []

    def produce(self, topic: str, value: bytes | None, *, key: bytes | None = None,
                headers: Any = None) -> None:
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers,
                                      on_delivery=self._on_delivery)
                break
            except BufferError:
                self.producer.poll(0.1)  # local queue full: serve reports to make room
            except KafkaException as exc:
                raise _io_error(f"enqueueing a record for {topic}", exc) from exc
        self.producer.poll(0)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self.failures.append(f"{msg.topic()}[{msg.partition()}] key={msg.key()!r}: "
                                 f"{describe(err)}")

    def flush(self, timeout_s: float, *, what: str = "records") -> None:
        """Wait for every delivery report; raise :class:`DeliveryError` if any failed or
        is still outstanding after ``timeout_s``."""
        left = self.producer.flush(timeout_s)
        failures, self.failures = self.failures, []
        if left or failures:
            shown = "; ".join(failures[:5]) + (f" (+{len(failures) - 5} more)"
                                                if len(failures) > 5 else "")
            raise DeliveryError(
                f"{what} were not all acknowledged: {len(failures)} failed"
                f"{': ' + shown if shown else ''}, {left} still unacknowledged after "
                f"{timeout_s:.0f}s; check the broker and the topic, then retry")

    def close(self, timeout_s: float) -> int:
        """Flush without raising (for shutdown paths); returns undelivered records."""
        return int(self.producer.flush(timeout_s))
