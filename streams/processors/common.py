"""Small helpers shared by the processor cores: state keys, ordinal ranges, hashes.

State lives in one mutable mapping per stage (a faust table in the worker, a dict in
tests and the bench). Keys are strings built here so that every stage agrees on them;
values are plain Python objects (dicts, lists, ints, bytes).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable

SEP = "\x1f"
"""Separator inside state keys (ASCII unit separator: never part of an owner or thread)."""

Ranges = list[list[int]]
"""Sorted, disjoint, non-adjacent half-open ``[start, end)`` ordinal ranges."""


def thread_key(owner: str, thread: str) -> str:
    """The Kafka message key of every capture and window record: ``owner/thread``."""
    return f"{owner}/{thread}"


def instance_id(owner: str, thread: str, generation: int, identity_id: str | None = None) -> str:
    """One generation of one thread as captured by one teacher (runtime identity): the
    unit that is assembled, split, deduplicated, windowed. Two teachers publishing the
    same conversation to the same topics make two instances (the worker always passes
    ``identity_id``; without it, the id of older state and tests)."""
    base = f"{owner}{SEP}{thread}{SEP}{generation}"
    return base if identity_id is None else f"{base}{SEP}{identity_id}"


def header_key(iid: str) -> str:
    return f"h{SEP}{iid}"


def turn_key(iid: str, turn_index: int) -> str:
    return f"t{SEP}{iid}{SEP}{turn_index}"


def obs_key(iid: str, ordinal: int) -> str:
    return f"o{SEP}{iid}{SEP}{ordinal}"


def run_key(iid: str, first_ordinal: int) -> str:
    """A chunk's run of observations stored as one value (``o`` kind: sealed as the
    owner's); never equal to an :func:`obs_key` (the ``r`` before the ordinal)."""
    return f"o{SEP}{iid}{SEP}r{first_ordinal}"


def counter_key(producer_id: str, topic: str, partition: int) -> str:
    return f"c{SEP}{producer_id}{SEP}{topic}{SEP}{partition}"


def ranges_add(ranges: Ranges, start: int, end: int) -> Ranges:
    """A new range list with ``[start, end)`` merged in (adjacent ranges coalesce)."""
    if end <= start:
        return [list(r) for r in ranges]
    out: Ranges = []
    placed = False
    for lo, hi in ranges:
        if hi < start:
            out.append([lo, hi])
        elif end < lo:
            if not placed:
                out.append([start, end])
                placed = True
            out.append([lo, hi])
        else:
            start, end = min(lo, start), max(hi, end)
    if not placed:
        out.append([start, end])
    out.sort()
    return out


def ranges_contains(ranges: Ranges, value: int) -> bool:
    if len(ranges) <= 8:  # the usual case: a scan beats building the bisect keys
        for lo, hi in ranges:
            if value < hi:
                return lo <= value
        return False
    idx = bisect.bisect_right([r[0] for r in ranges], value) - 1
    return idx >= 0 and ranges[idx][0] <= value < ranges[idx][1]


def ranges_overlap(ranges: Ranges, start: int, end: int) -> bool:
    return any(lo < end and start < hi for lo, hi in ranges)


def ranges_covers(outer: Ranges, inner: Ranges) -> bool:
    """True when every ordinal of ``inner`` is in ``outer``."""
    return all(any(lo <= s and e <= hi for lo, hi in outer) for s, e in inner)


def ranges_minus(ranges: Ranges, removed: Ranges) -> Ranges:
    """The ordinals of ``ranges`` not in ``removed`` (both sorted, disjoint), as ranges."""
    out: Ranges = []
    for lo, hi in ranges:
        for cut_lo, cut_hi in removed:
            if cut_hi <= lo or cut_lo >= hi:
                continue
            if cut_lo > lo:
                out.append([lo, cut_lo])
            lo = max(lo, cut_hi)
            if lo >= hi:
                break
        if lo < hi:
            out.append([lo, hi])
    return out


def ranges_count(ranges: Ranges) -> int:
    return sum(hi - lo for lo, hi in ranges)


def iter_ranges(ranges: Ranges) -> Iterable[int]:
    for lo, hi in ranges:
        yield from range(lo, hi)


def sha256_hex(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def unit_interval(salt: str, *parts: str) -> float:
    """A deterministic number in ``[0, 1)`` from a salted SHA-256 of ``parts``."""
    digest = hashlib.sha256(SEP.join((salt, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
