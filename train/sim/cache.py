"""The resident expert cache: capacity in experts, LRU or priority-aware eviction.

An entry is one expert of one layer (key ``layer * E + expert``). A read reserves its
entry when it is issued (state LOADING: a DMA needs a destination) and the entry turns
RESIDENT when the read lands. Capacity counts both states. Only RESIDENT entries that
the running layer does not need (``pinned``) may be evicted.

Each entry carries the event keys at which predictions said it will be needed
(``deadlines``); a deadline is *live* while its MoE has not run yet.

Priority-aware victim order: (1) *dead* entries: brought by a prediction, never used,
no live deadline (e.g. a rejected-suffix or wrong prefetch), oldest first; (2) *cold*
entries: no live deadline, least recently used first; (3) *live* entries, the one whose
next predicted use is furthest away first. A prefetch may take a live entry only when
that entry's next use is later than the prefetch's own deadline; a P0 may take any.
LRU policy: every resident entry in one least-recently-used order, for every reader.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Collection

from hebrus_flywheel.train.sim.ssd import Read

LOADING, RESIDENT = 0, 1
_DEAD, _COLD, _LIVE = "dead", "cold", "live"


class Entry:
    """One cached (or loading) expert."""

    __slots__ = ("cls", "deadlines", "first_use_at", "key", "landed_at", "origin",
                 "read", "state", "token", "used")

    def __init__(self, key: int, read: Read) -> None:
        self.key, self.read, self.origin = key, read, read.origin
        self.state = LOADING
        self.used = False
        self.first_use_at = 0.0
        self.landed_at = float("inf")
        self.deadlines: list[int] = []
        self.cls: str | None = None
        self.token = 0


class ExpertCache:
    """Entries by key, with the bookkeeping the two eviction policies need."""

    def __init__(self, *, capacity: int, policy: str) -> None:
        self.capacity, self.priority_aware = capacity, policy == "priority"
        self.entries: dict[int, Entry] = {}
        self._loading: dict[int, Entry] = {}
        self._dead: OrderedDict[int, Entry] = OrderedDict()
        self._cold: OrderedDict[int, Entry] = OrderedDict()
        self._live: list[tuple[int, int, int]] = []
        self._deadline_heap: list[tuple[int, int]] = []
        self._seq = itertools.count()

    def get(self, key: int) -> Entry | None:
        """The entry for ``key`` (LOADING or RESIDENT), if any."""
        return self.entries.get(key)

    def full(self) -> bool:
        """Whether a new reservation needs a victim first."""
        return len(self.entries) >= self.capacity

    def reserve(self, read: Read) -> Entry:
        """Reserve the slot ``read`` will land in."""
        entry = Entry(read.key, read)
        self.entries[read.key] = entry
        self._loading[read.key] = entry
        return entry

    def land(self, entry: Entry, now_key: int) -> None:
        """``entry``'s read landed at ``entry.read.landed_at``."""
        del self._loading[entry.key]
        entry.state, entry.landed_at = RESIDENT, entry.read.landed_at
        self._classify(entry, now_key)

    def use(self, entry: Entry, now_key: int) -> None:
        """An exact demand at event ``now_key`` consumed ``entry``."""
        entry.used = True
        if entry.state == RESIDENT:
            self._unclassify(entry)
            self._classify(entry, now_key)

    def add_deadline(self, entry: Entry, deadline_key: int, now_key: int) -> None:
        """A prediction says ``entry`` will be needed at event ``deadline_key``."""
        if not self.priority_aware:
            return
        heapq.heappush(entry.deadlines, deadline_key)
        heapq.heappush(self._deadline_heap, (deadline_key, entry.key))
        if entry.state == RESIDENT and entry.deadlines[0] == deadline_key:
            self._unclassify(entry)
            self._classify(entry, now_key)

    def pass_deadlines(self, now_key: int) -> None:
        """Re-class entries whose predicted deadlines are at or before ``now_key``."""
        while self._deadline_heap and self._deadline_heap[0][0] <= now_key:
            _, key = heapq.heappop(self._deadline_heap)
            entry = self.entries.get(key)
            if entry is not None and entry.state == RESIDENT:
                self._unclassify(entry)
                self._classify(entry, now_key)

    def remove(self, entry: Entry) -> None:
        """Drop ``entry`` (evicted, or its read cancelled)."""
        del self.entries[entry.key]
        self._loading.pop(entry.key, None)
        self._unclassify(entry)

    def victim(self, *, pinned: Collection[int], deadline_key: int | None) -> Entry | None:
        """The resident entry to evict, or None. ``deadline_key`` is the requesting
        prefetch's deadline (None for a P0, which may take any unpinned entry)."""
        for order in (self._dead, self._cold):
            for key, entry in order.items():
                if key not in pinned:
                    return entry
        return self._live_victim(pinned, deadline_key) if self.priority_aware else None

    def loading_entries(self) -> list[Entry]:
        """Entries whose read has not landed, in reservation order."""
        return list(self._loading.values())

    def loading_prefetch_victim(self, pinned: Collection[int]) -> Entry | None:
        """The in-flight prefetch a P0 may cancel when nothing resident can go: the one
        whose read expires last."""
        candidates = [e for k, e in self._loading.items()
                      if k not in pinned and e.read.priority > 0]
        if not candidates:
            return None
        return max(candidates, key=lambda e: (e.read.expire_key, e.read.rid))

    # --- internals ------------------------------------------------------------------

    def _live_victim(self, pinned: Collection[int], deadline_key: int | None) -> Entry | None:
        skipped: list[tuple[int, int, int]] = []
        found: Entry | None = None
        while self._live:
            item = self._live[0]
            entry = self.entries.get(item[2])
            if entry is None or entry.cls != _LIVE or entry.token != item[1]:
                heapq.heappop(self._live)
            elif item[2] in pinned:
                skipped.append(heapq.heappop(self._live))
            else:
                allowed = deadline_key is None or -item[0] > deadline_key
                found = entry if allowed else None
                break
        for item in skipped:
            heapq.heappush(self._live, item)
        return found

    def _classify(self, entry: Entry, now_key: int) -> None:
        while entry.deadlines and entry.deadlines[0] <= now_key:
            heapq.heappop(entry.deadlines)
        if not self.priority_aware:
            entry.cls = _COLD
            self._cold[entry.key] = entry
        elif entry.deadlines:
            entry.cls, entry.token = _LIVE, next(self._seq)
            heapq.heappush(self._live, (-entry.deadlines[0], entry.token, entry.key))
        elif entry.origin > 0 and not entry.used:
            entry.cls = _DEAD
            self._dead[entry.key] = entry
        else:
            entry.cls = _COLD
            self._cold[entry.key] = entry

    def _unclassify(self, entry: Entry) -> None:
        if entry.cls == _DEAD:
            del self._dead[entry.key]
        elif entry.cls == _COLD:
            del self._cold[entry.key]
        entry.cls = None
