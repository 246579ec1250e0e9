"""The sidecar feature contract: a fixed, seeded projection of pre-attention hidden states.

The route sidecar's input at (token, routed layer) is the residual stream entering that
layer (the input of its ``input_layernorm``), reduced from width H to width D by ONE
fixed matrix ``P[H, D]`` and stored as fp16. ``P`` is a pure function of
``(seed, H, D)``:

- entries are i.i.d. standard normal, scaled by ``1/sqrt(D)`` (a Johnson-Lindenstrauss
  projection: ``E[|x P|^2] = |x|^2``, so feature magnitudes match hidden magnitudes);
- the normals come from NumPy's PCG64 *bit stream* (``random_raw``), seeded by a
  ``SeedSequence`` of ``(tag, seed, H, D)``, turned into uniforms with 53-bit mantissas
  and into normals with Box-Muller here. NumPy guarantees the bit generator's raw stream
  across versions and platforms (it does not promise that for ``Generator.normal``), so
  the same triple gives the same matrix anywhere.

:func:`projection_digest` (SHA-256 over a header and the float32 little-endian bytes)
pins the contract: manifests record it, and a reader that regenerates ``P`` checks it.

:meth:`FeatureProjection.lift` maps reduced features back to width H with the
Moore-Penrose pseudo-inverse (exact up to fp16 rounding when ``D >= H``, the
minimum-norm least-squares estimate otherwise), so the native-gate baseline can apply a
router to a lifted pre-attention state.

:func:`capture_anchor_rows` reads the feature source (and the router logits) of chosen
rows during one forward; :mod:`replay.prefill` uses it.

Tensor legend: N rows, L routed layers, E experts, H hidden width, D reduced width.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.exceptions import ReplayError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hebrus_flywheel.replay.teacher import Teacher

PROJECTION_FORMAT = "flywheel-feature-projection/v1"
FEATURE_SOURCE = "pre_attention_residual"
FEATURE_DTYPES: dict[str, Any] = {"float16": np.float16, "float32": np.float32}
_SEED_TAG = 0x464C5957  # "FLYW"
_U53 = 1.0 / float(1 << 53)


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _standard_normals(seed: int, hidden_size: int, feature_dim: int) -> np.ndarray:
    """``H * D`` standard normals from the PCG64 raw stream (float64, Box-Muller)."""
    sequence = np.random.SeedSequence([_SEED_TAG, seed, hidden_size, feature_dim])
    bits = np.random.PCG64(sequence)
    count = hidden_size * feature_dim
    pairs = (count + 1) // 2
    raw = bits.random_raw(2 * pairs)
    uniforms = (raw >> np.uint64(11)).astype(np.float64) * _U53
    u1 = 1.0 - uniforms[0::2]  # (0, 1]: log is finite
    u2 = uniforms[1::2]
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2.0 * np.pi * u2
    normals = np.empty(2 * pairs, dtype=np.float64)
    normals[0::2] = radius * np.cos(angle)
    normals[1::2] = radius * np.sin(angle)
    return normals[:count]


def projection_matrix(seed: int, hidden_size: int, feature_dim: int) -> np.ndarray:
    """The fixed projection ``P[H, D]`` (float32) of ``(seed, H, D)``; see the module doc."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or int(seed) < 0:
        raise ConfigError(f"projection_seed must be a non-negative integer, got {seed!r}")
    h = _check_positive_int("hidden_size", hidden_size)
    d = _check_positive_int("feature_dim", feature_dim)
    normals = _standard_normals(int(seed), h, d) / np.sqrt(d)
    return normals.reshape(h, d).astype(np.float32)


def projection_digest(matrix_HD: np.ndarray, seed: int) -> str:
    """Hex SHA-256 of the format tag, seed, shape and the float32 LE bytes of ``P``."""
    h, d = matrix_HD.shape
    digest = hashlib.sha256(f"{PROJECTION_FORMAT}|seed={seed}|H={h}|D={d}|".encode())
    digest.update(np.ascontiguousarray(matrix_HD, dtype="<f4").tobytes())
    return digest.hexdigest()


@dataclass(frozen=True, eq=False)
class FeatureProjection:
    """The projection ``P[H, D]`` of one ``(seed, H, D)`` and its digest.

    Build it with :meth:`create`. ``matrix_HD`` is read-only float32.
    """

    seed: int
    hidden_size: int
    feature_dim: int
    matrix_HD: np.ndarray = field(repr=False)
    digest: str

    @classmethod
    def create(cls, *, seed: int, hidden_size: int, feature_dim: int) -> FeatureProjection:
        matrix_HD = projection_matrix(seed, hidden_size, feature_dim)
        matrix_HD.setflags(write=False)
        return cls(seed=int(seed), hidden_size=int(hidden_size), feature_dim=int(feature_dim),
                   matrix_HD=matrix_HD, digest=projection_digest(matrix_HD, int(seed)))

    def reduce(self, hidden_NH: np.ndarray, *, dtype: str = "float16") -> np.ndarray:
        """``hidden @ P`` in float32, cast to ``dtype`` (any leading shape)."""
        if dtype not in FEATURE_DTYPES:
            raise ConfigError(
                f"feature dtype must be one of {sorted(FEATURE_DTYPES)}, got {dtype!r}"
            )
        hidden = np.asarray(hidden_NH, dtype=np.float32)
        if hidden.shape[-1:] != (self.hidden_size,):
            raise ConfigError(
                f"hidden states have width {hidden.shape[-1:]} but the projection expects "
                f"{self.hidden_size}; reduce states of the teacher the projection was built for"
            )
        return (hidden @ self.matrix_HD).astype(FEATURE_DTYPES[dtype])

    def lift(self, features_ND: np.ndarray) -> np.ndarray:
        """Float32 width-H estimate of the states behind ``features`` (pseudo-inverse)."""
        features = np.asarray(features_ND, dtype=np.float32)
        if features.shape[-1:] != (self.feature_dim,):
            raise ConfigError(
                f"features have width {features.shape[-1:]} but the projection has "
                f"D={self.feature_dim}; lift features made with this projection"
            )
        pinv_DH = np.linalg.pinv(self.matrix_HD.astype(np.float64)).astype(np.float32)
        return features @ pinv_DH

    def contract(self, feature_dtype: str) -> dict[str, Any]:
        """The JSON-ready feature contract a manifest records."""
        return {
            "format": PROJECTION_FORMAT,
            "source": FEATURE_SOURCE,
            "seed": self.seed,
            "hidden_size": self.hidden_size,
            "feature_dim": self.feature_dim,
            "feature_dtype": feature_dtype,
            "scale": "1/sqrt(feature_dim)",
            "projection_digest": self.digest,
        }


