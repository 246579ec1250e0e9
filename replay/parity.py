"""The parity gate: replayed top-k versus the top-k captured by real decode (Gate 1).

For each ``runtime_holdout`` window, its ``routes`` hold the expert ids and weights the
decode runtime recorded at every anchor and routed layer. The gate replays the window
with :class:`replay.prefill.PrefillReplayer` and compares, per (anchor, layer), the
exact ids AND their exact rank order; weights are compared with a declared tolerance.
An identity is **authoritative** only when every compared pair matches, no weight is
off by more than ``weight_atol``, and at least ``min_sample`` windows were compared.

Near ties are made visible, from the replay's scores (quantiles and a fixed log-scale
histogram each, over all pairs, over mismatching pairs and over *primary* mismatches):

- ``boundary``: the router-score margin between rank k-1 (the last selected expert) and
  rank k (the first rejected); a small one can flip the expert SET;
- ``label``: the smallest score gap between any two adjacent ranks 0..k, i.e. also the
  gaps inside the top-k whose flip changes only the RANK ORDER. Gaps inside the top-k
  are read from the weights, ``log(w_r / w_r+1)`` (softmax weights keep logit gaps).

A mismatch is *primary* when it is the first mismatching layer of its anchor: a flip at
layer l changes the experts executed there, so the token's later layers (and later
tokens) diverge with ordinary margins. Primary mismatches at tiny label margins mean
rounding differences between kernels; primary mismatches at large margins mean a real
bug (wrong positions, wrong weights, wrong rule, wrong tokens).

Token ids and positions are compared too: at every anchor, the replayed token id and
thread ordinal must equal the captured window's ``token_ids[anchor_positions]`` and
``first_token_ordinal + anchor_positions`` (``tokens_compared``, ``token_id_mismatches``,
``position_mismatches``); a mismatch makes the identity non-authoritative.

Windows that cannot be compared are counted, not failed: no captured routes
(``no_routes``), a history that does not start at ordinal 0 (``truncated_history``:
decode saw context the window lacks, so exact parity is not expected), or a window the
replayer refuses (``identity_mismatch``, ``invalid_window``).

Everything here is numpy over plain records; torch runs only inside the replayer.

Tensor legend: A anchors, L routed layers, K top-k.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.exceptions import ParityError, WindowError

if TYPE_CHECKING:
    from hebrus_flywheel.replay.prefill import PrefillReplayer, WindowLabels

MARGIN_BIN_EDGES: tuple[float, ...] = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
MARGIN_QUANTILES: tuple[float, ...] = (0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 1.0)
SKIP_NO_ROUTES = "no_routes"
SKIP_TRUNCATED = "truncated_history"


@dataclass(frozen=True, kw_only=True)
class ParityConfig:
    """What the gate requires and how much it reports.

    Fields:
        min_sample: windows that must be compared before an identity can be
            authoritative (the sample must also be non-empty).
        weight_atol: largest allowed |replayed - captured| weight on matching pairs.
        max_examples: mismatching (anchor, layer) pairs listed in the report.
        batch_windows: windows per replay call.
    """

    min_sample: int = 1
    weight_atol: float = 1e-4
    max_examples: int = 20
    batch_windows: int = 32

    def __post_init__(self) -> None:
        for name, low in (("min_sample", 1), ("max_examples", 0), ("batch_windows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        atol = self.weight_atol
        if isinstance(atol, bool) or not isinstance(atol, int | float) or not atol >= 0 \
                or not math.isfinite(atol):
            raise ConfigError(f"weight_atol must be a finite number >= 0, got {atol!r}")


@dataclass(frozen=True, kw_only=True)
class ParityResult:
    """The gate's verdict and its evidence; :meth:`to_dict` is JSON-ready."""

    authoritative: bool
    identity_id: str
    teacher_dtype: str
    tie_break_rule: str
    weight_rule: str
    min_sample: int
    weight_atol: float
    windows_compared: int
    windows_skipped: dict[str, int]
    anchors: int
    pairs: int
    mismatched_pairs: int
    primary_mismatches: int
    set_mismatches: int
    rank_only_mismatches: int
    mismatch_rate: float
    weight_violations: int
    max_weight_abs_diff: float | None
    tokens_compared: int
    token_id_mismatches: int
    position_mismatches: int
    per_layer: list[dict[str, Any]]
    margins: dict[str, dict[str, Any]]
    examples: list[dict[str, Any]]
    first_mismatches: list[dict[str, Any]]
    kernel_path: str = ""
    """The (device, attention, experts) kernel path this verdict holds for; with
    ``teacher_dtype`` it is what parity was established on (``RuntimeIdentity.kernel_path``)."""

    def to_dict(self) -> dict[str, Any]:
        return _plain(asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)


