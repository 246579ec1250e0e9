"""An identity that lands on its topic just after the first record naming it.

Kafka does not order writes across topics: a producer that enqueues a RuntimeIdentity and
then a full batch of transcripts may have the transcripts appended first. The stream
worker's identity book then misses the identity on its first re-read; it must wait for
it (``grace_s``) instead of calling it unknown, which quarantined those records as
``unknown_identity`` and stalled ``bench/transport.py``'s worker leg.
"""

from __future__ import annotations

import threading

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.identities import IdentityBook
from tests.integration.conftest import TopicFactory
from tests.support.streams_harness import producer
from tests.support.streams_synthetic import encode_message, identity_message, make_identity

pytestmark = [pytest.mark.integration]

IDENTITY = make_identity(layers=4, experts=64, top_k=4)
LATE_S = 0.5  # how long after the miss the identity is written


def _publish_later(bootstrap: str, topic: str) -> threading.Thread:
    kind, key, record = identity_message(IDENTITY)
    value, headers = encode_message(kind, record)

    def write() -> None:
        prod = producer(bootstrap)
        prod.produce(topic, key=key, value=value, headers=list(headers))
        prod.flush(30)

    return threading.Timer(LATE_S, write)


def _book(bootstrap: str, topic: str, grace_s: float) -> IdentityBook:
    book = IdentityBook(bootstrap=bootstrap, topic=topic, grace_s=grace_s)
    assert book.load() == 0  # the worker starts before the identity exists
    return book


def test_identity_written_after_the_miss_is_waited_for(topic_factory: TopicFactory) -> None:
    topic = topic_factory("identities")
    book = _book(topic_factory.bootstrap, topic, grace_s=10.0)
    late = _publish_later(topic_factory.bootstrap, topic)
    late.start()
    book.resolve(IDENTITY["identity_id"])
    late.join()
    assert book.identities.get(IDENTITY["identity_id"]) is not None


def test_without_grace_the_late_identity_is_missed(topic_factory: TopicFactory) -> None:
    """The race itself: one re-read before the identity lands finds nothing."""
    topic = topic_factory("identities")
    book = _book(topic_factory.bootstrap, topic, grace_s=0.0)
    late = _publish_later(topic_factory.bootstrap, topic)
    late.start()
    book.resolve(IDENTITY["identity_id"])
    missed = IDENTITY["identity_id"] not in book.identities
    late.join()
    assert missed
    book.resolve(IDENTITY["identity_id"])  # rate-limited: no re-read within the interval
    assert IDENTITY["identity_id"] not in book.identities


def test_a_made_up_identity_waits_once_per_interval(topic_factory: TopicFactory) -> None:
    topic = topic_factory("identities")
    book = _book(topic_factory.bootstrap, topic, grace_s=0.6)
    reads = 0
    load = book.load

    def counting_load() -> int:
        nonlocal reads
        reads += 1
        return load()

    book.load = counting_load  # type: ignore[method-assign]
    book.resolve("a" * 64)
    waited = reads
    book.resolve("b" * 64)  # another unknown id within the interval: one re-read, no wait
    assert waited > 1 and reads == waited + 1
    assert "a" * 64 not in book.identities and "b" * 64 not in book.identities


def test_identity_book_refuses_bad_timings() -> None:
    with pytest.raises(ConfigError, match=r"IdentityBook\.grace_s"):
        IdentityBook(bootstrap="127.0.0.1:1", topic="t", grace_s=-1.0)
    with pytest.raises(ConfigError, match=r"IdentityBook\.grace_poll_s"):
        IdentityBook(bootstrap="127.0.0.1:1", topic="t", grace_poll_s=0.0)