def check_contract(contract: dict[str, Any]) -> FeatureProjection:
    """Regenerate the projection a recorded contract names and verify its digest."""
    try:
        projection = FeatureProjection.create(
            seed=contract["seed"], hidden_size=contract["hidden_size"],
            feature_dim=contract["feature_dim"],
        )
    except KeyError as exc:
        raise ConfigError(f"feature contract lacks {exc.args[0]!r}; record it whole") from None
    recorded = contract.get("projection_digest")
    if contract.get("format") != PROJECTION_FORMAT or recorded != projection.digest:
        raise ConfigError(
            f"feature contract digest {recorded!r} (format "
            f"{contract.get('format')!r}) does not match the regenerated {projection.digest} "
            f"({PROJECTION_FORMAT}); the features were made with another projection"
        )
    return projection


# --- reading the feature source and the router at anchor rows --------------------------

@dataclass(eq=False)
class AnchorCapture:
    """Router logits, executed expert ids and pre-attention states of the anchor rows,
    one entry per slot. ``ids`` holds what the gate returned as its selected experts
    (transformers 5.x gates return logits, weights and ids, in the order
    :meth:`replay.adapter_base.FamilyAdapter.split_router_output` reads); they are the label only
    where the gate executes the declared tie-break
    (:func:`replay.adapters.install_exact_routing`)."""

    rows_N: torch.Tensor
    logit_width: int
    """Router logit columns (:func:`replay.routing.router_logit_width`)."""
    split: Callable[[Any], tuple[Any, Any, Any]]
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    ids: dict[int, torch.Tensor] = field(default_factory=dict)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    call_output: Callable[[nn.Module, Any, Any], Any] | None = None

    def gate_hook(self, slot: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.call_output is not None:  # FamilyAdapter.router_call_output
                output = self.call_output(module, args, output)
            logits, weights, ids = self.split(output)
            flat = logits.reshape(-1, self.logit_width)
            self.logits[slot] = flat.index_select(0, self.rows_N)
            if ids is not None and weights is not None:
                k = ids.shape[-1]
                self.ids[slot] = ids.reshape(-1, k).index_select(0, self.rows_N)
                self.weights[slot] = weights.reshape(-1, k).index_select(0, self.rows_N)

        return hook

    def norm_pre_hook(self, slot: int) -> Any:
        def hook(_module: nn.Module, args: Any) -> None:
            hidden = args[0]
            self.hidden[slot] = hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.rows_N)

        return hook

    def stacked(self, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits_NLE, hidden_NLH)``; ReplayError if a routed layer was not seen."""
        import torch

        if len(self.logits) != layers or len(self.hidden) != layers:
            raise ReplayError(
                f"the forward reached {len(self.logits)}/{layers} routers and "
                f"{len(self.hidden)}/{layers} pre-attention norms; the adapter does not match "
                "this checkpoint's modules"
            )
        logits = torch.stack([self.logits[s] for s in range(layers)], dim=1)
        hidden = torch.stack([self.hidden[s] for s in range(layers)], dim=1)
        return logits, hidden

    def executed(self, layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(ids_NLK, weights_NLK)`` the gates selected and applied, or None if a gate
        did not return them."""
        import torch

        if len(self.ids) != layers:
            return None
        return (torch.stack([self.ids[s] for s in range(layers)], dim=1),
                torch.stack([self.weights[s] for s in range(layers)], dim=1))


@contextmanager
def capture_anchor_rows(teacher: Teacher, rows_N: torch.Tensor) -> Iterator[AnchorCapture]:
    """Hook every routed layer's gate and pre-attention norm for one forward.

    The hooks keep only the rows ``rows_N`` (flat ``b * T + t`` indices, batch-major as
    the model flattens them) of each gate's logits and each norm's input, as the forward
    runs, so memory grows with anchors, not with tokens x layers x experts.
    """
    from hebrus_flywheel.replay.routing import router_logit_width

    geometry = teacher.geometry
    capture = AnchorCapture(rows_N=rows_N,
                            logit_width=router_logit_width(geometry.expert_count,
                                                           geometry.weight_rule),
                            split=partial(teacher.adapter.split_router_output,
                                          top_k=teacher.geometry.top_k),
                            call_output=teacher.adapter.router_call_output)
    layers = teacher.adapter.decoder_layers(teacher.model)
    handles = []
    try:
        for slot, index in enumerate(teacher.geometry.routed_layers):
            layer = layers[index]
            handles.append(teacher.adapter.router(layer).register_forward_hook(
                capture.gate_hook(slot)))
            handles.append(teacher.adapter.pre_attention_norm(layer).register_forward_pre_hook(
                capture.norm_pre_hook(slot)))
        yield capture
    finally:
        for handle in handles:
            handle.remove()