def _plain(value: Any) -> Any:
    """Numpy scalars to Python; non-finite floats to ``None`` (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def captured_routes(window: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(expert_ids_ALK int64, weights_ALK float32)`` of a window's captured routes."""
    routes = window.get("routes")
    if not isinstance(routes, Mapping):
        raise ParityError(f"window {window.get('window_id')} has no captured routes to compare")
    anchors = len(window.get("anchor_positions") or ())
    layers, k = int(routes["layer_count"]), int(routes["top_k"])
    if list(routes.get("layers", [])) != list(range(layers)):
        raise ParityError(
            f"window {window.get('window_id')}: routes.layers {routes.get('layers')} are not the "
            f"routed-layer slots 0..{layers - 1} in order; re-capture with the reference layout"
        )
    shape = (anchors, layers, k)
    size = anchors * layers * k
    for name, width in (("expert_ids", 2), ("weights", 4)):
        got = len(routes[name])
        if got != size * width:
            raise ParityError(
                f"window {window.get('window_id')}: routes.{name} has {got} bytes, expected "
                f"{size * width} for {anchors} anchors x {layers} layers x top-{k}; the record "
                "is corrupt"
            )
    ids = np.frombuffer(routes["expert_ids"], dtype="<i2").astype(np.int64).reshape(shape)
    weights = np.frombuffer(routes["weights"], dtype="<f4").astype(np.float32).reshape(shape)
    return ids, weights


def _compare_tokens(totals: _Totals, window: Mapping[str, Any], labels: WindowLabels) -> None:
    """Count anchors whose replayed token id or thread position differs from the captured
    window's (``token_ids[anchor_positions]`` at ``first_token_ordinal + position``).
    The anchor counts are equal here: the route shapes were checked first."""
    positions = np.asarray(window.get("anchor_positions") or (), dtype=np.int64)
    tokens = np.asarray(window.get("token_ids") or (), dtype=np.int64)
    inside = (positions >= 0) & (positions < len(tokens))
    captured_tok = np.full(len(positions), -1, dtype=np.int64)
    captured_tok[inside] = tokens[positions[inside]]
    captured_ord = positions + int(window.get("first_token_ordinal") or 0)
    replay_ord = np.asarray(labels.anchor_ordinals_A, dtype=np.int64)
    replay_tok = np.asarray(labels.token_ids_A, dtype=np.int64)
    totals.tokens += len(positions)
    totals.position_mismatches += int((captured_ord != replay_ord).sum())
    totals.token_id_mismatches += int((captured_tok != replay_tok).sum())


def skip_reason(window: Mapping[str, Any]) -> str | None:
    """Why ``window`` cannot be part of the parity sample, or ``None`` if it can."""
    if not isinstance(window.get("routes"), Mapping):
        return SKIP_NO_ROUTES
    if window.get("first_token_ordinal") != 0:
        return SKIP_TRUNCATED
    return None


@dataclass
class _Totals:
    layers: int
    pairs_L: np.ndarray
    mismatches_L: np.ndarray
    set_mismatches: int = 0
    rank_only: int = 0
    anchors: int = 0
    windows: int = 0
    primary: int = 0
    weight_violations: int = 0
    max_weight_diff: float = -math.inf
    tokens: int = 0
    token_id_mismatches: int = 0
    position_mismatches: int = 0
    margins: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def keep(self, name: str, values: np.ndarray) -> None:
        self.margins.setdefault(name, []).append(np.asarray(values, dtype=np.float64).ravel())


