"""The faust floor: how fast a faust agent that does nothing drains a capture backlog.

Run by ``bench/streams.py`` (figure ``faust_passthrough_observations_per_s``) on the
capture topics its worker figures read, as the streams role, in a process of its own:
one faust app (the worker's ``WorkerApp``, consumer, broker settings and event loop) whose
one agent takes the capture records in the worker's batches and only counts them. It
reads the capture topics as the worker does, through librdkafka
(``streams.processors.fetch``); ``--capture-through aiokafka`` reads them through faust's
aiokafka consumer, as workers did before 2026-12-06
(``faust_aiokafka_passthrough_observations_per_s``). No worker built on
faust can read these records faster on this machine, so the figure bounds
``faust_worker_observations_per_s`` from above, measured in the same run.

Prints one JSON line (records, bytes, seconds from the first record to the last, CPU
seconds of this process) and exits once ``--records`` records were read.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any

import faust

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.settings import bootstrap_servers, flywheel_home
from hebrus_flywheel.streams.processors.batches import batches
from hebrus_flywheel.streams.processors.event_loop import (
    DEFAULT_EVENT_LOOP,
    EVENT_LOOPS,
    use_event_loop,
)
from hebrus_flywheel.streams.processors.fetch import CaptureFetch, WorkerApp
from hebrus_flywheel.streams.processors.topology import StreamTopics

APP_SUFFIX = "-floor"
"""Appended to the worker's app id: its own group, covered by the streams role's ACLs."""


class Drain:
    """Counts the records an agent took; reports once ``expected`` were read."""

    def __init__(self, expected: int) -> None:
        self.expected, self.records, self.bytes = expected, 0, 0
        self.started: tuple[float, float] | None = None  # (wall, CPU) at the first record

    def take(self, events: list[Any]) -> bool:
        """Count a batch; True once every expected record was read."""
        if self.started is None:
            self.started = (time.perf_counter(), time.process_time())
        self.records += len(events)
        self.bytes += sum(len(e.message.value or b"") for e in events)
        return self.records >= self.expected

    def report(self) -> dict[str, Any]:
        assert self.started is not None
        return {"records": self.records, "bytes": self.bytes,
                "seconds": time.perf_counter() - self.started[0],
                "cpu_s": time.process_time() - self.started[1]}


def build_app(bootstrap: str, prefix: str, app_id: str, drain: Drain, *,
              librdkafka: bool = True) -> faust.App:
    config = kafka.client_config(bootstrap)
    suffix = APP_SUFFIX if librdkafka else f"{APP_SUFFIX}-aiokafka"  # a group of its own
    app = WorkerApp(f"{prefix}{app_id}{suffix}", **kafka.faust_settings(config),
                    datadir=str(flywheel_home() / "faust-floor"),  # not the working dir
                    web_enabled=False, consumer_auto_offset_reset="earliest",
                    key_serializer="raw", value_serializer="raw")
    topics = StreamTopics.from_prefix(prefix)
    if librdkafka:  # as the worker reads them (streams.processors.fetch)
        app.capture_fetch = CaptureFetch.of(config, topics)
    capture = app.topic(topics.transcripts, topics.observations,
                        key_serializer="raw", value_serializer="raw")

    @app.agent(capture, name="floor")
    async def floor(stream: Any) -> None:
        async for events in batches(stream):
            if drain.take(events):
                print(json.dumps(drain.report()), flush=True)
                os._exit(0)  # measured: no orderly shutdown to wait for

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--app-id", default="flywheel-streams")
    parser.add_argument("--records", type=int, required=True,
                        help="capture records (transcripts + observations) to read")
    parser.add_argument("--event-loop", default=DEFAULT_EVENT_LOOP, choices=EVENT_LOOPS,
                        help="the worker's event loop (default: the worker's default)")
    parser.add_argument("--capture-through", default="librdkafka",
                        choices=("librdkafka", "aiokafka"),
                        help="the client reading the capture topics (the worker's: librdkafka)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    use_event_loop(args.event_loop)
    app = build_app(bootstrap_servers(args.bootstrap_servers), args.prefix, args.app_id,
                    Drain(args.records), librdkafka=args.capture_through == "librdkafka")
    faust.Worker(app, loglevel=logging.WARNING, quiet=True,
                 redirect_stdouts=False).execute_from_commandline()


if __name__ == "__main__":
    main()
