"""The one routing geometry every stage shares, derived from the teacher identity.

Legend: L routed layers (slots), E experts per routed layer, K experts chosen per token
and layer, H hidden width, I routed-expert intermediate width.

A *slot* is the position of a routed layer among the routed layers (``0..L-1``); it is
what capture records, window labels and shard columns index. ``routed_layers[slot]`` is
the model's own decoder-layer index, which differs from the slot when a family keeps
some layers dense.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from hebrus_flywheel.core.dtypes import COMPUTE_DTYPE_BYTES
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.identity import TIE_BREAK_SCORE_DESC_ID_ASC

WEIGHT_SOFTMAX_TOPK_RENORMALIZED = "softmax_topk_renormalized"
WEIGHT_SOFTMAX_TOPK = "softmax_topk"
WEIGHT_RULES: tuple[str, ...] = (WEIGHT_SOFTMAX_TOPK_RENORMALIZED, WEIGHT_SOFTMAX_TOPK)
"""How the recorded weights derive from the router logits."""
SKIP_LAST_SUFFIX = "_skiplast"
"""A ``weight_rule`` ending so names a router whose last class is a skip class (ZAYA): a
token that selects it runs no expert in that slot, so it is a label like any expert id
but no runtime ever reads it (:attr:`RouteGeometry.skip_expert`)."""


@dataclass(frozen=True, kw_only=True)
class RouteGeometry:
    """The routing shape of one teacher.

    Fields:
        family: transformers ``model_type`` (e.g. ``qwen3_next``).
        routed_layers: model decoder-layer index of each routed slot, ascending (L).
        layer_count: decoder layers in the model, routed or not.
        expert_count: routed experts per layer (E): the router's classes, which include
            the skip class where the rule has one (:attr:`skip_expert`).
        top_k: experts selected per token and layer (K).
        hidden_size: residual stream width (H).
        routed_intermediate_size: per-expert intermediate width (I).
        weight_rule: how weights derive from logits; the teacher writes one of
            :data:`WEIGHT_RULES`, runtimes may name others.
        tie_break_rule: how equal router scores are ordered.
    """

    family: str
    routed_layers: tuple[int, ...]
    layer_count: int
    expert_count: int
    top_k: int
    hidden_size: int
    routed_intermediate_size: int
    weight_rule: str = WEIGHT_SOFTMAX_TOPK_RENORMALIZED
    tie_break_rule: str = TIE_BREAK_SCORE_DESC_ID_ASC
    _slots: Mapping[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "routed_layers", tuple(int(i) for i in self.routed_layers))
        for name in ("layer_count", "expert_count", "top_k", "hidden_size",
                     "routed_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"RouteGeometry.{name} must be a positive integer, "
                                  f"got {value!r}")
        layers = self.routed_layers
        if not layers:
            raise ConfigError("RouteGeometry.routed_layers must name at least one layer")
        if list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= self.layer_count:
            raise ConfigError(f"RouteGeometry.routed_layers must be ascending, distinct and in "
                              f"[0, layer_count={self.layer_count}), got {list(layers)}")
        if self.top_k > self.expert_count:
            raise ConfigError(f"RouteGeometry.top_k ({self.top_k}) exceeds expert_count "
                              f"({self.expert_count})")
        if not isinstance(self.weight_rule, str) or not self.weight_rule:
            raise ConfigError(f"RouteGeometry.weight_rule must name a rule (e.g. one of "
                              f"{WEIGHT_RULES}), got {self.weight_rule!r}")
        if self.weight_rule.endswith(SKIP_LAST_SUFFIX) and self.expert_count < 2:
            raise ConfigError("RouteGeometry.expert_count must be >= 2 with a skip class "
                              "(at least one expert besides it)")
        object.__setattr__(self, "_slots", {layer: s for s, layer in enumerate(layers)})

    @property
    def skip_expert(self) -> int | None:
        """The id of the skip class (the last, ``E - 1``) if the rule has one, else None."""
        return self.expert_count - 1 if self.weight_rule.endswith(SKIP_LAST_SUFFIX) else None

    @property
    def streamed_expert_count(self) -> int:
        """Experts per routed layer that have weights to stream (E less a skip class)."""
        return self.expert_count - (self.skip_expert is not None)

    @property
    def routed_layer_count(self) -> int:
        """L: routed slots per token."""
        return len(self.routed_layers)

    def slot_of(self, model_layer: int) -> int:
        """The routed slot of a model decoder-layer index; ConfigError if it is dense."""
        try:
            return self._slots[model_layer]
        except KeyError:
            raise ConfigError(f"model layer {model_layer} is not routed; routed layers are "
                              f"{list(self.routed_layers)}") from None

    def expert_bytes(self, dtype_bytes: float) -> float:
        """Bytes of one routed expert's gate, up and down projections."""
        return 3 * self.hidden_size * self.routed_intermediate_size * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (``routed_layers`` as a list)."""
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["routed_layers"] = list(self.routed_layers)
        return out

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> RouteGeometry:
        """The inverse of :meth:`to_dict`; unknown keys are an error."""
        known = {f for f in cls.__dataclass_fields__ if not f.startswith("_")}
        extra = set(fields) - known
        if extra:
            raise ConfigError(f"unknown RouteGeometry fields {sorted(extra)}")
        values: dict[str, Any] = dict(fields)
        if "routed_layers" in values:
            values["routed_layers"] = tuple(values["routed_layers"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"incomplete RouteGeometry: {exc}") from exc

    @classmethod
    def from_identity(cls, identity: Mapping[str, Any]) -> RouteGeometry:
        """The geometry a ``RuntimeIdentity`` record pins.

        Identity records name the routed-layer count, not the model layer of each slot;
        unless the record carries ``routed_layers`` the slots are taken as contiguous
        model layers ``0..L-1`` (true of every family this project ships adapters for).
        """
        count = int(identity["routed_layer_count"])
        layers = tuple(identity.get("routed_layers") or range(count))
        return cls(
            family=str(identity["model_family"]),
            routed_layers=layers,
            layer_count=int(identity.get("layer_count") or (max(layers) + 1)),
            expert_count=int(identity["expert_count"]),
            top_k=int(identity["top_k"]),
            hidden_size=int(identity["hidden_size"]),
            routed_intermediate_size=int(identity["routed_intermediate_size"]),
            weight_rule=str(identity["weight_rule"]),
            tie_break_rule=str(identity["tie_break_rule"]),
        )


UNQUANTIZED = "none"


def teacher_budgets(top_k: int) -> tuple[int, ...]:
    """The candidate budgets every evaluation uses: k, 2k, 3k and 4k of the teacher's k."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {top_k!r}")
    return tuple(m * top_k for m in (1, 2, 3, 4))


