"""Small sealed snapshots with a *planted* router, for tests and the bench.

No broker and no teacher forward: rows are made by a known linear router and written
with the real shard writer, manifest builder and seal helpers of :mod:`consumers` into
the layout of :mod:`hebrus_flywheel.core.snapshot`, so
the result is a genuine sealed epoch (``ROOT/epoch=0/manifest.json`` + checksummed
shards) that ``flywheel verify`` accepts.

The planted problem. Per thread and routed layer, the pre-attention state ``h`` follows
an AR(1) process over tokens (``temporal``) mixed with the layer below (``adjacent``),
so previous-token and adjacent-layer controls have something to find. The native route
of (token, layer ``l``) is the ranked top-k of ``(h * gain_l) @ W_l^T`` (ties to the
lower expert id) with ``W_l = M diag(a_l) U``: experts share one embedding ``M`` and
layers differ by a scale ``a_l``, a structure the shared sidecar can represent. The
stored feature is ``h @ P`` with ``P`` the real seeded projection of
:mod:`replay.features`, whose contract the manifest records, so the native-gate control
(``W_l`` applied to the pseudo-inverse lift) is exact when ``D >= H``.

Legend: N tokens, L routed layers, E experts, K top-k, H hidden width, D feature width.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from hebrus_flywheel.consumers.dataset import writer_versions
from hebrus_flywheel.consumers.epochs import EpochBoundary, freeze_offsets
from hebrus_flywheel.consumers.labels import SourceRef, pack_rows
from hebrus_flywheel.consumers.manifest import (
    build_manifest,
    describe_shards,
    make_read_only,
    write_manifest,
)
from hebrus_flywheel.consumers.shards import ShardConfig, ShardName, shard_relpath, write_shard
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.core.jsonio import canonical_json
from hebrus_flywheel.core.snapshot import ShardLayout, shard_metadata
from hebrus_flywheel.replay.features import FeatureProjection

TOPIC = "flywheel.windows.{split}.v1"
DOMAINS: tuple[tuple[str, ...], ...] = (("prose",), ("code",), ("prose", "tool_calls"))


@dataclass(frozen=True, kw_only=True)
class PlantedConfig:
    """Shape and content of a planted snapshot."""

    threads: Mapping[str, int] = field(default_factory=lambda: {"train": 6, "validation": 2})
    """Threads per split (each thread lives in exactly one split)."""
    tokens_per_thread: int = 48
    """Anchor tokens per thread (consecutive ordinals from 0)."""
    anchors_per_window: int = 8
    """Anchors per window record; one window is one source offset."""
    offsets_per_shard: int = 4
    """Window records per shard (the consumers' block size)."""
    row_group_rows: int = 16
    """Parquet rows (tokens) per row group."""
    layers: int = 4
    """L: routed layers."""
    experts: int = 64
    """E: experts per layer."""
    top_k: int = 10
    """K: native experts per (token, layer)."""
    hidden_dim: int = 16
    """H: width of the planted pre-attention state."""
    feature_dim: int = 32
    """D: stored feature width (``D >= H`` makes the native-gate lift exact; ``D = 2H``
    keeps the problem learnable although the sidecar normalises its input)."""
    router_rank: int = 8
    """Width of the shared expert embedding ``M`` of the planted router."""
    temporal: float = 0.6
    """AR(1) coefficient of ``h`` over consecutive tokens of a thread, in [0, 1)."""
    adjacent: float = 0.5
    """Share of the layer below mixed into ``h`` of layer l, in [0, 1)."""
    seed: int = 0
    """Seed of every random draw (router, states)."""
    projection_seed: int = 0
    """Seed of the feature projection (recorded in the feature contract)."""
    weight_encoding: str = "uint8"
    """Shard weight encoding, ``uint8`` or ``float16``."""
    owner_format: str = "{split}-owner{thread}"
    """Owner id of a thread (``str.format`` with ``split`` and ``thread``)."""

    def __post_init__(self) -> None:
        ints = ("tokens_per_thread", "anchors_per_window", "offsets_per_shard", "row_group_rows",
                "layers", "experts", "top_k", "hidden_dim", "feature_dim", "router_rank")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PlantedConfig.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.experts:
            raise ConfigError("PlantedConfig.top_k must not exceed PlantedConfig.experts")
        for name in ("temporal", "adjacent"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"PlantedConfig.{name} must be in [0, 1)")
        if not self.threads or min(self.threads.values()) < 1:
            raise ConfigError("PlantedConfig.threads must give at least one thread per split")
        object.__setattr__(self, "threads", dict(self.threads))


@dataclass(frozen=True, eq=False)
class PlantedSnapshot:
    """A written snapshot and the truth behind it."""

    directory: Path
    """The sealed epoch directory (``ROOT/epoch=0``)."""
    manifest: dict[str, Any]
    router_LEH: np.ndarray
    """The planted routers ``W_l``."""
    gain_LH: np.ndarray
    """The per-layer gain applied to ``h`` before the router."""
    projection: FeatureProjection

    @property
    def snapshot_id(self) -> str:
        return str(self.manifest["snapshot_id"])


def planted_router(config: PlantedConfig) -> np.ndarray:
    """``W_l = M diag(a_l) U`` as ``(L, E, H)`` float32."""
    rng = np.random.default_rng([config.seed, 1])
    m_ER = rng.normal(size=(config.experts, config.router_rank))
    u_RH = rng.normal(size=(config.router_rank, config.hidden_dim)) / np.sqrt(config.hidden_dim)
    a_LR = 1.0 + 0.5 * rng.normal(size=(config.layers, config.router_rank))
    return np.einsum("er,lr,rh->leh", m_ER, a_LR, u_RH).astype(np.float32)


def thread_states(config: PlantedConfig, rng: np.random.Generator) -> np.ndarray:
    """Pre-attention states ``(N, L, H)`` of one thread (see the module doc)."""
    n, L, H = config.tokens_per_thread, config.layers, config.hidden_dim
    noise = rng.normal(size=(n, L, H))
    states = np.empty((n, L, H))
    rho, mix = config.temporal, config.adjacent
    for t in range(n):
        step = noise[t] if t == 0 else rho * states[t - 1] + np.sqrt(1 - rho**2) * noise[t]
        states[t] = step
        for layer in range(1, L):
            states[t, layer] = mix * states[t, layer - 1] + np.sqrt(1 - mix**2) * step[layer]
    return states.astype(np.float32)


def route(logits_NLE: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranked top-k ids (ties to the lower id), renormalised softmax weights, margins."""
    order = np.argsort(-logits_NLE, axis=-1, kind="stable")[..., : top_k + 1]
    probs = np.exp(logits_NLE - logits_NLE.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.take_along_axis(probs, order[..., :top_k], -1)
    scores = np.take_along_axis(logits_NLE, order, -1)
    margins = (scores[..., top_k - 1] - scores[..., top_k] if order.shape[-1] > top_k
               else np.full(scores.shape[:-1], np.inf))
    return (order[..., :top_k].astype(np.uint16),
            (chosen / chosen.sum(-1, keepdims=True)).astype(np.float32),
            margins.astype(np.float32))


def _identity(config: PlantedConfig) -> dict[str, Any]:
    fields = {"model_family": "planted", "model_artifact_digest": _sha(f"planted-{config.seed}"),
              "tokenizer_digest": "0" * 64, "chat_template_digest": "0" * 64,
              "dtype": "float32", "quantization": "none", "routed_layer_count": config.layers,
              "expert_count": config.experts, "top_k": config.top_k,
              "tie_break_rule": "score_desc_id_asc", "weight_rule": "softmax_topk_renormalized",
              "hidden_size": config.hidden_dim, "routed_intermediate_size": 16,
              "runtime_name": "planted", "runtime_version": "0"}
    return {**fields, "identity_id": hashlib.sha256(canonical_json(fields)).hexdigest()}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _windows(config: PlantedConfig, split: str, thread: int, states_NLH: np.ndarray,
             router: tuple[np.ndarray, np.ndarray], projection: FeatureProjection,
             identity_id: str) -> list[SimpleNamespace]:
    router_LEH, gain_LH = router
    logits = np.einsum("nlh,leh->nle", states_NLH * gain_LH[None], router_LEH)
    ids, weights, margins = route(logits, config.top_k)
    features = projection.reduce(states_NLH)
    out, step = [], config.anchors_per_window
    for first in range(0, config.tokens_per_thread, step):
        sl = slice(first, first + step)
        ordinals = np.arange(first, min(first + step, config.tokens_per_thread), dtype=np.int64)
        wid = _sha(f"{split}/{thread}/{first}")
        owner = config.owner_format.format(split=split, thread=thread)
        out.append(SimpleNamespace(
            window_id=wid, split=split, owner=owner, thread=f"t{thread}",
            generation=0, identity_id=identity_id,
            domain_tags=DOMAINS[thread % len(DOMAINS)], anchor_ordinals_A=ordinals,
            token_ids_A=(ordinals % 1000).astype(np.int32), expert_ids_ALK=ids[sl],
            weights_ALK=weights[sl], margins_AL=margins[sl], features_ALD=features[sl],
            hidden_ALH=None))
    return out


def _write_split(root: Path, config: PlantedConfig, split: str, windows: list[Any],
                 layout: ShardLayout, identity_id: str) -> int:
    topic, shard = TOPIC.format(split=split), _shard_config(config)
    per = config.offsets_per_shard
    for first in range(0, len(windows), per):
        items = [(w, SourceRef(topic=topic, partition=0, offset=first + i))
                 for i, w in enumerate(windows[first:first + per])]
        last = first + len(items) - 1
        table = pack_rows(items, layout)
        table = table.replace_schema_metadata(shard_metadata(layout, {
            "epoch": 0, "split": split, "topic": topic, "partition": 0, "first_offset": first,
            "last_offset": last, "identity_id": identity_id, "config_digest": "0" * 64,
            "windows": len(items), "rows": table.num_rows}))
        name = ShardName(topic=topic, partition=0, first_offset=first, last_offset=last)
        write_shard(root, shard_relpath(0, split, name), table, shard, windows=len(items))
    return len(windows)


def _shard_config(config: PlantedConfig) -> ShardConfig:
    return ShardConfig(offsets_per_shard=config.offsets_per_shard,
                       row_group_rows=config.row_group_rows,
                       weight_encoding=config.weight_encoding)


def write_planted_snapshot(root: Path, config: PlantedConfig | None = None, *,
                           router_LEH: np.ndarray | None = None, gain_LH: np.ndarray | None = None,
                           identity: Mapping[str, Any] | None = None,
                           read_only: bool = True) -> PlantedSnapshot:
    """Write and seal ``ROOT/epoch=0`` (see the module doc). ``router_LEH``/``gain_LH``
    replace the planted router (e.g. a real teacher's gates); ``identity`` the
    synthetic runtime identity (e.g. that teacher's)."""
    config = config or PlantedConfig()
    router = planted_router(config) if router_LEH is None else np.asarray(router_LEH, np.float32)
    gain = np.ones((config.layers, config.hidden_dim), np.float32) if gain_LH is None else (
        np.asarray(gain_LH, np.float32))
    if router.shape != (config.layers, config.experts, config.hidden_dim):
        raise ConfigError(f"router_LEH has shape {router.shape}; expected "
                          f"({config.layers}, {config.experts}, {config.hidden_dim})")
    ident = dict(identity) if identity is not None else _identity(config)
    projection = FeatureProjection.create(seed=config.projection_seed,
                                          hidden_size=config.hidden_dim,
                                          feature_dim=config.feature_dim)
    layout = ShardLayout(route=RouteGeometry.from_identity(ident),
                         feature_dim=config.feature_dim, hidden_dim=config.hidden_dim,
                         weight_encoding=config.weight_encoding,
                         projection_id=projection.digest, projection_seed=projection.seed)
    root = Path(root)
    ends: dict[str, dict[int, int]] = {}
    for s_index, (split, count) in enumerate(sorted(config.threads.items())):
        rng = np.random.default_rng([config.seed, 2, s_index])
        per_thread = [_windows(config, split, t, thread_states(config, rng), (router, gain),
                               projection, ident["identity_id"]) for t in range(count)]
        interleaved = [w for group in zip(*per_thread, strict=True) for w in group]
        ends[TOPIC.format(split=split)] = {0: _write_split(root, config, split, interleaved,
                                                           layout, ident["identity_id"])}
    manifest = _seal(root, config, ident, ends, projection)
    if read_only:
        make_read_only(root / "epoch=0")
    return PlantedSnapshot(directory=root / "epoch=0", manifest=manifest, router_LEH=router,
                           gain_LH=gain, projection=projection)


def _seal(root: Path, config: PlantedConfig, identity: dict[str, Any],
          ends: dict[str, dict[int, int]], projection: FeatureProjection) -> dict[str, Any]:
    geometry = {"layers": config.layers, "top_k": config.top_k,
                "hidden_dim": config.hidden_dim, "vocab_size": 1000}
    determinism = {"shard": dataclasses.asdict(_shard_config(config)), "batch_windows": 1,
                   "torch_threads": 1, "dtype": "float32", "replay_options": {},
                   "replay_config": {"feature_contract": projection.contract("float16"),
                                     "planted": {"seed": config.seed}},
                   "geometry": geometry}
    dataset = {"identity": identity, "determinism": json.loads(canonical_json(determinism)),
               "writer": writer_versions(), "source": {"prefix": "", "group_id": "planted"}}
    boundary = EpochBoundary(epoch=0, start=freeze_offsets({t: {0: 0} for t in ends}),
                             end=freeze_offsets(ends))
    manifest = build_manifest(
        epoch=0, dataset=dataset, boundary=boundary,
        splits_by_topic={TOPIC.format(split=s): s for s in config.threads},
        shards=describe_shards(root, 0), parity={"authoritative": True, "source": "planted"},
        parity_override=None, previous_snapshot=None)
    write_manifest(root, root / "epoch=0", manifest)
    return manifest


def make_writable(root: Path) -> None:
    """Undo :func:`consumers.manifest.make_read_only` under ``root`` (test clean-up)."""
    for dirpath, _dirs, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(Path(dirpath) / name, 0o644)
