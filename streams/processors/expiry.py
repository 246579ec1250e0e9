"""Time-bucketed expiry for the processor tables: bounded state without full scans.

A table key that must go away some time (an idle thread generation, a finished
generation's header, a producer's counter, a dedup decision) is *scheduled*: its key is
added to the bucket ``x<SEP><partition><SEP><bucket>`` of the time it falls due
(``due_ms // bucket_ms``). :func:`sweep` pops every bucket from the partition's cursor
(``x<SEP><partition><SEP>cursor``, the lowest bucket not yet swept) up to the last one
that ended by ``now_ms`` (so a key expires up to one bucket late) and asks a callback
about each key it held: the callback deletes the key (and what belongs to it) or
returns the time it falls due now, and the key is scheduled again. A key touched since
it was scheduled moves on lazily, so a hot key costs no index write per update.
Deleting a table key writes a changelog tombstone, so a restored worker does not bring
expired state back; a popped bucket is deleted the same way.

A bucket holds at most ``CHUNK_KEYS`` keys in its own value; a full bucket's keys move to
a numbered chunk (``x<SEP><partition><SEP><bucket><SEP><n>``, their count under
``...<SEP>chunks``) and it starts over. So one schedule costs the same however many keys
fall due in one bucket, and no table value (nor its changelog record) grows with the
traffic: the dedup table files every thread of an hour under one bucket, and as one list
that bucket passed a producer's 1 MiB request limit at about 12,000 threads an hour
(two schedules each) and cost every further thread a copy of it. Buckets written as
one long list before chunking are read the same way and move to a chunk when next
written.

The schedule is a hint, never the truth: the callback re-reads the key and decides on
its current value, so a key scheduled twice, or one deleted meanwhile, is harmless.

Bucket and cursor keys belong to no owner (they list pseudonymous table keys only) and
stay unsealed in the changelog (:func:`streams.processors.state_seal.owner_of_key`).
Keys live in the table partition of the event being processed (faust's tables are
partitioned by the current event), so each partition has its own buckets and cursor.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from hebrus_flywheel.streams.processors.common import SEP

EXPIRY_KIND = "x"
"""The key kind of bucket and cursor keys."""

Decide = Callable[[str, int], "int | None"]
"""``decide(key, now_ms)``: None when the key was expired (deleted by the callback), else
the time in ms it falls due next (it is scheduled again)."""


CHUNK_KEYS = 256
"""Most keys one bucket value holds before they move to a chunk of their own."""


def bucket_key(partition: int, bucket: int) -> str:
    return f"{EXPIRY_KIND}{SEP}{partition}{SEP}{bucket:013d}"


def chunk_key(partition: int, bucket: int, chunk: int) -> str:
    """Where the ``chunk``-th full set of a bucket's keys went."""
    return f"{bucket_key(partition, bucket)}{SEP}{chunk:06d}"


def chunk_count_key(partition: int, bucket: int) -> str:
    """How many chunks a bucket has moved out (absent: none)."""
    return f"{bucket_key(partition, bucket)}{SEP}chunks"


def cursor_key(partition: int) -> str:
    return f"{EXPIRY_KIND}{SEP}{partition}{SEP}cursor"


def is_expiry_key(key: str) -> bool:
    return key.startswith(EXPIRY_KIND + SEP)


def schedule(store: MutableMapping[str, Any], key: str, *, partition: int, due_ms: int,
             bucket_ms: int) -> None:
    """Put ``key`` in the bucket of ``due_ms`` (once; a repeat changes nothing)."""
    bucket = max(0, int(due_ms)) // bucket_ms
    bkey = bucket_key(partition, bucket)
    keys = store.get(bkey) or []
    if key in keys:
        return
    if len(keys) >= CHUNK_KEYS:
        count_key = chunk_count_key(partition, bucket)
        moved = int(store.get(count_key, 0))
        store[chunk_key(partition, bucket, moved)] = keys
        store[count_key] = moved + 1
        keys = []
    store[bkey] = [*keys, key]
    ckey = cursor_key(partition)
    cursor = store.get(ckey)
    if cursor is None or bucket < int(cursor):
        store[ckey] = bucket


def sweep(store: MutableMapping[str, Any], *, partition: int, now_ms: int, bucket_ms: int,
          decide: Decide, max_buckets: int = 100_000) -> int:
    """Pop the elapsed buckets of ``partition`` (every bucket that ended at or before
    ``now_ms``) and apply ``decide`` to each key they held; returns how many keys were
    looked at. At most ``max_buckets`` buckets per call (a worker down for long catches
    up over a few ticks)."""
    ckey = cursor_key(partition)
    cursor = store.get(ckey)
    if cursor is None:
        return 0
    now_bucket = max(0, int(now_ms)) // bucket_ms
    first, last = int(cursor), min(now_bucket - 1, int(cursor) + max_buckets - 1)
    if first > last:
        return 0
    later: list[tuple[str, int]] = []
    seen = 0
    for bucket in range(first, last + 1):
        keys = _pop_bucket(store, partition, bucket)
        for key in sorted(set(keys)):  # one order, whatever the arrival order
            seen += 1
            due = decide(key, now_ms)
            if due is not None:
                later.append((key, due))
    store[ckey] = last + 1
    for key, due in later:
        schedule(store, key, partition=partition, due_ms=max(due, now_ms), bucket_ms=bucket_ms)
    return seen


def _pop_bucket(store: MutableMapping[str, Any], partition: int, bucket: int) -> list[str]:
    """Every key of one bucket, its chunks' included; each of its table keys is deleted
    (a tombstone: the bucket is gone once swept)."""
    keys: list[str] = []
    count_key = chunk_count_key(partition, bucket)
    moved = store.get(count_key)
    if moved is not None:
        for chunk in range(int(moved)):
            ckey = chunk_key(partition, bucket, chunk)
            keys.extend(store.get(ckey) or ())
            if ckey in store:
                del store[ckey]
        del store[count_key]
    bkey = bucket_key(partition, bucket)
    head = store.get(bkey)
    if head is not None:
        keys.extend(head)
        del store[bkey]
    return keys


def caught_up(processed: int | None, committed: int | None, highwater: int | None) -> bool:
    """Whether the worker has processed every record of one input partition it knows of.

    ``processed``: the offset of the last record this worker processed there (None when
    none yet); ``committed``: the group's committed offset when the partition was
    assigned (the next record to read; None when never committed); ``highwater``: the
    partition's end as the last fetch saw it (None: not fetched yet, nothing known).

    Idle timeouts are judged in processing time, so they may only run while the worker
    is caught up: behind a backlog, a thread's transcripts can be read long before its
    observations (Kafka orders nothing across topics), and a tick then would close the
    thread as idle and quarantine the observations still waiting in the backlog
    (``thread_closed``). Measured with ``bench/soak.py`` before this check: 9,220 idle
    timeouts and 6,396 chunks quarantined in the first 480,000 observations.
    """
    if highwater is None:
        return True
    position = processed + 1 if processed is not None else (committed or 0)
    return position >= highwater
