"""Trace-driven shadow simulation of expert reads: the runtime, the SSD and the cache.

Timeline of one forward step (all rows of the step together), for each layer ``l``:

1. layer start (boundary ``l``): predictions whose input exists now are issued (after
   ``predictor_latency_s``);
2. ``attention_time_s[l]`` later the MoE is due: the router's exact experts are pinned
   and predictions aimed at this or an earlier MoE stop protecting their entries; each
   exact expert is *ready* if resident, otherwise an exact miss: an in-flight prefetch of it
   is raised to P0, an absent one gets a new blocking P0 read. Pending (undispatched)
   prefetches whose deadline has now passed are cancelled;
3. the runtime waits until every exact expert is resident (the *exposed wait*), then
   runs the MoE for ``moe_time_s[l]``.

After the last layer comes boundary ``L`` (end-of-step predictions), then
``step_overhead_s``. Compute times do not depend on how many rows a step holds, and the
cache starts empty (cold). Time is simulated and every tie is broken by a fixed order, so the
same inputs always give the same result.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np

from hebrus_flywheel.train.sim.cache import RESIDENT, Entry, ExpertCache
from hebrus_flywheel.train.sim.config import SimConfig
from hebrus_flywheel.train.sim.errors import SimulationError
from hebrus_flywheel.train.sim.plan import Plan, build_plan
from hebrus_flywheel.train.sim.ssd import PENDING, Read, SsdQueue
from hebrus_flywheel.train.sim.trace import DecodeTrace, PredictionSet, boundary_key, moe_key

COUNTERS: dict[str, str] = {
    "demands": "exact selected experts: unique (step, layer, expert) the router chose",
    "demands_ready": "exact experts resident when their MoE was due (any source)",
    "demands_predicted": "exact experts some non-rejected prediction named for that MoE",
    "demands_predicted_ready": "predicted exact experts resident when their MoE was due",
    "exact_misses": "exact experts not resident when due (the runtime had to wait)",
    "late_prefetches": "exact misses whose prefetch was in flight, raised to P0",
    "pollution_misses": "exact misses on an expert last evicted to admit a prefetch",
    "physical_bytes_read": "bytes moved by every read (cancelled or unfinished: so far)",
    "predicted_bytes_read": "bytes transferred by reads a prediction issued",
    "useful_bytes": "predicted bytes whose expert was consumed by an exact demand",
    "rejected_suffix_bytes": "predicted bytes issued only for rejected speculative positions",
    "exact_bytes_read": "bytes transferred by P0 reads the runtime issued itself",
    "predictions_total": "prediction entries given to the simulator",
    "predictions_issued": "predictions that started a read",
    "predictions_already_cached": "predictions whose expert was already resident or loading",
    "predictions_dropped_no_space": "predictions dropped: the cache had no allowed victim",
    "predictions_issued_after_deadline": "predictions whose issue time fell after their MoE",
    "predictions_expired": "prefetch reads cancelled undispatched after their deadline",
    "prefetches_cancelled_by_p0": "in-flight prefetches cancelled to make room for a P0",
    "evictions": "resident experts evicted",
    "evictions_by_prefetch": "evictions made to admit a prefetch",
    "p0_starvation_attempts": "times lower-priority reads stood in a P0 read's way",
    "p1_starvation_attempts": "times P2 reads stood in a P1 read's way",
}


@dataclass(frozen=True, kw_only=True, eq=False)
class SimResult:
    """Raw outcome of one simulation.

    Fields:
        config: the configuration simulated.
        num_rows, num_steps, num_layers, top_k, accepted_tokens: trace shape.
        expert_bytes: bytes of one expert under ``config``.
        counters: every name in :data:`COUNTERS`, as an int.
        step_wait_s: exposed exact wait per forward step, seconds (``num_steps``,).
        slack_s: per exact expert first consumed from a prefetch read, its deadline
            minus its landing time (negative: it landed late), seconds.
        exact_io_wall_time_s: length of the union of [submit, land] intervals of every
            read that served an exact expert (its first consumption).
        sim_time_s: simulated wall time of the whole trace.
        demand_ready: per exact demand in trace order (step, layer, the router's
            order), whether its expert was resident when due (``counters["demands"]``,).
        demand_polluted: per exact demand, whether it missed on an expert last evicted
            to admit a prefetch (the ``pollution_misses`` counter, per demand).
    """

    config: SimConfig
    num_rows: int
    num_steps: int
    num_layers: int
    top_k: int
    accepted_tokens: int
    expert_bytes: int
    counters: dict[str, int]
    step_wait_s: np.ndarray
    slack_s: np.ndarray
    exact_io_wall_time_s: float
    sim_time_s: float
    demand_ready: np.ndarray
    demand_polluted: np.ndarray


def simulate(trace: DecodeTrace, predictions: PredictionSet | None = None,
             config: SimConfig | None = None) -> SimResult:
    """Replay ``trace`` under ``config`` with ``predictions`` (None: no prediction)."""
    config = SimConfig() if config is None else config
    predictions = PredictionSet.empty() if predictions is None else predictions
    if trace.skip_expert != config.geometry.skip_expert:
        raise SimulationError(
            f"the trace's skip class ({trace.skip_expert}) is not its teacher's "
            f"({config.geometry.skip_expert}); build the trace with skip_expert from the "
            "teacher's geometry")
    plan = build_plan(trace, predictions)
    if plan.max_demand > config.capacity_experts:
        raise SimulationError(
            f"the cache holds {config.capacity_experts} experts but one layer of one step "
            f"needs {plan.max_demand}; raise cache_capacity_experts (or _bytes) to at "
            "least the largest per-layer demand"
        )
    return _Run(trace, plan, config).run()


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


class _Run:
    """State of one simulation; ``run`` drives it step by step, layer by layer."""

    def __init__(self, trace: DecodeTrace, plan: Plan, config: SimConfig) -> None:
        self.trace, self.plan, self.config = trace, plan, config
        self.layers, self.experts = trace.num_layers, trace.num_experts
        self.attention = config.attention_times(self.layers)
        self.moe = config.moe_times(self.layers)
        self.ssd = SsdQueue(bandwidth=config.ssd_bandwidth_bytes_per_s,
                            latency=config.ssd_latency_s, depth=config.ssd_queue_depth)
        self.cache = ExpertCache(capacity=config.capacity_experts, policy=config.eviction)
        self.c = dict.fromkeys(COUNTERS, 0)
        self.c["predictions_total"] = len(plan.cache_key)
        self.now, self.key_now = 0.0, -1
        self.pinned: set[int] = set()
        self.scheduled: list[tuple[float, int, list[int]]] = []
        self.expiry: list[tuple[int, int, Read]] = []
        self.polluted: set[int] = set()
        self.slack: list[float] = []
        self.demand_ready, self.demand_polluted = bytearray(), bytearray()
        self.intervals: list[tuple[float, float]] = []
        self.ids = itertools.count()

    def run(self) -> SimResult:
        step_wait = np.zeros(self.trace.num_steps)
        for step in range(self.trace.num_steps):
            for layer in range(self.layers):
                self._boundary(step, layer)
                step_wait[step] += self._layer(step, layer)
            self._boundary(step, self.layers)
            self._advance_to(self.now + self.config.step_overhead_s)
        self._close()
        self.c["p0_starvation_attempts"], self.c["p1_starvation_attempts"] = \
            self.ssd.starvation_attempts
        trace = self.trace
        return SimResult(
            config=self.config, num_rows=trace.num_rows, num_steps=trace.num_steps,
            num_layers=self.layers, top_k=trace.top_k,
            accepted_tokens=trace.accepted_tokens, expert_bytes=self.config.expert_bytes,
            counters=dict(self.c), step_wait_s=step_wait,
            slack_s=np.asarray(self.slack, dtype=float),
            exact_io_wall_time_s=_union_length(self.intervals), sim_time_s=self.now,
            demand_ready=np.frombuffer(bytes(self.demand_ready), dtype=bool),
            demand_polluted=np.frombuffer(bytes(self.demand_polluted), dtype=bool),
        )

    def _close(self) -> None:
        # predictions still waiting for their predictor target MoEs that already ran
        self.c["predictions_issued_after_deadline"] += sum(
            len(group) for _, _, group in self.scheduled)
        # prefetches still in flight when the trace ends count the bytes moved so far
        for entry in self.cache.loading_entries():
            self._account(entry.read, round(entry.read.transferred))

    # --- timeline -------------------------------------------------------------------

    def _boundary(self, step: int, boundary: int) -> None:
        self.key_now = boundary_key(step, boundary, self.layers)
        group = self.plan.issue_groups.get(self.key_now)
        if not group:
            return
        latency = self.config.predictor_latency_s
        if latency == 0.0:
            self._issue(group, self.now)
        else:
            heapq.heappush(self.scheduled, (self.now + latency, next(self.ids), group))

    def _layer(self, step: int, layer: int) -> float:
        due = self.now + self.attention[layer]
        self._advance_to(due)
        self.key_now = moe_key(step, layer, self.layers)
        base = layer * self.experts
        needs = self.plan.needs[step][layer]
        predicted = self.plan.predicted.get(self.key_now, frozenset())
        self.pinned = {base + e for e in needs}
        self.cache.pass_deadlines(self.key_now)
        waiting = [self._demand(base + e, e in predicted, due) for e in needs]
        self._expire()
        ready = self._wait([e for e in waiting if e is not None], due)
        self._advance_to(ready + self.moe[layer])
        self.pinned = set()
        return ready - due

    def _demand(self, key: int, predicted: bool, due: float) -> Entry | None:
        c = self.c
        c["demands"] += 1
        c["demands_predicted"] += predicted
        entry = self.cache.get(key)
        ready = entry is not None and entry.state == RESIDENT
        polluted = not ready and key in self.polluted
        self.demand_ready.append(ready)
        self.demand_polluted.append(polluted)
        if entry is not None and ready:
            c["demands_ready"] += 1
            c["demands_predicted_ready"] += predicted
            self._consume(entry, due)
            return None
        c["exact_misses"] += 1
        c["pollution_misses"] += polluted
        if entry is None:
            entry = self._new_read(key, 0, due, self.key_now, rejected=False)
        else:
            c["late_prefetches"] += 1
            self.ssd.elevate(entry.read, 0)
        self._consume(entry, due)
        return entry

    def _consume(self, entry: Entry, due: float) -> None:
        first = not entry.used
        self.cache.use(entry, self.key_now)
        if not first:
            return
        entry.first_use_at = due
        if entry.origin > 0:
            self.c["useful_bytes"] += entry.read.nbytes
        if entry.state == RESIDENT:
            self._record_first_use(entry)

    def _record_first_use(self, entry: Entry) -> None:
        read = entry.read
        self.intervals.append((read.submit_time, read.landed_at))
        if entry.origin > 0:
            self.slack.append(entry.first_use_at - read.landed_at)

    def _wait(self, waiting: list[Entry], due: float) -> float:
        while any(entry.state != RESIDENT for entry in waiting):
            moment = self._next_time()
            if math.isinf(moment):
                raise SimulationError("internal: an exact read can never land (no SSD "
                                      "activity while the runtime waits); report this bug")
            self._advance_to(moment)
        return max([due, *(entry.landed_at for entry in waiting)])

    # --- time and I/O ---------------------------------------------------------------

    def _next_time(self) -> float:
        scheduled = self.scheduled[0][0] if self.scheduled else math.inf
        return min(self.ssd.next_event_time(), scheduled)

    def _advance_to(self, moment: float) -> None:
        while self.scheduled and self.scheduled[0][0] <= moment:
            when, _, group = heapq.heappop(self.scheduled)
            self._ssd_to(when)
            self._issue(group, when)
        self._ssd_to(moment)
        self.now = max(self.now, moment)

    def _ssd_to(self, moment: float) -> None:
        for read in self.ssd.advance(moment):
            entry = self.cache.get(read.key)
            if entry is None or entry.read is not read:
                raise SimulationError("internal: a landed read has no cache reservation; "
                                      "report this bug")
            self.cache.land(entry, self.key_now)
            self._account(read, read.nbytes)
            if entry.used:
                self._record_first_use(entry)

    def _account(self, read: Read, nbytes: int) -> None:
        self.c["physical_bytes_read"] += nbytes
        if read.origin == 0:
            self.c["exact_bytes_read"] += nbytes
            return
        self.c["predicted_bytes_read"] += nbytes
        if read.rejected:
            self.c["rejected_suffix_bytes"] += nbytes

    def _new_read(self, key: int, priority: int, moment: float, expire_key: int, *,
                  rejected: bool) -> Entry:
        if priority == 0:
            self._make_room_for_p0()
        read = Read(rid=next(self.ids), key=key, nbytes=self.config.expert_bytes,
                    priority=priority, submit_time=moment, expire_key=expire_key,
                    rejected=rejected)
        entry = self.cache.reserve(read)
        self.polluted.discard(key)
        self.ssd.submit(read)
        if priority > 0:
            heapq.heappush(self.expiry, (expire_key, read.rid, read))
        return entry

    def _make_room_for_p0(self) -> None:
        if not self.cache.full():
            return
        victim = self.cache.victim(pinned=self.pinned, deadline_key=None)
        if victim is not None:
            self._evict(victim, by_prefetch=False)
            return
        loading = self.cache.loading_prefetch_victim(self.pinned)
        if loading is None:
            raise SimulationError("internal: no cache slot for an exact read although the "
                                  "capacity covers one layer's demand; report this bug")
        self._cancel(loading)
        self.c["prefetches_cancelled_by_p0"] += 1

    def _evict(self, entry: Entry, *, by_prefetch: bool) -> None:
        self.cache.remove(entry)
        self.c["evictions"] += 1
        if by_prefetch:
            self.c["evictions_by_prefetch"] += 1
            self.polluted.add(entry.key)

    def _cancel(self, entry: Entry) -> None:
        self.ssd.cancel(entry.read)
        self.cache.remove(entry)
        self._account(entry.read, round(entry.read.transferred))

    def _expire(self) -> None:
        while self.expiry and self.expiry[0][0] <= self.key_now:
            _, _, read = heapq.heappop(self.expiry)
            if read.state != PENDING or read.priority == 0 or read.expire_key > self.key_now:
                continue
            entry = self.cache.get(read.key)
            if entry is not None and entry.read is read:
                self._cancel(entry)
                self.c["predictions_expired"] += 1

    # --- predictions ----------------------------------------------------------------

    def _issue(self, group: list[int], moment: float) -> None:
        plan, c = self.plan, self.c
        for i in group:
            key, deadline = plan.cache_key[i], plan.deadline[i]
            if deadline <= self.key_now:
                c["predictions_issued_after_deadline"] += 1
                continue
            entry = self.cache.get(key)
            if entry is not None:
                c["predictions_already_cached"] += 1
                self._merge(entry, plan.priority[i], deadline, plan.rejected[i])
                continue
            if not self._make_room_for_prefetch(deadline):
                c["predictions_dropped_no_space"] += 1
                continue
            entry = self._new_read(key, plan.priority[i], moment, deadline,
                                   rejected=plan.rejected[i])
            self.cache.add_deadline(entry, deadline, self.key_now)
            c["predictions_issued"] += 1

    def _make_room_for_prefetch(self, deadline: int) -> bool:
        if not self.cache.full():
            return True
        victim = self.cache.victim(pinned=self.pinned, deadline_key=deadline)
        if victim is None:
            return False
        self._evict(victim, by_prefetch=True)
        return True

    def _merge(self, entry: Entry, priority: int, deadline: int, rejected: bool) -> None:
        self.cache.add_deadline(entry, deadline, self.key_now)
        if entry.state == RESIDENT or entry.read.priority == 0:
            return
        read = entry.read
        self.ssd.elevate(read, priority)
        read.rejected = read.rejected and rejected
        if deadline > read.expire_key:
            read.expire_key = deadline
            heapq.heappush(self.expiry, (deadline, read.rid, read))
