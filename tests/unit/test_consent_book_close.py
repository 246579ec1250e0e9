"""A closed ConsentBook stops its refresher promptly, even while a read is retrying.

No broker runs here: the book points at a local port nothing listens on, so every
read fails with a retriable transport error and goes into back-off.
"""

from __future__ import annotations

import logging
import time

import pytest

from hebrus_flywheel.core.kafka import KafkaClientConfig, RetryPolicy
from hebrus_flywheel.streams.consent_book import ConsentBook
from hebrus_flywheel.streams.exceptions import ConsentError
from tests.support.ports import free_port


def _book(**kwargs: float) -> ConsentBook:
    retry = RetryPolicy(attempts=8, backoff_s=2.0, max_backoff_s=5.0)
    config = KafkaClientConfig(bootstrap_servers=f"127.0.0.1:{free_port()}", retry=retry)
    return ConsentBook(bootstrap=config, timeout_s=1.0, **kwargs)


def test_close_ends_the_refresher_mid_retry_without_a_warning_after_close(
        caplog: pytest.LogCaptureFixture) -> None:
    book = _book(max_age_s=0.2)
    book.start_refresher()
    deadline = time.monotonic() + 30
    while not any("retrying" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the refresher never reached a retry"
        time.sleep(0.05)
    book.close()
    closed_at = len(caplog.records)
    assert book._refresher is not None
    book._refresher.join(timeout=10)
    assert not book._refresher.is_alive()
    late = [r.getMessage() for r in caplog.records[closed_at:] if r.levelno >= logging.WARNING]
    assert not [m for m in late if "refresh failed" in m]


def test_a_read_on_a_closed_book_fails_closed() -> None:
    book = _book()
    book.close()
    with pytest.raises(ConsentError, match="closed"):
        book.allows("owner-a", "capture", 0)
