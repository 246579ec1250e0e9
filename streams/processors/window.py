"""Window stage: cut a kept thread generation into causal windows, only after split and dedup.

Anchors are the assistant-generated tokens (for ``runtime_holdout``, those with a
captured route). They are grouped greedily in ordinal order; a window ends at its last
anchor ``e`` and starts at ``s = max(0, e + 1 - context)``. A group never spans more
than ``context - min_anchor_context`` ordinals, so every anchor sees at least
``min_anchor_context`` tokens of history (or its whole history when the thread is
shorter), and never holds more than ``max_anchors_per_window`` anchors. Windows that
carry routes use ``route_context_length`` and are capped by ``max_window_bytes`` too.
Every anchor is in exactly one window, and the cut depends only on the thread and the
configuration, so a re-run yields the same window ids and content digests.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.jsonio import canonical_json
from hebrus_flywheel.streams.processors import assemble as asm
from hebrus_flywheel.streams.processors.common import header_key, sha256_hex, thread_key

_TOKEN_BYTES = 5
_ROUTE_BYTES_PER_SLOT = 6
_WINDOW_OVERHEAD = 16_384
_SCALARS = frozenset({int, str, float, bool, type(None)})


@dataclass(frozen=True, kw_only=True)
class WindowConfig:
    """How windows are cut.

    Fields:
        context_length: most tokens a window carries (the causal prefix the sidecar uses).
        min_anchor_context: least history every anchor sees inside its window (unless its
            whole history is shorter).
        max_anchors_per_window: most anchors per window.
        route_context_length: context of windows that carry captured routes
            (``runtime_holdout``); longer, so more anchors keep their full history and
            replay/decode parity can be checked on exact prefixes.
        max_route_anchors_per_window: most anchors per window that carries routes.
        max_window_bytes: encoded-size budget of one window (Kafka's default message
            limit is 1 MiB); the route anchor cap shrinks to fit it.
    """

    context_length: int = 2048
    min_anchor_context: int = 256
    max_anchors_per_window: int = 256
    route_context_length: int = 8192
    max_route_anchors_per_window: int = 64
    max_window_bytes: int = 900_000

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"WindowConfig.{f.name} must be a positive integer, got {value!r}"
                )
        for name in ("context_length", "route_context_length"):
            if getattr(self, name) <= self.min_anchor_context:
                raise ConfigError(f"WindowConfig.{name} must exceed min_anchor_context")
        if self.route_context_length * _TOKEN_BYTES + _WINDOW_OVERHEAD >= self.max_window_bytes:
            raise ConfigError(
                "WindowConfig.max_window_bytes is too small for route_context_length tokens; "
                "raise it or shorten the context"
            )

    def digest(self) -> str:
        return _config_digest(self)


@functools.cache
def _config_digest(config: WindowConfig) -> str:
    return sha256_hex(canonical_json(dataclasses.asdict(config)))


def group_anchors(
    anchors: np.ndarray, *, context: int, min_context: int, max_anchors: int
) -> list[tuple[int, int]]:
    """Half-open index ranges into ``anchors`` (sorted ordinals), one per window."""
    span = context - min_context
    groups: list[tuple[int, int]] = []
    i, n = 0, len(anchors)
    while i < n:
        last = int(np.searchsorted(anchors, anchors[i] + span, side="right"))
        j = min(last, i + max_anchors, n)
        groups.append((i, j))
        i = j
    return groups


def route_anchor_cap(config: WindowConfig, layer_count: int, top_k: int) -> int:
    """Most route-carrying anchors that fit ``max_window_bytes`` beside the context."""
    budget = config.max_window_bytes - config.route_context_length * _TOKEN_BYTES - _WINDOW_OVERHEAD
    per_anchor = layer_count * top_k * _ROUTE_BYTES_PER_SLOT + 16
    return max(1, min(config.max_route_anchors_per_window, budget // per_anchor))


def _turn_lineage(turns: tuple[dict[str, Any], ...], start: int, end: int) -> list[dict[str, Any]]:
    out = []
    for turn in turns:
        offset, n = turn["token_offset"], len(turn["token_ids"])
        if (offset < end and start < offset + n) or (n == 0 and start <= offset < end):
            out.append(
                {
                    "turn_index": turn["turn_index"],
                    "role": turn["role"],
                    "token_offset": offset,
                    "length": n,
                    "sequence_id": turn["sequence_id"],
                    "sampling_mode": turn["sampling_mode"],
                    "generated": [
                        {"start": offset + s, "end": offset + e}
                        for _, s, e, g in turn["segments"]
                        if g
                    ],
                }
            )
    return out


def _routes_block(thread: asm.AssembledThread, ordinals: np.ndarray) -> dict[str, Any]:
    first = thread.routes[int(ordinals[0])]
    k = len(first["ids"]) // 2 // len(first["stages"])
    packed = [thread.routes.packed(o) for o in ordinals.tolist()]
    return {
        "layer_count": len(first["stages"]),
        "top_k": k,
        "layers": list(range(len(first["stages"]))),
        "stages": list(first["stages"]),
        "expert_ids": b"".join(ids for ids, _ in packed),
        "weights": b"".join(weights for _, weights in packed),
    }


def window_id(
    thread: asm.AssembledThread, first: int, anchors: np.ndarray, tokens_digest: str
) -> str:
    body = {
        "v": 1,
        "identity_id": thread.identity_id,
        "owner": thread.owner,
        "thread": thread.thread,
        "generation": thread.generation,
        "first_token_ordinal": first,
        "anchors": [int(a) for a in anchors],
        "tokens": tokens_digest,
    }
    return sha256_hex(canonical_json(body))


def content_digest(window: Mapping[str, Any]) -> str:
    """SHA-256 over every field but ``content_digest`` (bytes fields by their SHA-256)."""

    def plain(value: Any) -> Any:
        if isinstance(value, bytes):
            return {"sha256": sha256_hex(value)}
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            if set(map(type, value)) <= _SCALARS:  # token ids, anchors: nothing to replace
                return value
            return [plain(v) for v in value]
        return value

    body = {k: plain(v) for k, v in window.items() if k != "content_digest"}
    return sha256_hex(canonical_json(body))


def _anchors_and_cap(
    thread: asm.AssembledThread, with_routes: bool, config: WindowConfig
) -> tuple[np.ndarray, int]:
    """Eligible anchor ordinals, and the most anchors one window may hold."""
    if not with_routes:
        return thread.generated, config.max_anchors_per_window
    anchors = thread.generated[thread.routes.routed(thread.generated)]
    if len(anchors) == 0:
        return anchors, config.max_anchors_per_window
    first = thread.routes[int(anchors[0])]
    n_layers = len(first["stages"])
    cap = route_anchor_cap(config, n_layers, len(first["ids"]) // 2 // n_layers)
    return anchors, min(config.max_anchors_per_window, cap)


def cut_windows(
    thread: asm.AssembledThread,
    *,
    split: str,
    split_rule: str,
    thread_digest: str,
    config: WindowConfig,
    digest: bool = True,
) -> list[dict[str, Any]]:
    """Window.v1 records of one kept generation (empty when it has no eligible anchor);
    ``digest=False`` leaves their ``window_id`` and ``content_digest`` empty, for a caller
    that seals them (a sealed window has its own id and digests its own fields,
    :mod:`streams.processors.window_seal`)."""
    with_routes = split == "runtime_holdout"
    anchors, cap = _anchors_and_cap(thread, with_routes, config)
    if len(anchors) == 0:
        return []
    context = config.route_context_length if with_routes else config.context_length
    groups = group_anchors(
        anchors, context=context, min_context=config.min_anchor_context, max_anchors=cap
    )
    base = {
        "split": split,
        "split_rule": split_rule,
        "owner": thread.owner,
        "thread": thread.thread,
        "generation": thread.generation,
        "identity_id": thread.identity_id,
        "domain_tags": list(thread.tags),
        "thread_digest": thread_digest,
        "thread_token_count": len(thread.tokens),
        "window_count": len(groups),
        "config_digest": config.digest(),
    }
    return [
        _window(thread, base, index, anchors[i:j], context, with_routes, digest)
        for index, (i, j) in enumerate(groups)
    ]


def _window(
    thread: asm.AssembledThread,
    base: Mapping[str, Any],
    index: int,
    group: np.ndarray,
    context: int,
    with_routes: bool,
    digest: bool,
) -> dict[str, Any]:
    end = int(group[-1]) + 1
    start = max(0, end - context)
    tokens = thread.tokens[start:end]
    plain_id = ""  # a sealed window gets its own id (window_seal): this one would be thrown away
    if digest:
        plain_id = window_id(thread, start, group, sha256_hex(tokens.astype("<i4").tobytes()))
    window: dict[str, Any] = {
        "window_id": plain_id,
        "content_digest": "",
        **base,
        "window_index": index,
        "token_ids": tokens.tolist(),
        "first_token_ordinal": start,
        "anchor_positions": (group - start).tolist(),
        "turns": _turn_lineage(thread.turns, start, end),
        "routes": _routes_block(thread, group) if with_routes else None,
    }
    if digest:
        window["content_digest"] = content_digest(window)
    return window


class WindowStage:
    """Cut windows for decisions, then retire the generation's assembled content."""

    def __init__(
        self,
        *,
        config: WindowConfig,
        store: MutableMapping[str, Any],
        counters: Counters | None = None,
        sealed: bool = False,
    ) -> None:
        """``sealed``: every window is sealed before it is written, which gives it its own
        id and content digest, so the plaintext digest (a canonical JSON of the whole
        window, token ids included) is not computed."""
        self.config = config
        self.sealed = sealed
        self.store = store
        self.counters = counters or Counters()

    def windows_for(self, decision: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The windows to publish for ``decision`` (none when dropped or already done)."""
        header = asm.read_header(self.store, decision["iid"])
        if header is None or header["status"] != "ready":
            self.counters.inc("window", "decision_for_finished_thread")
            return []
        if not decision["keep"]:
            return []
        thread = asm.load_thread(self.store, decision["iid"], header)
        windows = cut_windows(
            thread,
            split=decision["split"],
            split_rule=decision["split_rule"],
            thread_digest=decision["digest"],
            config=self.config,
            digest=not self.sealed,
        )
        self.counters.inc("window", f"windows_{decision['split']}", len(windows))
        self.counters.inc("window", f"threads_{decision['split']}")
        self.counters.inc("window", "anchors", sum(len(w["anchor_positions"]) for w in windows))
        return windows

    def finish(self, decision: Mapping[str, Any]) -> None:
        """Mark the generation done (after its windows were delivered) and drop its content.

        Only a generation that completed (``ready``) or already finished is touched; a
        decision for a generation still assembling is stale and ignored.
        """
        hkey = header_key(decision["iid"])
        header = asm.read_header(self.store, decision["iid"])
        if header is None or header["status"] in ("open", "quarantined"):
            self.counters.inc("window", "stale_decision")
            return
        ready = header["status"] == "ready"
        asm.drop_content(self.store, decision["iid"], header)  # and what the header holds
        if ready:
            header["status"] = "emitted" if decision["keep"] else "dropped"
            header["split"] = decision["split"]
            header["outbox"] = []
            self.store[hkey] = header


def window_key(window: Mapping[str, Any]) -> str:
    return thread_key(window["owner"], window["thread"])
