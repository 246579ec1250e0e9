"""The simulator's inputs: a real decode trace and a set of timed predictions.

Both are frozen containers of read-only numpy arrays, validated on construction
(:class:`~train.sim.errors.TraceError` names the offending field).

**Decode trace** (:class:`DecodeTrace`). One *row* per executed token position, in
decode order. ``routes[row, layer]`` holds the native router's top-K expert ids for that
position at that routed layer, rank 0 first. Rows that share a ``step`` value run in one
forward pass (batched decode of interleaved sequences, or one speculative verification
block): their layers execute together, so layer ``l`` of that step needs the union of
their layer-``l`` routes. ``accepted`` marks rows that became output tokens (a verified
position the verifier rejected is executed but not accepted). ``sequence`` names the
sequence a row belongs to (used by the break-even windows).

**Event timeline.** Each forward step ``s`` of a trace with ``L`` layers has ``L + 1``
*boundaries* ``b``: ``b < L`` is the start of layer ``b`` (its pre-attention feature
exists), ``b == L`` is the end of the step's target forward (e.g. DFlash context taps).
The MoE of layer ``l`` in step ``s`` is the deadline of that layer's experts. Events are
totally ordered by :func:`boundary_key` / :func:`moe_key`.

**Predictions** (:class:`PredictionSet`), one entry per candidate expert, all arrays of
length ``N``: ``target_row``/``target_layer`` name the MoE the read is meant for (its
deadline); ``expert`` the predicted expert id; ``rank`` its position in that candidate
list (0 = best; a candidate budget ``k`` keeps ``rank < k``); ``priority`` 1 (P1:
near-term, e.g. from the pre-attention feature) or 2 (P2: long-range, discardable, e.g.
a DFlash candidate-position feature); ``ready_row``/``ready_boundary`` the event at which
the prediction's input exists (boundary of ``ready_row``'s step); ``rejected_suffix``
marks a candidate made for a speculative position the verifier later rejected: its
target fields then name the committed position that replaced it (its deadline anchor),
its experts are the rejected path's, and they never count as predictions of the
committed row's route. Predictions whose target row is not ``accepted`` are treated as
rejected-suffix reads too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hebrus_flywheel.train.sim.errors import TraceError


def boundary_key(step: int, boundary: int, num_layers: int) -> int:
    """Total-order key of boundary ``boundary`` (0..L) of forward step ``step``."""
    return step * (2 * num_layers + 1) + 2 * boundary


def moe_key(step: int, layer: int, num_layers: int) -> int:
    """Total-order key of the MoE (deadline) of ``layer`` in forward step ``step``."""
    return step * (2 * num_layers + 1) + 2 * layer + 1


def _readonly(array: np.ndarray) -> np.ndarray:
    array = np.array(array, copy=True)
    array.setflags(write=False)
    return array


def _int_array(name: str, value: object, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != ndim:
        raise TraceError(f"{name} must have {ndim} dimension(s), got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TraceError(f"{name} must hold integers, got dtype {array.dtype}")
    return _readonly(array.astype(np.int64))


def _in_range(name: str, array: np.ndarray, low: int, high: int) -> None:
    if array.size and (array.min() < low or array.max() >= high):
        raise TraceError(
            f"{name} values must lie in [{low}, {high}), got [{array.min()}, {array.max()}]"
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class DecodeTrace:
    """Exact native routes of a real decode run (see the module docstring).

    Fields:
        routes: int array ``(rows, layers, K)``; distinct expert ids per (row, layer).
        num_experts: routed experts per layer (``E``); ids lie in ``[0, E)``.
        step: int array ``(rows,)``, non-decreasing forward-step ids; ``None`` means one
            row per step (plain autoregressive decode).
        accepted: bool array ``(rows,)``; ``None`` means every row was accepted.
        sequence: int array ``(rows,)`` of sequence ids; ``None`` means one sequence.
        skip_expert: the id of a skip class (ZAYA's router: a slot that runs no expert),
            which no read serves and no prediction fetches; None when the router has none.
    """

    routes: np.ndarray
    num_experts: int
    step: np.ndarray = None  # type: ignore[assignment]  # None: one row per step
    accepted: np.ndarray = None  # type: ignore[assignment]  # None: all accepted
    sequence: np.ndarray = None  # type: ignore[assignment]  # None: one sequence
    skip_expert: int | None = None
    step_index: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) \
                or self.num_experts < 1:
            raise TraceError(f"num_experts must be a positive integer, got {self.num_experts!r}")
        routes = _int_array("routes", self.routes, 3)
        if routes.shape[0] < 1 or routes.shape[1] < 1 or routes.shape[2] < 1:
            raise TraceError(f"routes needs >= 1 row, layer and expert, got {routes.shape}")
        _in_range("routes", routes, 0, self.num_experts)
        if self.skip_expert is not None and not 0 <= self.skip_expert < self.num_experts:
            raise TraceError(f"skip_expert must lie in [0, {self.num_experts}), "
                             f"got {self.skip_expert!r}")
        ordered = np.sort(routes, axis=2)
        if np.any(ordered[:, :, 1:] == ordered[:, :, :-1]):
            raise TraceError("routes repeats an expert id within one (row, layer) top-K")
        object.__setattr__(self, "routes", routes)
        object.__setattr__(self, "step", self._steps(routes.shape[0]))
        object.__setattr__(self, "accepted", self._accepted(routes.shape[0]))
        sequence = np.zeros(routes.shape[0], np.int64) if self.sequence is None \
            else _int_array("sequence", self.sequence, 1)
        self._check_length("sequence", sequence)
        object.__setattr__(self, "sequence", _readonly(sequence))
        step_index = np.unique(self.step, return_inverse=True)[1].reshape(-1)
        object.__setattr__(self, "step_index", _readonly(step_index.astype(np.int64)))

    def _check_length(self, name: str, array: np.ndarray) -> None:
        if array.shape != (self.routes.shape[0],):
            raise TraceError(
                f"{name} must have one entry per trace row ({self.routes.shape[0]}), "
                f"got shape {array.shape}"
            )

    def _steps(self, rows: int) -> np.ndarray:
        if self.step is None:
            return _readonly(np.arange(rows, dtype=np.int64))
        step = _int_array("step", self.step, 1)
        self._check_length("step", step)
        if np.any(np.diff(step) < 0):
            raise TraceError("step must be non-decreasing: rows of one forward step are "
                             "contiguous and steps appear in execution order")
        return step

    def _accepted(self, rows: int) -> np.ndarray:
        if self.accepted is None:
            return _readonly(np.ones(rows, dtype=bool))
        accepted = np.asarray(self.accepted)
        if accepted.dtype != np.bool_:
            raise TraceError(f"accepted must be a bool array, got dtype {accepted.dtype}")
        self._check_length("accepted", accepted)
        return _readonly(accepted)

    @property
    def num_rows(self) -> int:
        """Executed token positions (rows)."""
        return int(self.routes.shape[0])

    @property
    def num_layers(self) -> int:
        """Routed layers per row."""
        return int(self.routes.shape[1])

    @property
    def top_k(self) -> int:
        """Experts selected per (row, layer)."""
        return int(self.routes.shape[2])

    @property
    def num_steps(self) -> int:
        """Forward steps (distinct ``step`` values)."""
        return int(self.step_index[-1]) + 1

    @property
    def accepted_tokens(self) -> int:
        """Rows that became output tokens."""
        return int(np.count_nonzero(self.accepted))


@dataclass(frozen=True, kw_only=True, eq=False)
class PredictionSet:
    """Timed expert-prefetch candidates (see the module docstring for each field).

    All fields are 1-D arrays of one length ``N``; ``rejected_suffix`` defaults to all
    False. Validate against a trace with :meth:`validate_for`.
    """

    target_row: np.ndarray
    target_layer: np.ndarray
    expert: np.ndarray
    rank: np.ndarray
    priority: np.ndarray
    ready_row: np.ndarray
    ready_boundary: np.ndarray
    rejected_suffix: np.ndarray = None  # type: ignore[assignment]  # None: all False

    _INT_FIELDS = ("target_row", "target_layer", "expert", "rank", "priority",
                   "ready_row", "ready_boundary")

    def __post_init__(self) -> None:
        for name in self._INT_FIELDS:
            object.__setattr__(self, name, _int_array(name, getattr(self, name), 1))
        size = self.expert.shape[0]
        rejected = np.zeros(size, bool) if self.rejected_suffix is None \
            else np.asarray(self.rejected_suffix)
        if rejected.dtype != np.bool_:
            raise TraceError(f"rejected_suffix must be a bool array, got {rejected.dtype}")
        object.__setattr__(self, "rejected_suffix", _readonly(rejected))
        for name in (*self._INT_FIELDS, "rejected_suffix"):
            if getattr(self, name).shape != (size,):
                raise TraceError(f"{name} has shape {getattr(self, name).shape}; every "
                                 f"prediction field must have shape ({size},)")
        if size and (self.rank.min() < 0):
            raise TraceError("rank must be >= 0 (0 = the best candidate)")
        if size and not np.isin(self.priority, (1, 2)).all():
            raise TraceError("priority must be 1 (P1, near-term) or 2 (P2, discardable); "
                             "P0 is reserved for the runtime's blocking exact reads")

    def __len__(self) -> int:
        return int(self.expert.shape[0])

    @classmethod
    def empty(cls) -> PredictionSet:
        """A set with no predictions (the no-prediction baseline)."""
        zero = np.zeros(0, np.int64)
        return cls(target_row=zero, target_layer=zero, expert=zero, rank=zero,
                   priority=zero, ready_row=zero, ready_boundary=zero)

    @classmethod
    def concatenate(cls, *sets: PredictionSet) -> PredictionSet:
        """One set holding every entry of ``sets``, in order (e.g. P1 and P2 sources)."""
        if not sets:
            return cls.empty()
        fields = {name: np.concatenate([getattr(s, name) for s in sets])
                  for name in (*cls._INT_FIELDS, "rejected_suffix")}
        return cls(**fields)

    def select(self, mask: np.ndarray) -> PredictionSet:
        """The subset where boolean ``mask`` is True."""
        fields = {name: getattr(self, name)[mask] for name in self._INT_FIELDS}
        return PredictionSet(**fields, rejected_suffix=self.rejected_suffix[mask])

    def within_budget(self, budget: int | None) -> PredictionSet:
        """Candidates with ``rank < budget`` (``None`` keeps all)."""
        if budget is None:
            return self
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise TraceError(f"candidate budget must be a non-negative integer or None, "
                             f"got {budget!r}")
        return self.select(self.rank < budget)

    def validate_for(self, trace: DecodeTrace) -> None:
        """Raise :class:`TraceError` unless every id fits ``trace`` and every input
        exists no later than the deadline it targets."""
        rows, layers = trace.num_rows, trace.num_layers
        _in_range("target_row", self.target_row, 0, rows)
        _in_range("ready_row", self.ready_row, 0, rows)
        _in_range("target_layer", self.target_layer, 0, layers)
        _in_range("ready_boundary", self.ready_boundary, 0, layers + 1)
        _in_range("expert", self.expert, 0, trace.num_experts)
        ready = self.ready_keys(trace)
        deadline = self.deadline_keys(trace)
        late = np.flatnonzero(ready > deadline)
        if late.size:
            i = int(late[0])
            raise TraceError(
                f"prediction {i} (and {late.size - 1} more) has its input at row "
                f"{self.ready_row[i]} boundary {self.ready_boundary[i]}, after the MoE "
                f"of row {self.target_row[i]} layer {self.target_layer[i]} it targets; "
                "a prediction must come from input that exists before its deadline"
            )

    def ready_keys(self, trace: DecodeTrace) -> np.ndarray:
        """Event key at which each prediction's input exists."""
        steps = trace.step_index[self.ready_row]
        return steps * (2 * trace.num_layers + 1) + 2 * self.ready_boundary

    def deadline_keys(self, trace: DecodeTrace) -> np.ndarray:
        """Event key of the MoE each prediction targets."""
        steps = trace.step_index[self.target_row]
        return steps * (2 * trace.num_layers + 1) + 2 * self.target_layer + 1


class PredictionBuilder:
    """Accumulates ranked candidate lists into a :class:`PredictionSet`.

    ``add`` takes one ordered candidate list for one (target row, target layer); the
    list position becomes ``rank``.
    """

    def __init__(self) -> None:
        self._columns: dict[str, list[int]] = {name: [] for name in PredictionSet._INT_FIELDS}
        self._rejected: list[bool] = []

    def add(self, *, target_row: int, target_layer: int, experts: Iterable[int],
            priority: int, ready_row: int, ready_boundary: int,
            rejected_suffix: bool = False) -> None:
        """Append one candidate list (``experts`` best first)."""
        for rank, expert in enumerate(experts):
            values = (target_row, target_layer, int(expert), rank, priority, ready_row,
                      ready_boundary)
            for name, value in zip(PredictionSet._INT_FIELDS, values, strict=True):
                self._columns[name].append(int(value))
            self._rejected.append(bool(rejected_suffix))

    def build(self) -> PredictionSet:
        """The accumulated predictions."""
        arrays = {name: np.asarray(values, dtype=np.int64)
                  for name, values in self._columns.items()}
        return PredictionSet(**arrays, rejected_suffix=np.asarray(self._rejected, bool))
