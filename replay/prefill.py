"""Prefill replay: decode-shaped windows labelled by ONE batched causal forward of the teacher.

:class:`PrefillReplayer` takes decoded ``Window.v1`` records, refuses any whose
``identity_id`` is not the loaded teacher's (:class:`WindowIdentityError`, reason
``identity_mismatch``), batches the rest and runs one plain forward per batch under
``torch.inference_mode()``. At every anchor and every routed layer it records, from that
same forward: the native top-k expert ids in rank order with the declared tie-break
(:meth:`replay.teacher.Teacher.route`), their weights, the rank k-1 vs rank k router
margin, and the sidecar feature (the pre-attention residual state reduced by the fixed
seeded projection of :mod:`replay.features`). A bounded, deterministic sample of windows
(``diagnostic_hidden_every_n``) also keeps the full-width states.

Batching (why it is built this way):

- RIGHT padding, with an explicit attention mask and explicit position ids
  (``first_token_ordinal + index``, the tokens' true ordinals). Everything before a
  window's last real token is causally upstream of it, so trailing pads cannot reach a
  label. Packing several windows into one row is NOT used: Qwen3-Next's gated delta-net
  (linear attention) and its causal conv1d carry recurrent state along the row, and
  transformers' ``position_ids`` packing detection only splits the full-attention mask,
  so a packed window would inherit the previous window's recurrent state.
- A window always runs at ITS OWN padded length: ``length`` rounded up to a multiple of
  ``pad_multiple`` (64, also the delta-net chunk), and a batch holds only windows of one
  padded length. Masks are always materialised (a 4D causal mask for attention layers,
  the 2D padding mask for linear-attention layers; never sdpa's ``is_causal`` shortcut).
  Why (measured, fp32 CPU): (1) elementwise kernels run 16/32-float vector blocks and
  finish the tail of a buffer separately (silu's tail rounds differently), so an
  unaligned row length changes the last bits of the tokens near the row end; (2) sdpa's
  CPU flash kernel picks its q/kv block sizes from the sequence length, so padding a
  window further (to a longer batch-mate) reorders its attention sums. Both moved router
  logits by ~1e-6. With one padded length per window, every label and feature is
  bit-identical whatever the batch composition and order (tested), given the teacher's
  default ``tiled_mm`` experts (:mod:`replay.experts`: every (token, expert) product at
  one fixed tile shape; ``batched_mm`` is invariant too but copies weights per pair,
  ``grouped_mm``'s per-expert GEMMs depend on how many tokens share an expert, i.e. on
  the batch) and a fixed torch thread count.
- The labels are the experts the gates EXECUTED (the declared tie-break installed by
  :func:`replay.adapters.install_exact_routing`) with the float32 weights they applied
  (bit-identical to the rule on the same logits, tested), taken at the anchor rows; the
  boundary margin comes from those logits.
- Buckets are cut into batches of ``max_batch_tokens // padded_length`` rows (at least
  one); ``sort_by_length`` runs the buckets shortest first.

Only anchor rows are kept (:func:`replay.features.capture_anchor_rows`).

Tensor legend: B windows, T tokens, N anchor rows of a batch, A anchors of a window,
L routed layers, K top-k, E experts, H hidden, D reduced feature width.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.exceptions import (
    ReplayError,
    ReplayNumericsError,
    WindowFormatError,
    WindowIdentityError,
)
from hebrus_flywheel.replay.features import FEATURE_DTYPES, FeatureProjection, capture_anchor_rows
from hebrus_flywheel.replay.masks import attention_masks
from hebrus_flywheel.replay.routing import TIE_BREAK_RULE, margin_beside
from hebrus_flywheel.replay.teacher import DTYPES

if TYPE_CHECKING:
    from hebrus_flywheel.replay.teacher import Teacher

POSITION_RULE = "first_token_ordinal + index"
PADDING_RULE = "right; each window padded to its own multiple of pad_multiple; explicit masks"
_REQUIRED_TEXT = ("split", "owner", "thread", "identity_id")


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """How :class:`PrefillReplayer` batches windows and what it records.

    Fields:
        feature_dim: width D of the reduced sidecar feature per routed layer.
        projection_seed: seed of the fixed projection H -> D (:mod:`replay.features`).
        feature_dtype: storage dtype of the features, ``float16`` or ``float32``.
        max_batch_tokens: budget of one forward: rows * padded length stays within it
            (a single longer window still runs, alone). Measured on a 2-core CPU
            (bench/replay.py, 48 routed layers): two 256-token windows per forward beat
            one by ~12%, but two 1024-token windows per forward were ~13% slower than one,
            so the default stays at 1024 tokens; raise it on accelerators.
        pad_multiple: a window is right-padded to the next multiple of this and batched
            only with windows of the same padded length (see the module doc: this keeps
            labels independent of batch composition); larger values batch more.
        dtype: compute dtype the teacher must have been loaded with (``float32``,
            ``bfloat16``, ``float16``); part of the runtime identity.
        diagnostic_hidden_every_n: keep full-width hidden states (float32) for windows
            whose ``sha256(window_id) % n == 0`` (about 1 in n, deterministic, the same
            windows on every rebuild); 0 never.
        sort_by_length: run the padded-length buckets shortest first (else in order of
            first appearance); labels do not depend on it.
    """

    feature_dim: int = 64
    projection_seed: int = 0
    feature_dtype: str = "float16"
    max_batch_tokens: int = 1024
    pad_multiple: int = 64
    dtype: str = "float32"
    diagnostic_hidden_every_n: int = 0
    sort_by_length: bool = True

    def __post_init__(self) -> None:
        positive = ("feature_dim", "max_batch_tokens", "pad_multiple")
        for name in (*positive, "projection_seed", "diagnostic_hidden_every_n"):
            value = getattr(self, name)
            low = 1 if name in positive else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ConfigError(
                f"feature_dtype must be one of {sorted(FEATURE_DTYPES)}, got {self.feature_dtype!r}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.sort_by_length, bool):
            raise ConfigError(f"sort_by_length must be a bool, got {self.sort_by_length!r}")


@dataclass(frozen=True, eq=False)
class WindowLabels:
    """Labels and features of every anchor of one window, from one forward pass.

    ``anchor_ordinals_A`` are thread ordinals (``first_token_ordinal + position``);
    ``expert_ids_ALK`` rank 0 first; ``margins_AL`` the rank k-1 vs rank k router-score
    gap; ``features_ALD`` the projected pre-attention states; ``hidden_ALH`` the
    full-width states for diagnostic windows only, else ``None``.
    """

    window_id: str
    split: str
    owner: str
    thread: str
    generation: int
    identity_id: str
    domain_tags: tuple[str, ...]
    anchor_ordinals_A: np.ndarray
    token_ids_A: np.ndarray
    expert_ids_ALK: np.ndarray
    weights_ALK: np.ndarray
    margins_AL: np.ndarray
    features_ALD: np.ndarray
    hidden_ALH: np.ndarray | None = None

    @property
    def label_count(self) -> int:
        """(anchor, routed layer) labels in this window."""
        return int(self.margins_AL.size)


@dataclass(frozen=True, eq=False)
class _Prepared:
    """A validated window: where it came from and the tokens the forward needs."""

    index: int
    window: Mapping[str, Any]
    token_ids: np.ndarray
    first_ordinal: int
    anchors_A: np.ndarray
    diagnostic: bool


def plan_batches(
    lengths: Sequence[int], *, max_batch_tokens: int, pad_multiple: int, sort_by_length: bool
) -> list[list[int]]:
    """Indices of ``lengths`` in batches (pure): one padded length per batch, rows within
    ``max_batch_tokens`` (at least one). Buckets run shortest first when
    ``sort_by_length``, else in order of first appearance; members keep input order."""
    buckets: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        buckets.setdefault(padded_length(length, pad_multiple), []).append(index)
    batches: list[list[int]] = []
    for padded in sorted(buckets) if sort_by_length else list(buckets):
        members, rows = buckets[padded], max(1, max_batch_tokens // padded)
        batches += [members[i:i + rows] for i in range(0, len(members), rows)]
    return batches


def padded_length(length: int, pad_multiple: int) -> int:
    return -(-length // pad_multiple) * pad_multiple


def is_diagnostic(window_id: str, every_n: int) -> bool:
    """Whether ``window_id`` belongs to the full-width hidden sample (1 in ``every_n``)."""
    if every_n <= 0:
        return False
    value = int.from_bytes(hashlib.sha256(window_id.encode()).digest()[:8], "big")
    return value % every_n == 0


class PrefillReplayer:
    """Labels windows with a frozen teacher: see the module docstring.

    ``identity`` is the loaded runtime identity record; by default
    :func:`replay.runtime_identity.build_runtime_identity` of ``teacher`` (tokenizer
    read from the teacher directory). Pass it when the tokenizer lives elsewhere.
    """

    def __init__(
        self, teacher: Teacher, config: ReplayConfig | None = None, *,
        identity: Mapping[str, Any] | None = None,
    ) -> None:
        config = config or ReplayConfig()
        if config.dtype != teacher.dtype:
            raise ConfigError(
                f"dtype: ReplayConfig.dtype is {config.dtype!r} but the teacher was loaded as "
                f"{teacher.dtype!r}; load it with load_teacher(dir, dtype={config.dtype!r})"
            )
        if identity is None:
            from hebrus_flywheel.replay.runtime_identity import build_runtime_identity

            identity = build_runtime_identity(teacher)
        self.teacher = teacher
        self.config = config
        self.identity = dict(identity)
        self.identity_id = str(self.identity["identity_id"])
        geometry = teacher.geometry
        self.projection = FeatureProjection.create(
            seed=config.projection_seed, hidden_size=geometry.hidden_size,
            feature_dim=config.feature_dim,
        )
        self._projection_HD = torch.from_numpy(np.array(self.projection.matrix_HD)).to(
            teacher.model.device)
        pad = getattr(teacher.model.config, "pad_token_id", None)
        self._pad_id = int(pad) if isinstance(pad, int) and 0 <= pad < teacher.vocab_size else 0

    # --- contract ----------------------------------------------------------------------

    def feature_contract(self) -> dict[str, Any]:
        return self.projection.contract(self.config.feature_dtype)

    def replay_contract(self) -> dict[str, Any]:
        """JSON-ready record of everything that decides the labels' bytes."""
        import transformers

        model_config = self.teacher.model.config
        return {
            "identity_id": self.identity_id, "teacher_dtype": self.teacher.dtype,
            "tie_break_rule": TIE_BREAK_RULE, "weight_rule": self.teacher.geometry.weight_rule,
            "experts_implementation": getattr(model_config, "_experts_implementation", None),
            "attention_implementation": getattr(model_config, "_attn_implementation", None),
            "position_rule": POSITION_RULE, "padding_rule": PADDING_RULE,
            "replay_config": asdict(self.config), "feature_contract": self.feature_contract(),
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
        }

    # --- validation --------------------------------------------------------------------

    def check_window(self, window: Mapping[str, Any]) -> None:
        """Raise WindowIdentityError / WindowFormatError if ``window`` cannot be replayed."""
        self._prepare(0, window)

    def _prepare(self, index: int, window: Mapping[str, Any]) -> _Prepared:
        if not isinstance(window, Mapping):
            raise WindowFormatError(
                f"expected a decoded Window record (a mapping), got {type(window).__name__}",
                window_id=None,
            )
        window_id = window.get("window_id")
        if not isinstance(window_id, str) or not window_id:
            raise WindowFormatError("has no window_id; decode Window.v1 records", window_id=None)
        if not isinstance(window.get("identity_id"), str):
            raise WindowFormatError("identity_id must be a string", window_id=window_id)
        if window["identity_id"] != self.identity_id:
            raise WindowIdentityError(
                f"identity_id {window['identity_id']!r} differs from the loaded teacher's "
                f"{self.identity_id}; replay it with the teacher, tokenizer and dtype it was "
                "captured with, or quarantine it as identity_mismatch",
                window_id=window_id,
            )
        _check_metadata(window, window_id)
        tokens = _token_array(window.get("token_ids"), self.teacher.vocab_size, window_id)
        first = window.get("first_token_ordinal")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise WindowFormatError(
                f"first_token_ordinal must be an integer >= 0, got {first!r}", window_id=window_id
            )
        anchors = _anchor_array(window.get("anchor_positions"), len(tokens), window_id)
        return _Prepared(
            index=index, window=window, token_ids=tokens[: int(anchors[-1]) + 1],
            first_ordinal=first, anchors_A=anchors,
            diagnostic=is_diagnostic(window_id, self.config.diagnostic_hidden_every_n),
        )

    # --- replay ------------------------------------------------------------------------

    def replay(self, windows: Sequence[Mapping[str, Any]]) -> list[WindowLabels]:
        """Labels of every window, in input order. Every window is checked before any
        forward runs; the first bad one raises (WindowIdentityError / WindowFormatError)."""
        prepared = [self._prepare(i, w) for i, w in enumerate(windows)]
        plan = plan_batches(
            [len(p.token_ids) for p in prepared], max_batch_tokens=self.config.max_batch_tokens,
            pad_multiple=self.config.pad_multiple, sort_by_length=self.config.sort_by_length,
        )
        results: list[WindowLabels | None] = [None] * len(prepared)
        for batch in plan:
            for item, labels in zip(
                (prepared[i] for i in batch), self._run_batch([prepared[i] for i in batch]),
                strict=True,
            ):
                results[item.index] = labels
        return [r for r in results if r is not None]

    def _inputs(self, batch: Sequence[_Prepared]) -> tuple[torch.Tensor, ...]:
        """``(input_ids_BT, mask_BT, position_ids_BT, rows_N)`` of one right-padded batch."""
        length = padded_length(max(len(p.token_ids) for p in batch), self.config.pad_multiple)
        ids_BT = torch.full((len(batch), length), self._pad_id, dtype=torch.long)
        mask_BT = torch.zeros((len(batch), length), dtype=torch.bool)
        positions_BT = torch.empty((len(batch), length), dtype=torch.long)
        rows = []
        for b, item in enumerate(batch):
            n = len(item.token_ids)
            ids_BT[b, :n] = torch.from_numpy(item.token_ids)
            mask_BT[b, :n] = True
            positions_BT[b] = torch.arange(length) + item.first_ordinal
            rows.append(torch.from_numpy(item.anchors_A) + b * length)
        device = self.teacher.model.device
        return (ids_BT.to(device), mask_BT.to(device), positions_BT.to(device),
                torch.cat(rows).to(device))

    def _forward(self, batch: Sequence[_Prepared]) -> tuple[torch.Tensor, ...]:
        """One forward; ``(logits_NLE, hidden_NLH, ids_NLK, weights_NLK)`` at the anchor
        rows of ``batch``.

        With exact routing installed the gates' own selection IS the label (the same
        rule on the same logits), so it is taken as executed instead of ranked again; so
        are the weights where the gate kept them in float32 (the label dtype)."""
        ids_BT, mask_BT, positions_BT, rows_N = self._inputs(batch)
        model, layers = self.teacher.model, self.teacher.geometry.routed_layer_count
        with torch.inference_mode(), capture_anchor_rows(self.teacher, rows_N) as capture:
            masks = attention_masks(model, mask_BT, positions_BT)
            model(input_ids=ids_BT, attention_mask=masks, position_ids=positions_BT,
                  use_cache=False, logits_to_keep=1)
            logits_NLE, hidden_NLH = capture.stacked(layers)  # hidden stays on the device
            logits_NLE = logits_NLE.cpu()
            executed = capture.executed(layers) if self.teacher.exact_tie_break else None
            if executed is None:
                return (logits_NLE, hidden_NLH, *self.teacher.route(logits_NLE))
            ids_NLK, weights_NLK = executed[0].cpu(), executed[1].cpu()
            if weights_NLK.dtype != torch.float32:
                weights_NLK = self.teacher.weights_of(logits_NLE, ids_NLK)
            return logits_NLE, hidden_NLH, ids_NLK, weights_NLK

    def _run_batch(self, batch: Sequence[_Prepared]) -> list[WindowLabels]:
        logits_NLE, hidden_NLH, ids_NLK, weights_NLK = self._forward(batch)
        with torch.inference_mode():
            margins_NL = margin_beside(self.teacher.selection_scores(logits_NLE), ids_NLK)
            hidden32_NLH = hidden_NLH.to(torch.float32)  # projected on its device: only D
            features_NLD = (hidden32_NLH @ self._projection_HD).cpu()  # of H cross to host
            hidden_np = hidden32_NLH.cpu().numpy() if any(i.diagnostic for i in batch) \
                else np.empty((len(hidden32_NLH), 0))
        features = features_NLD.numpy().astype(FEATURE_DTYPES[self.config.feature_dtype])
        if not np.isfinite(features).all():
            raise ReplayNumericsError(
                f"replayed features of windows {[p.window['window_id'] for p in batch][:3]} are "
                f"not finite in {self.config.feature_dtype}; hidden states overflow it, use "
                "feature_dtype='float32'"
            )
        arrays = (_uint16_ids(ids_NLK.numpy()), weights_NLK.numpy().astype(np.float32),
                  margins_NL.numpy().astype(np.float32), features, hidden_np)
        out, start = [], 0
        for item in batch:
            stop = start + len(item.anchors_A)
            out.append(self._labels(item, *(a[start:stop] for a in arrays)))
            start = stop
        return out

    def _labels(
        self, item: _Prepared, ids_ALK: np.ndarray, weights_ALK: np.ndarray,
        margins_AL: np.ndarray, features_ALD: np.ndarray, hidden_ALH: np.ndarray,
    ) -> WindowLabels:
        w = item.window
        return WindowLabels(
            window_id=str(w["window_id"]), split=str(w["split"]), owner=str(w["owner"]),
            thread=str(w["thread"]), generation=int(w["generation"]),
            identity_id=self.identity_id, domain_tags=tuple(str(t) for t in w["domain_tags"]),
            anchor_ordinals_A=item.anchors_A + item.first_ordinal,
            token_ids_A=item.token_ids[item.anchors_A].astype(np.int32),
            expert_ids_ALK=np.ascontiguousarray(ids_ALK),
            weights_ALK=np.ascontiguousarray(weights_ALK),
            margins_AL=np.ascontiguousarray(margins_AL),
            features_ALD=np.ascontiguousarray(features_ALD),
            hidden_ALH=np.array(hidden_ALH, dtype=np.float32) if item.diagnostic else None,
        )