class ParityAccumulator:
    """Adds (window, replayed labels) pairs one at a time; :meth:`result` summarises."""

    def __init__(
        self, config: ParityConfig, *, identity_id: str, teacher_dtype: str,
        tie_break_rule: str, weight_rule: str, routed_layers: Sequence[int] | None = None,
        kernel_path: str = "",
    ) -> None:
        self.config = config
        self.meta = {"identity_id": identity_id, "teacher_dtype": teacher_dtype,
                     "tie_break_rule": tie_break_rule, "weight_rule": weight_rule,
                     "kernel_path": kernel_path}
        self.routed_layers = None if routed_layers is None else list(routed_layers)
        self.skipped: dict[str, int] = {}
        self.examples: list[dict[str, Any]] = []
        self.first_mismatches: list[dict[str, Any]] = []
        self._totals: _Totals | None = None

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def add(self, window: Mapping[str, Any], labels: WindowLabels) -> None:
        """Compare one window's captured routes with its replayed labels."""
        if labels.window_id != window.get("window_id"):
            raise ParityError(
                f"labels of window {labels.window_id} were given for window "
                f"{window.get('window_id')}; pair each window with its own labels"
            )
        decode_ids, decode_weights = captured_routes(window)
        replay_ids = labels.expert_ids_ALK.astype(np.int64)
        if decode_ids.shape != replay_ids.shape:
            raise ParityError(
                f"window {labels.window_id}: captured routes are {decode_ids.shape} "
                f"[anchors, layers, top_k] but replay produced {replay_ids.shape}; the capture "
                "and the teacher disagree on geometry"
            )
        totals = self._ensure(decode_ids.shape[1])
        _compare_tokens(totals, window, labels)
        mismatch_AL = (decode_ids != replay_ids).any(-1)
        same_set_AL = (np.sort(decode_ids, -1) == np.sort(replay_ids, -1)).all(-1)
        totals.windows += 1
        totals.anchors += decode_ids.shape[0]
        totals.pairs_L += decode_ids.shape[0]
        totals.mismatches_L += mismatch_AL.sum(0)
        totals.set_mismatches += int((~same_set_AL).sum())
        totals.rank_only += int((mismatch_AL & same_set_AL).sum())
        primary_AL = mismatch_AL & (np.cumsum(mismatch_AL, axis=1) == 1)
        totals.primary += int(primary_AL.sum())
        label_AL = np.minimum(labels.margins_AL, order_margins(labels.weights_ALK))
        for kind, values in (("boundary", labels.margins_AL), ("label", label_AL)):
            totals.keep(f"{kind}/overall", values)
            totals.keep(f"{kind}/at_mismatch", values[mismatch_AL])
            totals.keep(f"{kind}/at_primary_mismatch", values[primary_AL])
        self._weights(totals, decode_weights, labels.weights_ALK, ~mismatch_AL)
        self._examples(labels, decode_ids, mismatch_AL & ~same_set_AL, primary_AL, label_AL)

    def _ensure(self, layers: int) -> _Totals:
        if self._totals is None:
            self._totals = _Totals(layers=layers, pairs_L=np.zeros(layers, np.int64),
                                   mismatches_L=np.zeros(layers, np.int64))
        elif self._totals.layers != layers:
            raise ParityError(
                f"a window has {layers} routed layers but earlier ones had "
                f"{self._totals.layers}; compare windows of one identity at a time"
            )
        return self._totals

    def _weights(self, totals: _Totals, decode_ALK: np.ndarray, replay_ALK: np.ndarray,
                 match_AL: np.ndarray) -> None:
        if not match_AL.any():
            return
        diff = np.abs(decode_ALK[match_AL] - replay_ALK[match_AL]).max(-1)
        totals.weight_violations += int((diff > self.config.weight_atol).sum())
        totals.max_weight_diff = max(totals.max_weight_diff, float(diff.max()))

    def _examples(self, labels: WindowLabels, decode_ids: np.ndarray, set_AL: np.ndarray,
                  primary_AL: np.ndarray, label_AL: np.ndarray) -> None:
        """List mismatches (``max_examples`` in all) and each window's first one."""
        mismatch_AL = (decode_ids != labels.expert_ids_ALK.astype(np.int64)).any(-1)
        found = np.argwhere(mismatch_AL)
        room = max(self.config.max_examples - len(self.examples), 0)
        for a, slot in found[:room]:
            self.examples.append({
                "window_id": labels.window_id, "anchor_ordinal": int(labels.anchor_ordinals_A[a]),
                "layer_slot": int(slot), "kind": "expert_set" if set_AL[a, slot] else "rank_order",
                "primary": bool(primary_AL[a, slot]),
                "boundary_margin": float(labels.margins_AL[a, slot]),
                "label_margin": float(label_AL[a, slot]),
                "decode_ids": decode_ids[a, slot].tolist(),
                "replay_ids": labels.expert_ids_ALK[a, slot].astype(int).tolist(),
            })
        if len(found) and len(self.first_mismatches) < self.config.max_examples:
            a, slot = found[0]
            self.first_mismatches.append({
                "window_id": labels.window_id, "anchor_ordinal": int(labels.anchor_ordinals_A[a]),
                "layer_slot": int(slot), "label_margin": float(label_AL[a, slot]),
            })

    def result(self) -> ParityResult:
        t = self._totals or _Totals(layers=0, pairs_L=np.zeros(0, np.int64),
                                    mismatches_L=np.zeros(0, np.int64))
        pairs, mismatched = int(t.pairs_L.sum()), int(t.mismatches_L.sum())
        authoritative = (t.windows >= self.config.min_sample and pairs > 0
                         and mismatched == 0 and t.weight_violations == 0
                         and t.token_id_mismatches == 0 and t.position_mismatches == 0)
        return ParityResult(
            authoritative=authoritative, **self.meta, min_sample=self.config.min_sample,
            weight_atol=float(self.config.weight_atol), windows_compared=t.windows,
            windows_skipped=dict(sorted(self.skipped.items())), anchors=t.anchors, pairs=pairs,
            mismatched_pairs=mismatched, primary_mismatches=t.primary,
            set_mismatches=t.set_mismatches,
            rank_only_mismatches=t.rank_only, mismatch_rate=mismatched / pairs if pairs else 0.0,
            weight_violations=t.weight_violations,
            max_weight_abs_diff=t.max_weight_diff if math.isfinite(t.max_weight_diff) else None,
            tokens_compared=t.tokens, token_id_mismatches=t.token_id_mismatches,
            position_mismatches=t.position_mismatches,
            per_layer=self._per_layer(t),
            margins=_margin_report(t),
            examples=list(self.examples), first_mismatches=list(self.first_mismatches),
        )

    def _per_layer(self, t: _Totals) -> list[dict[str, Any]]:
        out = []
        for slot in range(t.layers):
            pairs, bad = int(t.pairs_L[slot]), int(t.mismatches_L[slot])
            layer = self.routed_layers[slot] if self.routed_layers else slot
            out.append({"slot": slot, "layer": layer, "pairs": pairs, "mismatches": bad,
                        "mismatch_rate": bad / pairs if pairs else 0.0})
        return out