def weight_dtype_bytes(dtype: str, quantization: str = UNQUANTIZED) -> float:
    """Bytes per stored weight element of an unquantized ``dtype``; ConfigError otherwise."""
    if quantization != UNQUANTIZED:
        raise ConfigError(f"quantization {quantization!r}: expert bytes are only derived for "
                          "unquantized teachers (quantization 'none')")
    if dtype not in COMPUTE_DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} has no known element size; one of "
                          f"{sorted(COMPUTE_DTYPE_BYTES)}")
    return float(COMPUTE_DTYPE_BYTES[dtype])


@dataclass(frozen=True, kw_only=True)
class StreamGeometry:
    """What an SSD-streaming runtime of one teacher reads: routed experts only.

    Shared experts and the MLPs of dense layers run for every token, so they stay
    resident and are never streamed; only the routed experts of each of the
    ``routed_layer_count`` routed layers are (``expert_count`` less a skip class, which
    has no weights). Built from the identity alone (no
    model load), so qualification, the simulator and the predictor figures size bytes
    with this one function.

    Fields:
        route: the teacher's routing geometry.
        dtype: the dtype the teacher executes (the identity's ``dtype``).
        dtype_bytes: bytes per weight element of ``dtype``.
    """

    route: RouteGeometry
    dtype: str
    dtype_bytes: float

    def __post_init__(self) -> None:
        if not isinstance(self.route, RouteGeometry):
            raise ConfigError("StreamGeometry.route must be a RouteGeometry")
        if not (isinstance(self.dtype_bytes, int | float) and self.dtype_bytes > 0):
            raise ConfigError(f"StreamGeometry.dtype_bytes must be > 0, got {self.dtype_bytes!r}")

    @classmethod
    def from_identity(cls, identity: Mapping[str, Any]) -> StreamGeometry:
        """The stream geometry a ``RuntimeIdentity`` record pins."""
        dtype = str(identity["dtype"])
        quantization = str(identity.get("quantization") or UNQUANTIZED)
        return cls(route=RouteGeometry.from_identity(identity), dtype=dtype,
                   dtype_bytes=weight_dtype_bytes(dtype, quantization))

    @property
    def expert_bytes(self) -> int:
        """One routed expert: intermediate x hidden x 3 matrices x dtype bytes."""
        return round(self.route.expert_bytes(self.dtype_bytes))

    @property
    def budgets(self) -> tuple[int, ...]:
        """k, 2k, 3k, 4k (:func:`teacher_budgets`)."""
        return teacher_budgets(self.route.top_k)

    def to_dict(self) -> dict[str, Any]:
        """The figures a report prints: shape, element size, streamed and resident parts."""
        r = self.route
        return {
            "family": r.family, "layer_count": r.layer_count,
            "routed_layer_count": r.routed_layer_count,
            "dense_layer_count": r.layer_count - r.routed_layer_count,
            "expert_count": r.expert_count, "top_k": r.top_k, "hidden_size": r.hidden_size,
            "routed_intermediate_size": r.routed_intermediate_size, "dtype": self.dtype,
            "dtype_bytes": self.dtype_bytes, "expert_bytes": self.expert_bytes,
            "streamed_expert_count": r.streamed_expert_count,
            "skip_class": r.skip_expert is not None,
            # at most: a token that selects the skip class reads one expert fewer
            "streamed_bytes_per_token": r.routed_layer_count * r.top_k * self.expert_bytes,
            "routed_expert_bytes_total": r.routed_layer_count * r.streamed_expert_count
            * self.expert_bytes,
            "resident": "shared experts, dense layers, attention and embeddings (not streamed)",
            "budgets": list(self.budgets),
        }
