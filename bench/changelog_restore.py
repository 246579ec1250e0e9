"""Restore (and standby) speed of a worker table's changelog; one JSON line per figure.

Builds a faust table on the worker's sealed RocksDB store, then hands it changelog
records the way faust's table manager does (its changelog channel decodes each record
into an event, :meth:`Table.apply_changelog_batch` stores the batch), in one process,
no broker: the per-record cost a restore and a standby replica pay on the worker's
event-loop thread. Records are a thread header (a dict of a few KB) and a chunk's route
run (``--run-kib`` of bytes) in turn. Two ways, in the same run:

* ``store_decoded``: the worker's changelog topic (:class:`StoreDecodedChangelogTopic`),
  whose channel hands records over undecoded; the store decodes each once;
* ``channel_decoded``: :class:`RefusingChangelogTopic`, whose channel decodes each record
  and the store decodes it again (the worker before 2026-12-06);
* ``store_decoded_logged``: as ``store_decoded``, RocksDB writing its write-ahead log
  too (``state_store.WRITE_AHEAD_LOG``; the worker before 2026-12-06).

Usage::

    python bench/changelog_restore.py [--records 4000] [--run-kib 120] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import faust  # noqa: E402
from faust.types import TP, Message  # noqa: E402

from hebrus_flywheel.streams.processors import state_store  # noqa: E402
from hebrus_flywheel.streams.processors.state_codec import (  # noqa: E402
    RefusingChangelogTopic,
    StateValue,
    StoreDecodedChangelogTopic,
    dumps,
)
from hebrus_flywheel.streams.processors.state_seal import StateSealer  # noqa: E402
from hebrus_flywheel.streams.processors.state_store import (  # noqa: E402
    ROCKSDB_OPTIONS,
    STORE_URL,
)

BATCH = 256
"""Events per ``apply_changelog_batch`` (faust flushes its recovery buffer in batches)."""


def emit(figure: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"bench": "changelog_restore", "figure": figure,
                      "value": round(value, 3), "unit": unit, **extra}), flush=True)


def records(count: int, run_kib: int) -> list[tuple[bytes, bytes]]:
    """(key, value) changelog records: headers and route runs, alternating."""
    run = bytes(range(256)) * (run_kib * 4)
    out = []
    for i in range(count):
        if i % 2:
            key, value = f"o\x1fowner-{i}\x1fthread\x1f0\x1fr0", {"routes": run, "first": 0}
        else:
            key, value = f"h\x1fowner-{i}\x1fthread\x1f0", {
                "status": "open", "owner": f"owner-{i}", "applied": {"t": i, "o": i},
                "ranges": [[0, 64], [80, 120]], "turns": [[0, 1], [1, 40]],
                "turn_values": {str(t): list(range(200)) for t in range(4)}}
        out.append((json.dumps(key).encode(), dumps(value)))
    return out


def restore_seconds(kind: type[Any], recs: list[tuple[bytes, bytes]], datadir: Path) -> float:
    """Wall seconds to decode ``recs`` through the changelog channel and apply them."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app = faust.App(f"restore-{kind.__name__}", store=STORE_URL, datadir=str(datadir),
                    web_enabled=False)
    table: Any = app.Table("t", partitions=1, key_type=str, value_type=StateValue,
                           options=dict(ROCKSDB_OPTIONS))
    store: Any = table.data
    store.state_sealer = StateSealer(sealer=None, table="t")  # nothing sealed here
    table.changelog_topic = kind(**table.changelog_topic._clone_args())
    name = table.changelog_topic.get_topic_name()
    channel = table.changelog_topic.clone_using_queue(asyncio.Queue())
    messages = [Message(topic=name, partition=0, offset=i, timestamp=0.0, timestamp_type=0,
                        headers=[], key=k, value=v, checksum=None, tp=TP(name, 0))
                for i, (k, v) in enumerate(recs)]
    try:
        start = time.perf_counter()
        for first in range(0, len(messages), BATCH):
            events = [loop.run_until_complete(channel.decode(m, propagate=True))
                      for m in messages[first:first + BATCH]]
            table.apply_changelog_batch(events)
        return time.perf_counter() - start
    finally:
        for db in store._dbs.values():
            db.close()
        loop.close()
        asyncio.set_event_loop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--run-kib", type=int, default=120)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    recs = records(args.records, args.run_kib)
    best: dict[str, float] = {}
    variants = (("store_decoded", StoreDecodedChangelogTopic, False),
                ("channel_decoded", RefusingChangelogTopic, False),
                ("store_decoded_logged", StoreDecodedChangelogTopic, True))
    default = state_store.WRITE_AHEAD_LOG
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(args.repeat):  # alternated: the machine is noisy
                for name, kind, logged in variants:
                    state_store.WRITE_AHEAD_LOG = logged
                    seconds = restore_seconds(kind, recs, Path(tmp) / f"{name}-{round_}")
                    best[name] = min(best.get(name, seconds), seconds)
    finally:
        state_store.WRITE_AHEAD_LOG = default
    for name, seconds in best.items():
        emit(f"changelog_restore_{name}_records_per_s", args.records / seconds, "records/s",
             records=args.records, run_kib=args.run_kib, best_of=args.repeat)
    emit("changelog_restore_store_to_channel_decoded_ratio",
         best["channel_decoded"] / best["store_decoded"], "ratio",
         note="restore speed, one decode per record against two")
    emit("changelog_restore_unlogged_to_logged_ratio",
         best["store_decoded_logged"] / best["store_decoded"], "ratio",
         note="restore speed, RocksDB without its write-ahead log against with it")

if __name__ == "__main__":
    main()
