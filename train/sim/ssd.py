"""A deterministic SSD model with queue depth, per-request latency and strict priority.

Model (simulated time in seconds):

* A read is *submitted* into a pending queue ordered by (priority, submission order);
  priority 0 (P0, blocking exact miss) > 1 (P1, near-term prediction) > 2 (P2,
  discardable long-range prediction).
* At most ``depth`` reads are *dispatched* (hold a queue slot) at once. A dispatched
  read first waits ``latency`` seconds (latencies of concurrent reads overlap), then
  transfers its bytes through one channel of ``bandwidth`` bytes/s.
* The channel serves the highest-priority transfer-ready read (then the earliest
  dispatched) and is preemptive: expert reads are assumed to be split into small chunks,
  so a higher-priority read takes the channel at once and the preempted read keeps its
  progress. When every slot is held and a higher-priority read is pending, the lowest-
  priority dispatched read gives its slot back, keeps its progress, and pays the latency
  again when re-dispatched. Hence a P2 read never delays a P0 read.
* Every time lower-priority work stood in a P0/P1 read's way (it held the channel, or
  every slot) and was preempted, ``starvation_attempts[priority]`` is incremented.
"""

from __future__ import annotations

import heapq
import itertools
import math

PENDING, LATENCY, TRANSFER, DONE, CANCELLED = range(5)


class Read:
    """One expert read. ``origin`` is the priority it was first submitted with."""

    __slots__ = ("dispatch_seq", "expire_key", "key", "landed_at", "nbytes", "origin",
                 "priority", "ready_at", "rejected", "remaining", "rid", "state",
                 "submit_time", "token", "transferred")

    def __init__(self, *, rid: int, key: int, nbytes: int, priority: int,
                 submit_time: float, expire_key: int, rejected: bool) -> None:
        self.rid, self.key, self.nbytes = rid, key, nbytes
        self.priority = self.origin = priority
        self.submit_time, self.expire_key, self.rejected = submit_time, expire_key, rejected
        self.remaining = float(nbytes)
        self.transferred = 0.0
        self.state = PENDING
        self.token = 0
        self.dispatch_seq = -1
        self.ready_at = math.inf
        self.landed_at = math.inf


