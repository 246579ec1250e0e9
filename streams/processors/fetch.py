"""The worker's consumer: faust's aiokafka consumer with a short broker-side fetch wait.

faust builds its aiokafka consumer with ``fetch_max_wait_ms=1500``, a constant. aiokafka
keeps at most one fetch request in flight per broker, and leaves a partition out of the
next request while records it fetched earlier are still waiting to be consumed; once
they have waited ``prefetch_backoff`` (0.1 s), it sends the next request with the other
partitions only. A worker that is busy with one fetch for longer than that (every
worker draining a backlog is) therefore asks the broker for its *idle* partitions
(ticks, standby changelogs, an empty decisions partition): the broker holds such a
request until data arrives or the wait runs out, and until it answers, the busy
partitions cannot be fetched again. The worker's capture then advances in bursts, up
to 1.5 s apart; with a standby replica, the worker holding it advanced about every
other second (``bench/streams.py``, 2026-12-05).

:data:`FETCH_MAX_WAIT_MS` bounds that stall. The price is an empty fetch request per
broker every :data:`FETCH_MAX_WAIT_MS` while the worker is idle.
"""

from __future__ import annotations

from typing import Any

import faust
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.transport.drivers.aiokafka import Transport as AIOKafkaTransport

from hebrus_flywheel.streams.processors.exceptions import WorkerError

FETCH_MAX_WAIT_MS = 100
"""Longest the broker holds a fetch of partitions without data (faust's constant: 1500)."""


class PromptConsumerThread(AIOKafkaConsumerThread):
    """faust's consumer thread whose aiokafka consumer waits at most
    :data:`FETCH_MAX_WAIT_MS` for a fetch."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # aiokafka reads it when the consumer starts (its Fetcher is built in start())
        if not isinstance(getattr(consumer, "_fetch_max_wait_ms", None), int):
            raise WorkerError("aiokafka's consumer no longer keeps _fetch_max_wait_ms: "
                              "streams.processors.fetch must follow the installed aiokafka")
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


class PromptConsumer(AIOKafkaConsumer):
    def _new_consumer_thread(self) -> PromptConsumerThread:
        return PromptConsumerThread(self, loop=self.loop, beacon=self.beacon)


class PromptTransport(AIOKafkaTransport):
    Consumer = PromptConsumer


class WorkerApp(faust.App):
    """The worker's ``faust.App``: consumes through :class:`PromptConsumer`."""

    def _new_transport(self) -> PromptTransport:
        return PromptTransport(self.conf.broker_consumer, self)
