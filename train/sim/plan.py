"""Precomputed, plain-Python views of a trace and its predictions for the event loop."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hebrus_flywheel.train.sim.trace import DecodeTrace, PredictionSet


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the simulator reads while it runs.

    Fields:
        needs: ``needs[step][layer]``: the step's exact experts at that layer, unique,
            in order of first appearance (row order, then rank); never the trace's skip
            class, which runs no expert and so needs no read.
        predicted: MoE event key -> experts that non-rejected predictions named for
            that MoE (the recall numerator's candidates).
        issue_groups: ready event key -> prediction indices to issue then, ordered by
            priority, deadline, rank, then input order.
        cache_key: per prediction, ``target_layer * E + expert``.
        priority: per prediction, 1 or 2.
        deadline: per prediction, the MoE event key it targets.
        rejected: per prediction, rejected-suffix flag or target row not accepted.
    """

    needs: list[list[list[int]]]
    predicted: dict[int, frozenset[int]]
    issue_groups: dict[int, list[int]]
    cache_key: list[int]
    priority: list[int]
    deadline: list[int]
    rejected: list[bool]

    @property
    def max_demand(self) -> int:
        """Largest number of experts one (step, layer) needs at once."""
        return max(len(layer) for step in self.needs for layer in step)


def build_plan(trace: DecodeTrace, predictions: PredictionSet) -> Plan:
    """Validate ``predictions`` against ``trace`` and precompute the event-loop views.
    A prediction of the skip class names no weights, so it is dropped, not read."""
    predictions.validate_for(trace)
    if trace.skip_expert is not None:
        predictions = predictions.select(predictions.expert != trace.skip_expert)
    deadline = predictions.deadline_keys(trace)
    ready = predictions.ready_keys(trace)
    rejected = predictions.rejected_suffix | ~trace.accepted[predictions.target_row]
    cache_key = predictions.target_layer * trace.num_experts + predictions.expert
    return Plan(
        needs=_needs(trace),
        predicted=_predicted(deadline, predictions.expert, rejected),
        issue_groups=_issue_groups(ready, deadline, predictions),
        cache_key=cache_key.tolist(),
        priority=predictions.priority.tolist(),
        deadline=deadline.tolist(),
        rejected=rejected.tolist(),
    )


def _needs(trace: DecodeTrace) -> list[list[list[int]]]:
    starts = np.flatnonzero(np.diff(trace.step_index, prepend=-1))
    ends = [*starts[1:].tolist(), trace.num_rows]
    needs: list[list[list[int]]] = []
    for start, end in zip(starts.tolist(), ends, strict=True):
        block = trace.routes[start:end]
        if end - start == 1:
            needs.append(block[0].tolist())
            continue
        per_layer = block.transpose(1, 0, 2).reshape(trace.num_layers, -1).tolist()
        needs.append([list(dict.fromkeys(layer)) for layer in per_layer])
    if trace.skip_expert is not None:
        skip = trace.skip_expert
        needs = [[[e for e in layer if e != skip] for layer in step] for step in needs]
    return needs


def _predicted(deadline: np.ndarray, expert: np.ndarray,
               rejected: np.ndarray) -> dict[int, frozenset[int]]:
    keep = ~rejected
    groups: dict[int, set[int]] = {}
    for key, value in zip(deadline[keep].tolist(), expert[keep].tolist(), strict=True):
        groups.setdefault(key, set()).add(value)
    return {key: frozenset(values) for key, values in groups.items()}


def _issue_groups(ready: np.ndarray, deadline: np.ndarray,
                  predictions: PredictionSet) -> dict[int, list[int]]:
    index = np.arange(len(predictions))
    order = np.lexsort((index, predictions.rank, deadline, predictions.priority, ready))
    groups: dict[int, list[int]] = {}
    for key, i in zip(ready[order].tolist(), order.tolist(), strict=True):
        groups.setdefault(key, []).append(i)
    return groups
