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
  too (``state_store.WRITE_AHEAD_LOG``; the worker before 2026-12-06);
* ``store_decoded_sealed``: as ``store_decoded`` with every value sealed under its
  owner's data key, as the worker's changelogs hold them: the store checks each seal
  (AES-GCM) before storing it, without decoding the value (``StateSealer.check``);
* ``store_decoded_sealed_opened``: the same, each value opened *and decoded* to check it
  (the worker before 2026-12-07).

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

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer  # noqa: E402
from hebrus_flywheel.streams.owner_seal import Erased, OwnerSealer  # noqa: E402
from hebrus_flywheel.streams.processors import state_store  # noqa: E402
from hebrus_flywheel.streams.processors.state_codec import (  # noqa: E402
    RefusingChangelogTopic,
    SealedState,
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


def records(count: int, run_kib: int, state: StateSealer | None = None,
            owners: tuple[str, ...] = ()) -> list[tuple[bytes, bytes]]:
    """(key, value) changelog records: headers and route runs, alternating; of
    ``owners`` in turn and sealed by ``state`` when given."""
    run = bytes(range(256)) * (run_kib * 4)
    out = []
    for i in range(count):
        owner = owners[i % len(owners)] if owners else f"owner-{i}"
        if i % 2:
            key, value = f"o\x1f{owner}\x1fthread-{i}\x1f0\x1fr0", {"routes": run, "first": 0}
        else:
            key, value = f"h\x1f{owner}\x1fthread-{i}\x1f0", {
                "status": "open", "owner": owner, "applied": {"t": i, "o": i},
                "ranges": [[0, 64], [80, 120]], "turns": [[0, 1], [1, 40]],
                "turn_values": {str(t): list(range(200)) for t in range(4)}}
        sealed = state.seal(key, value) if state is not None else value
        out.append((json.dumps(key).encode(), dumps(sealed)))
    return out


def owner_keys(directory: Path, owners: int = 64) -> tuple[OwnerSealer, tuple[str, ...]]:
    """A fresh key store of ``owners`` owners (each with a live key), and their ids."""
    keys = LocalOwnerKeyStore(directory, create=True, max_age_s=3600)
    names = Pseudonymizer(keys)
    ids = tuple(names.owner(f"bench-owner-{n}") for n in range(owners))
    for owner in ids:
        keys.data_key(owner, create=True)
    return OwnerSealer(lambda: keys), ids


class OpeningStateSealer(StateSealer):
    """Checks a restored value by opening and decoding it (the worker before
    2026-12-07)."""

    def check(self, key: str, value: SealedState) -> Erased | None:
        opened = self.open(key, value)
        return opened if isinstance(opened, Erased) else None


def restore_seconds(kind: type[Any], recs: list[tuple[bytes, bytes]], datadir: Path,
                    state: StateSealer | None = None) -> float:
    """Wall seconds to decode ``recs`` through the changelog channel and apply them."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app = faust.App(f"restore-{kind.__name__}", store=STORE_URL, datadir=str(datadir),
                    web_enabled=False)
    table: Any = app.Table("t", partitions=1, key_type=str, value_type=StateValue,
                           options=dict(ROCKSDB_OPTIONS))
    store: Any = table.data
    store.state_sealer = state or StateSealer(sealer=None, table="t")
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
    best: dict[str, float] = {}
    default = state_store.WRITE_AHEAD_LOG
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sealer, owners = owner_keys(Path(tmp) / "owners")
            plain = records(args.records, args.run_kib)
            sealed = records(args.records, args.run_kib, StateSealer(sealer, "t"), owners)
            variants = (
                ("store_decoded", StoreDecodedChangelogTopic, False, plain, None),
                ("channel_decoded", RefusingChangelogTopic, False, plain, None),
                ("store_decoded_logged", StoreDecodedChangelogTopic, True, plain, None),
                ("store_decoded_sealed", StoreDecodedChangelogTopic, False, sealed,
                 StateSealer(sealer, "t")),
                ("store_decoded_sealed_opened", StoreDecodedChangelogTopic, False, sealed,
                 OpeningStateSealer(sealer, "t")))
            for round_ in range(args.repeat):  # alternated: the machine is noisy
                for name, kind, logged, recs, state in variants:
                    state_store.WRITE_AHEAD_LOG = logged
                    seconds = restore_seconds(kind, recs, Path(tmp) / f"{name}-{round_}",
                                              state)
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
    emit("changelog_restore_sealed_checked_to_opened_ratio",
         best["store_decoded_sealed_opened"] / best["store_decoded_sealed"], "ratio",
         note="restore speed of sealed records, each seal checked without decoding the "
         "value against each value opened and decoded")

if __name__ == "__main__":
    main()