def _margin_report(t: _Totals) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in ("boundary", "label"):
        out[kind] = {}
        for where in ("overall", "at_mismatch", "at_primary_mismatch"):
            parts = t.margins.get(f"{kind}/{where}", [])
            out[kind][where] = margin_summary(np.concatenate(parts) if parts else np.zeros(0))
    return out


def order_margins(weights_ALK: np.ndarray) -> np.ndarray:
    """Smallest logit gap between adjacent ranks inside the top-k, from the weights."""
    weights = np.asarray(weights_ALK, dtype=np.float64)
    if weights.shape[-1] < 2:
        return np.full(weights.shape[:-1], np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        gaps = np.log(weights[..., :-1]) - np.log(weights[..., 1:])
    return np.nan_to_num(gaps, nan=np.inf).min(-1)


def margin_summary(margins: np.ndarray) -> dict[str, Any]:
    """Count, quantiles and a fixed log-scale histogram of router margins."""
    values = np.asarray(margins, dtype=np.float64)
    edges = [*MARGIN_BIN_EDGES, math.inf]
    counts = np.histogram(np.clip(values, 0.0, None), bins=np.asarray(edges))[0] \
        if values.size else np.zeros(len(edges) - 1, np.int64)
    histogram = [
        {"low": lo, "high": hi if math.isfinite(hi) else None, "count": int(c)}
        for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True)
    ]
    quantiles = {
        f"q{q:g}": float(np.quantile(values, q, method="nearest")) for q in MARGIN_QUANTILES
    } if values.size else {}
    return {"count": int(values.size), "quantiles": quantiles, "histogram": histogram}


def run_parity(
    replayer: PrefillReplayer, windows: Iterable[Mapping[str, Any]],
    config: ParityConfig | None = None,
) -> ParityResult:
    """Replay the eligible windows in batches and compare them with their captured routes."""
    config = config or ParityConfig()
    teacher = replayer.teacher
    from hebrus_flywheel.replay.routing import TIE_BREAK_RULE

    acc = ParityAccumulator(
        config, identity_id=replayer.identity_id, teacher_dtype=teacher.dtype,
        tie_break_rule=TIE_BREAK_RULE, weight_rule=teacher.geometry.weight_rule,
        routed_layers=teacher.geometry.routed_layers,
        kernel_path=str(getattr(teacher, "kernel_path", "")),
    )
    pending: list[Mapping[str, Any]] = []
    for window in windows:
        reason = skip_reason(window)
        if reason is None:
            reason = _refusal(replayer, window)
        if reason is not None:
            acc.skip(reason)
            continue
        pending.append(window)
        if len(pending) >= config.batch_windows:
            _replay_into(acc, replayer, pending)
            pending = []
    if pending:
        _replay_into(acc, replayer, pending)
    return acc.result()


def _refusal(replayer: PrefillReplayer, window: Mapping[str, Any]) -> str | None:
    try:
        replayer.check_window(window)
    except WindowError as exc:
        return exc.reason
    return None


def _replay_into(acc: ParityAccumulator, replayer: PrefillReplayer,
                 windows: Sequence[Mapping[str, Any]]) -> None:
    for window, labels in zip(windows, replayer.replay(windows), strict=True):
        acc.add(window, labels)
