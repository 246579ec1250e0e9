"""The worker's consumer asks the broker to hold a fetch briefly (streams.processors.fetch)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hebrus_flywheel.streams.processors import fetch
from hebrus_flywheel.streams.processors.exceptions import WorkerError
from hebrus_flywheel.streams.processors.fetch import FETCH_MAX_WAIT_MS, WorkerApp


def _fetch_wait_ms(tmp_path: Path) -> int:
    """The fetch wait of the aiokafka consumer a worker app builds (never started)."""
    async def build() -> int:  # aiokafka's client wants a running loop
        app = WorkerApp("fetch-test", broker="kafka://127.0.0.1:9", web_enabled=False,
                        datadir=str(tmp_path))
        thread = app.consumer._thread
        assert isinstance(thread, fetch.PromptConsumerThread)
        consumer = thread._create_worker_consumer(app.transport)
        try:
            return int(consumer._fetch_max_wait_ms)
        finally:
            await consumer.stop()

    return asyncio.run(build())


def test_worker_consumer_waits_briefly_for_idle_partitions(tmp_path: Path) -> None:
    assert _fetch_wait_ms(tmp_path) == FETCH_MAX_WAIT_MS
    assert FETCH_MAX_WAIT_MS < 1500  # faust's constant, the stall this bounds


def test_an_aiokafka_without_the_setting_is_refused(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real = fetch.AIOKafkaConsumerThread._create_worker_consumer

    def without_setting(self: object, transport: object) -> object:
        consumer = real(self, transport)
        del consumer._fetch_max_wait_ms
        return consumer

    monkeypatch.setattr(fetch.AIOKafkaConsumerThread, "_create_worker_consumer",
                        without_setting)
    with pytest.raises(WorkerError, match="_fetch_max_wait_ms"):
        _fetch_wait_ms(tmp_path)