class SsdQueue:
    """The SSD: submit, elevate and cancel reads; ``advance`` time to collect landings."""

    def __init__(self, *, bandwidth: float, latency: float, depth: int) -> None:
        self.bandwidth, self.latency, self.depth = bandwidth, latency, depth
        self.now = 0.0
        self.starvation_attempts = [0, 0]
        self._seq = itertools.count()
        self._pending: list[tuple[int, int, Read]] = []
        self._latency: list[tuple[float, int, Read]] = []
        self._transfer: list[tuple[int, int, Read]] = []
        self._dispatched: dict[int, Read] = {}
        self._class_count = [0, 0, 0]

    # --- public operations ---------------------------------------------------------

    def submit(self, read: Read) -> None:
        """Queue ``read`` (state PENDING) and dispatch whatever the slots allow."""
        read.state = PENDING
        self._push_pending(read)
        self._fill_slots()

    def elevate(self, read: Read, priority: int) -> None:
        """Raise ``read`` to ``priority`` (a smaller number) if that is higher."""
        if priority >= read.priority or read.state in (DONE, CANCELLED):
            return
        if read.state == PENDING:
            read.priority = priority
            self._push_pending(read)
            self._fill_slots()
            return
        self._class_count[read.priority] -= 1
        self._class_count[priority] += 1
        if read.state == TRANSFER:
            self._note_channel_contest(priority, read)
            read.priority = priority
            self._push_transfer(read)
        else:
            read.priority = priority

    def cancel(self, read: Read) -> None:
        """Drop ``read``; bytes it already transferred stay in ``read.transferred``."""
        if read.state in (DONE, CANCELLED):
            return
        if read.state in (LATENCY, TRANSFER):
            self._release_slot(read)
        read.state = CANCELLED
        self._fill_slots()

    def next_event_time(self) -> float:
        """When the next latency ends or transfer lands (``inf`` when idle)."""
        top = self._peek(self._transfer, TRANSFER)
        t_fin = self.now + top.remaining / self.bandwidth if top else math.inf
        return min(t_fin, self._peek_latency())

    def advance(self, until: float) -> list[Read]:
        """Run to time ``until``; return the reads that landed, in landing order."""
        landed: list[Read] = []
        while True:
            top = self._peek(self._transfer, TRANSFER)
            t_fin = self.now + top.remaining / self.bandwidth if top else math.inf
            t_lat = self._peek_latency()
            t_next = min(t_fin, t_lat)
            if t_next > until or math.isinf(t_next):
                if top is not None and until > self.now:
                    self._progress(top, until - self.now)
                if math.isfinite(until):
                    self.now = max(self.now, until)
                return landed
            if top is not None:
                self._progress(top, t_next - self.now)
            self.now = t_next
            if top is not None and t_fin <= t_lat:
                self._complete(top)
                landed.append(top)
            else:
                self._start_transfer()

    # --- internals ------------------------------------------------------------------

    def _push_pending(self, read: Read) -> None:
        read.token = next(self._seq)
        heapq.heappush(self._pending, (read.priority, read.token, read))

    def _push_transfer(self, read: Read) -> None:
        read.token = next(self._seq)
        heapq.heappush(self._transfer, (read.priority, read.token, read))

    @staticmethod
    def _peek(heap: list[tuple[int, int, Read]], state: int) -> Read | None:
        while heap:
            priority, token, read = heap[0]
            if read.state == state and read.token == token and read.priority == priority:
                return read
            heapq.heappop(heap)
        return None

    def _peek_latency(self) -> float:
        while self._latency:
            ready_at, token, read = self._latency[0]
            if read.state == LATENCY and read.token == token:
                return ready_at
            heapq.heappop(self._latency)
        return math.inf

    def _fill_slots(self) -> None:
        while (top := self._peek(self._pending, PENDING)) is not None:
            if len(self._dispatched) >= self.depth:
                victim = self._slot_victim(top.priority)
                if victim is None:
                    return
                self._count_starvation(top.priority)
                self._release_slot(victim)
                victim.state = PENDING
                self._push_pending(victim)
            heapq.heappop(self._pending)
            self._dispatch(top)

    def _slot_victim(self, priority: int) -> Read | None:
        if not any(self._class_count[p] for p in range(priority + 1, 3)):
            return None
        return max(self._dispatched.values(), key=lambda r: (r.priority, r.dispatch_seq))

    def _dispatch(self, read: Read) -> None:
        read.state = LATENCY
        read.dispatch_seq = read.token = next(self._seq)
        read.ready_at = self.now + self.latency
        self._dispatched[read.rid] = read
        self._class_count[read.priority] += 1
        heapq.heappush(self._latency, (read.ready_at, read.token, read))

    def _release_slot(self, read: Read) -> None:
        del self._dispatched[read.rid]
        self._class_count[read.priority] -= 1

    def _start_transfer(self) -> None:
        _, _, read = heapq.heappop(self._latency)
        read.state = TRANSFER
        self._note_channel_contest(read.priority, read)
        self._push_transfer(read)

    def _note_channel_contest(self, priority: int, read: Read) -> None:
        serving = self._peek(self._transfer, TRANSFER)
        if serving is None or serving is read:
            return
        if serving.priority > priority and serving.transferred > 0:
            self._count_starvation(priority)

    def _count_starvation(self, priority: int) -> None:
        if priority < 2:
            self.starvation_attempts[priority] += 1

    def _progress(self, read: Read, dt: float) -> None:
        delta = min(dt * self.bandwidth, read.remaining)
        read.remaining -= delta
        read.transferred += delta

    def _complete(self, read: Read) -> None:
        read.remaining, read.transferred = 0.0, float(read.nbytes)
        read.state = DONE
        read.landed_at = self.now
        self._release_slot(read)
        self._fill_slots()
