"""Configuration of the shadow SSD-prefetch simulator.

The model shape comes from the teacher: :meth:`SimConfig.for_teacher` takes the
:class:`~core.geometry.StreamGeometry` of a runtime identity (expert bytes = routed
intermediate x hidden x 3 matrices x the identity dtype's bytes; shared experts and
dense layers are resident, not streamed) and sizes the cache as a fraction of the
teacher's routed experts. The timing, SSD and cache-fraction defaults are
*illustrative* deployment settings, not measurements; a qualification run declares the
figures it used (``to_dict`` gives a record for the report). The bare ``SimConfig()``
default geometry (:data:`ILLUSTRATIVE_GEOMETRY`) only serves the simulator's own unit
tests and ``bench/sim.py``; qualification never uses it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import RouteGeometry, StreamGeometry

EvictionPolicy = Literal["lru", "priority"]
EVICTION_POLICIES: tuple[str, ...] = ("lru", "priority")

LayerTimes = float | tuple[float, ...]

ILLUSTRATIVE_GEOMETRY = RouteGeometry(
    family="qwen4exp_illustrative", routed_layers=tuple(range(48)), layer_count=48,
    expert_count=512, top_k=10, hidden_size=2048, routed_intermediate_size=640)
"""The default model shape: Qwen4Exp-like (public config: intermediate 640), not a
measurement; only ``hidden_size`` and ``routed_intermediate_size`` set expert bytes."""
DEFAULT_CACHE_FRACTION = 0.125
"""Resident-cache share of a teacher's routed experts (``L x E``) when none is declared:
the illustrative default's 3072 of 48 x 512 experts; a deployment setting."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Geometry, compute timeline, SSD and cache of one simulated runtime.

    Fields:
        geometry: the model shape, the base :class:`RouteGeometry` (default
            :data:`ILLUSTRATIVE_GEOMETRY`); no geometry field lives here.
        dtype_bytes: bytes per stored weight element, a deployment setting (2.0 = bf16;
            0.5 = 4-bit without scales). One expert is
            ``geometry.expert_bytes(dtype_bytes)`` bytes (gate, up and down
            projections), rounded to an integer.
        attention_time_s: per-layer compute before the MoE (attention / GDN / QSA), in
            seconds; a float for every layer or a tuple with one value per layer. The
            MoE of layer ``l`` (the *deadline* of its experts) starts this long after
            the layer starts, if nothing blocks.
        moe_time_s: per-layer MoE compute after every needed expert is resident
            (float or per-layer tuple, seconds). Layer ``l+1`` starts when it ends.
        step_overhead_s: time after the last layer of a forward step (LM head,
            sampling, drafting) before the next step starts, in seconds.
        predictor_latency_s: delay between a prediction's input existing and its read
            being issued (the sidecar's own inference time), in seconds.
        ssd_bandwidth_bytes_per_s: aggregate SSD read bandwidth shared by all reads.
        ssd_latency_s: fixed per-request latency paid after dispatch, before transfer;
            the latencies of concurrent requests overlap.
        ssd_queue_depth: maximum reads in flight (dispatched and not landed).
        cache_capacity_experts: resident-expert cache size in experts (one expert of
            one layer each); a read reserves its slot when it is issued. Exactly one
            of this and ``cache_capacity_bytes`` is set.
        cache_capacity_bytes: the same capacity in bytes, floored to whole experts.
        eviction: ``"lru"`` (least recently used, deadline-unaware) or ``"priority"``
            (first never-used prefetches whose deadline passed, then LRU among entries
            no prediction still wants, then the wanted entry whose next predicted use
            is furthest away; a prefetch never evicts an entry wanted sooner than
            itself). Both never evict an expert the running layer needs.
    """

    geometry: RouteGeometry = field(default_factory=lambda: ILLUSTRATIVE_GEOMETRY)
    dtype_bytes: float = 2.0
    attention_time_s: LayerTimes = 250e-6
    moe_time_s: LayerTimes = 150e-6
    step_overhead_s: float = 1e-3
    predictor_latency_s: float = 0.0
    ssd_bandwidth_bytes_per_s: float = 6.0e9
    ssd_latency_s: float = 80e-6
    ssd_queue_depth: int = 32
    cache_capacity_experts: int | None = 3072
    cache_capacity_bytes: int | None = None
    eviction: EvictionPolicy = "priority"

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, RouteGeometry):
            raise ConfigError("geometry must be a RouteGeometry (family, routed_layers, "
                              "layer_count, expert_count, top_k, hidden_size, "
                              f"routed_intermediate_size), got {type(self.geometry).__name__}")
        _positive_ints(self, "ssd_queue_depth")
        _finite(self, "dtype_bytes", minimum=0.0, strict=True)
        _finite(self, "ssd_bandwidth_bytes_per_s", minimum=0.0, strict=True)
        for name in ("step_overhead_s", "predictor_latency_s", "ssd_latency_s"):
            _finite(self, name, minimum=0.0, strict=False)
        for name in ("attention_time_s", "moe_time_s"):
            _layer_times(self, name)
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(
                f"eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}"
            )
        self._check_capacity()
        if self.expert_bytes < 1:
            raise ConfigError(
                "dtype_bytes is too small: one expert would hold less than one byte; "
                "raise dtype_bytes or the geometry"
            )

    def _check_capacity(self) -> None:
        experts, nbytes = self.cache_capacity_experts, self.cache_capacity_bytes
        if (experts is None) == (nbytes is None):
            raise ConfigError(
                "set exactly one of cache_capacity_experts and cache_capacity_bytes "
                "(set the other to None)"
            )
        if experts is not None:
            _positive_ints(self, "cache_capacity_experts")
        else:
            _positive_ints(self, "cache_capacity_bytes")

    @classmethod
    def for_teacher(cls, stream: StreamGeometry, **fields: Any) -> SimConfig:
        """The simulator of ``stream``'s teacher: its geometry and dtype bytes; the cache
        holds :data:`DEFAULT_CACHE_FRACTION` of its routed experts unless ``fields`` set
        a capacity. ``fields`` may not set ``geometry`` or ``dtype_bytes``: they come
        from the identity only."""
        fixed = sorted({"geometry", "dtype_bytes"} & set(fields))
        if fixed:
            raise ConfigError(f"{fixed} come from the teacher's identity (StreamGeometry); "
                              "they cannot be overridden")
        if "cache_capacity_experts" not in fields and "cache_capacity_bytes" not in fields:
            routed = stream.route.routed_layer_count * stream.route.streamed_expert_count
            fields["cache_capacity_experts"] = max(stream.route.top_k,
                                                   round(DEFAULT_CACHE_FRACTION * routed))
        elif fields.get("cache_capacity_experts") is not None:
            fields.setdefault("cache_capacity_bytes", None)
        else:
            fields.setdefault("cache_capacity_experts", None)
        return cls(geometry=stream.route, dtype_bytes=stream.dtype_bytes, **fields)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert: intermediate × hidden × 3 matrices × dtype bytes."""
        return round(self.geometry.expert_bytes(self.dtype_bytes))

    def to_dict(self) -> dict[str, Any]:
        """Plain fields for a report: ``geometry`` as :meth:`RouteGeometry.to_dict`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["geometry"] = self.geometry.to_dict()
        return out

    @property
    def capacity_experts(self) -> int:
        """Cache capacity in whole experts."""
        if self.cache_capacity_experts is not None:
            return self.cache_capacity_experts
        return int(self.cache_capacity_bytes or 0) // self.expert_bytes

    def attention_times(self, num_layers: int) -> tuple[float, ...]:
        """``attention_time_s`` expanded to one value per layer."""
        return _expand("attention_time_s", self.attention_time_s, num_layers)

    def moe_times(self, num_layers: int) -> tuple[float, ...]:
        """``moe_time_s`` expanded to one value per layer."""
        return _expand("moe_time_s", self.moe_time_s, num_layers)


def _expand(name: str, value: LayerTimes, num_layers: int) -> tuple[float, ...]:
    if isinstance(value, tuple):
        if len(value) != num_layers:
            raise ConfigError(
                f"{name} has {len(value)} per-layer values but the trace has "
                f"{num_layers} routed layers; give one value per layer or a single float"
            )
        return tuple(float(v) for v in value)
    return (float(value),) * num_layers


def _positive_ints(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _finite(config: object, name: str, *, minimum: float, strict: bool) -> None:
    value = getattr(config, name)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")


def _layer_times(config: object, name: str) -> None:
    value = getattr(config, name)
    values = value if isinstance(value, tuple) else (value,)
    if not values:
        raise ConfigError(f"{name} must be a float or a non-empty tuple of floats")
    for item in values:
        ok = isinstance(item, int | float) and not isinstance(item, bool)
        if not (ok and math.isfinite(item) and item >= 0.0):
            raise ConfigError(
                f"{name} must be a finite number >= 0 seconds (or a tuple of them), "
                f"got {value!r}"
            )