def _check_metadata(window: Mapping[str, Any], window_id: str) -> None:
    for name in _REQUIRED_TEXT:
        if not isinstance(window.get(name), str):
            raise WindowFormatError(f"field {name} must be a string", window_id=window_id)
    generation, tags = window.get("generation"), window.get("domain_tags")
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise WindowFormatError(f"generation must be an integer, got {generation!r}",
                                window_id=window_id)
    if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
        raise WindowFormatError("domain_tags must be a list of strings", window_id=window_id)


def _int_array(values: Any, name: str, window_id: str) -> np.ndarray:
    array = np.asarray(values) if isinstance(values, list | tuple | np.ndarray) else None
    if array is None or array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
        raise WindowFormatError(f"{name} must be a non-empty flat list of integers",
                                window_id=window_id)
    return array.astype(np.int64)


def _token_array(values: Any, vocab: int, window_id: str) -> np.ndarray:
    tokens = _int_array(values, "token_ids", window_id)
    bad = tokens[(tokens < 0) | (tokens >= vocab)]
    if bad.size:
        raise WindowFormatError(
            f"token_ids has {bad.size} ids outside [0, {vocab}) (first: {int(bad[0])}); the "
            "window was tokenized for another teacher", window_id=window_id,
        )
    return tokens


def _anchor_array(values: Any, token_count: int, window_id: str) -> np.ndarray:
    anchors = _int_array(values, "anchor_positions", window_id)
    if anchors[0] < 0 or anchors[-1] >= token_count or (np.diff(anchors) <= 0).any():
        raise WindowFormatError(
            f"anchor_positions must ascend strictly within [0, {token_count}) (the window's "
            f"token count), got {anchors[:5].tolist()}...", window_id=window_id,
        )
    return anchors


def _uint16_ids(ids_NLK: np.ndarray) -> np.ndarray:
    if ids_NLK.size and int(ids_NLK.max()) > np.iinfo(np.uint16).max:
        raise ReplayError("expert ids exceed uint16; this teacher has more than 65536 experts")
    return ids_NLK.astype(np.uint16)
