"""Load the frozen teacher and the prefill replay engine (torch is imported only here).

The worker and the rebuild both come through :func:`load_engine`, so a rebuild runs the
engine exactly as the worker did: same teacher dtype, same ``ReplayConfig`` options and
the same torch intra-op thread count (CPU reductions may depend on it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.errors import ConfigError


@dataclass(eq=False)
class EngineBundle:
    """A loaded teacher, its replay engine, runtime identity and resolved settings.

    ``replay_config`` is the engine's ``replay_contract()``: ReplayConfig, feature
    projection contract, padding/position rules, kernels, library versions, threads.
    """

    teacher: Any
    engine: Any
    identity: dict[str, Any]
    replay_config: dict[str, Any]
    torch_threads: int
    vocab_size: int
    layers: int
    context_length: int
    top_k: int
    hidden_dim: int


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def load_engine(*, teacher_dir: Path | None, dtype: str, replay_options: Mapping[str, Any],
                torch_threads: int | None, tokenizer_dir: Path | None = None,
                teacher: Any = None, device: str = "cpu", attention: str = "auto"
                ) -> EngineBundle:
    """Load (or reuse ``teacher``), set torch threads, build ``PrefillReplayer``."""
    import torch

    from hebrus_flywheel.replay.prefill import PrefillReplayer, ReplayConfig
    from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
    from hebrus_flywheel.replay.teacher import load_teacher

    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    if teacher is None:
        if teacher_dir is None:
            raise ConfigError("teacher: pass --teacher DIR (a local checkpoint directory)")
        teacher = load_teacher(teacher_dir, dtype=dtype, device=device, attention=attention)
    identity = build_runtime_identity(teacher, tokenizer_dir)
    try:
        replay_config = ReplayConfig(**{"dtype": dtype, **dict(replay_options)})
    except TypeError as exc:
        raise ConfigError(
            f"replay_options: {exc}; use ReplayConfig field names (see replay/prefill.py)"
        ) from exc
    engine = PrefillReplayer(teacher, replay_config, identity=identity)
    geometry = teacher.geometry
    return EngineBundle(
        teacher=teacher, engine=engine, identity=identity,
        replay_config=_plain(engine.replay_contract()),
        torch_threads=torch.get_num_threads(), vocab_size=int(teacher.vocab_size),
        layers=int(geometry.routed_layer_count), top_k=int(geometry.top_k),
        hidden_dim=int(geometry.hidden_size),
        context_length=int(getattr(teacher, "context_length", 0) or 0),
    )


def determinism_record(*, shard: Any, batch_windows: int, bundle: EngineBundle, dtype: str,
                       replay_options: Mapping[str, Any],
                       content_policy: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings that decide shard bytes; recorded in dataset.json and manifests
    (``content_policy``: which windows are dropped before replay)."""
    policy = {} if content_policy is None else {"content_policy": _plain(dict(content_policy))}
    return {
        **policy,
        "shard": dataclasses.asdict(shard),
        "batch_windows": batch_windows,
        "torch_threads": bundle.torch_threads,
        "dtype": dtype,
        "replay_options": _plain(dict(replay_options)),
        "replay_config": bundle.replay_config,
        "geometry": {"layers": bundle.layers, "top_k": bundle.top_k,
                     "hidden_dim": bundle.hidden_dim, "vocab_size": bundle.vocab_size},
    }


def teacher_limits(window: Mapping[str, Any], *, context_length: int,
                   layers: int) -> tuple[str, str] | None:
    """Why the teacher cannot replay ``window`` at all: more tokens than its context
    (``window_exceeds_context``), captured routes of another layer count
    (``layer_count_mismatch``); None when it fits."""
    tokens = len(window.get("token_ids") or ())
    if context_length and tokens > context_length:
        return "window_exceeds_context", (
            f"window has {tokens} tokens but the teacher's context is {context_length} "
            "positions; cut windows with --context-length at most the teacher's")
    routes = window.get("routes")
    if isinstance(routes, Mapping) and routes.get("layer_count") != layers:
        return "layer_count_mismatch", (
            f"captured routes have {routes.get('layer_count')} layers but the teacher routes "
            f"{layers}; the window was captured with another model")
    return None


def window_check(bundle: EngineBundle) -> Callable[[Any], tuple[str, str] | None]:
    """The teacher's limits (:func:`teacher_limits`), then ``engine.check_window``, as
    ``window -> (reason, detail) | None`` for intake."""
    from hebrus_flywheel.replay.exceptions import WindowError

    engine = bundle.engine

    def check(window: Any) -> tuple[str, str] | None:
        problem = teacher_limits(window, context_length=bundle.context_length,
                                 layers=bundle.layers)
        if problem is not None:
            return problem
        try:
            engine.check_window(window)
        except WindowError as exc:
            return exc.reason, str(exc)
        return None

    return check
