"""The reference decode runtime: autoregressive decode with a KV cache, capturing routes.

This is the REAL decode path the design note's Gate 1 compares replay against: one
prefill forward over the prefix with ``use_cache=True``, then one single-token forward
per token with the cache (the adapter's ``new_cache``: a ``DynamicCache`` built from the
model config, which for Qwen3-Next holds the hybrid linear-attention conv/recurrent
states and the full-attention KV). Every decode-step forward runs under forward hooks
on the routed layers' gates.

Route semantics: the route recorded for ordinal ``p`` is the router decision made while
processing token ``p``, i.e. the token fed at that step. Step ``i`` feeds token
``prefix_len + i``:

- teacher-forced (``forced_ids``): the token fed at step ``i`` is ``forced_ids[i]``;
- sampled: the token fed at step ``i`` is drawn from the logits the previous forward
  produced (the prefill for ``i = 0``). Generation stops after feeding the eos token
  (``<|im_end|>``) or ``max_new_tokens`` tokens.

Every returned token is fed exactly once, so every returned token has a route (the last
forward's logits are discarded). Prefix tokens are processed by the prefill and get no
recorded route here. Ranking uses :mod:`replay.routing` (score desc, ties by lower id).

Tensor legend: T decoded tokens, L routed layers, E experts, K top-k, V vocabulary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.adapters import RouteCapture, capture_routes
from hebrus_flywheel.replay.exceptions import DecodeError
from hebrus_flywheel.replay.routing import router_margin
from hebrus_flywheel.replay.teacher import Teacher

FINISH_FORCED = "forced"
FINISH_EOS = "eos"
FINISH_LENGTH = "max_new_tokens"


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How sampled decode picks tokens.

    Fields:
        temperature: 0 means greedy (argmax, lowest token id on ties); > 0 samples.
        top_k: keep only the k most likely tokens before sampling; 0 disables.
        top_p: nucleus threshold in (0, 1]; 1.0 disables.
        seed: seed of the ``torch.Generator`` used for sampling.
        max_new_tokens: stop after this many generated tokens.
        stop_at_eos: stop after feeding an eos token.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 64
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        limit = self.max_new_tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {limit!r}")


@dataclass(frozen=True)
class DecodeTiming:
    """Wall-clock seconds: the prefill forward, and the sum of decode-step forwards."""

    prefill_s: float
    decode_s: float
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.steps / self.decode_s if self.decode_s > 0 else float("inf")


@dataclass(frozen=True)
class DecodedTurn:
    """One decoded turn and the native routes of every fed token.

    ``ordinals[t]`` is the position of ``token_ids[t]`` in the full sequence (prefix
    included); ``expert_ids_TLK`` (uint16) and ``weights_TLK`` (float32) are the ranked
    top-k per routed layer; ``margins_TL`` is the rank k-1 vs rank k logit gap;
    ``executed_mismatches`` counts (token, layer) pairs where the model's own top-k SET
    differed from the recorded rule's (nonzero only on exact score ties).
    """

    prefix_length: int
    token_ids: list[int]
    ordinals: np.ndarray
    expert_ids_TLK: np.ndarray
    weights_TLK: np.ndarray
    margins_TL: np.ndarray
    executed_mismatches: int
    finish_reason: str
    timing: DecodeTiming


@dataclass
class _Trace:
    tokens: list[int] = field(default_factory=list)
    ids: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    margins: list[torch.Tensor] = field(default_factory=list)
    mismatches: int = 0
    seconds: float = 0.0


class DecodeRuntime:
    """Runs decode turns on a frozen teacher and records its native routes.

    ``threads`` is the intra-op thread count used while a turn runs (restored after);
    ``None`` leaves torch's setting alone. The default 1 is deliberate: single-token
    forwards of a tiny teacher are hundreds of microsecond-sized ops, and on a 2-core
    CPU two OpenMP threads measured 5-10x SLOWER than one (thread wake-up and contention
    dominate).
    """

    def __init__(self, teacher: Teacher, *, threads: int | None = 1) -> None:
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):
            raise ConfigError(f"threads must be a positive integer or None, got {threads!r}")
        self.teacher = teacher
        self.model = teacher.model
        self.eos_ids = frozenset(teacher.eos_token_ids)
        self.threads = threads

    def decode_turn(
        self, prefix_ids: list[int], *, forced_ids: list[int] | None = None,
        sampling: SamplingConfig | None = None,
    ) -> DecodedTurn:
        """Prefill ``prefix_ids``, then decode forced or sampled tokens one at a time."""
        self._check_ids(prefix_ids, "prefix_ids")
        if forced_ids is not None:
            if sampling is not None:
                raise DecodeError("pass either forced_ids (teacher forcing) or sampling, not both")
            self._check_ids(forced_ids, "forced_ids")
        sampling = sampling or SamplingConfig()
        with _intra_op_threads(self.threads), torch.inference_mode():
            cache, logits_V, prefill_s = self._prefill(prefix_ids)
            trace, finish = self._run(len(prefix_ids), cache, logits_V, forced_ids, sampling)
        return self._finish(len(prefix_ids), trace, finish, prefill_s)

    def _check_ids(self, ids: list[int], name: str) -> None:
        if not ids:
            raise DecodeError(f"{name} is empty; a decode turn needs at least one token there")
        vocab = self.teacher.vocab_size
        bad = [t for t in ids if not _is_token_id(t, vocab)]
        if bad:
            raise DecodeError(
                f"{name} has {len(bad)} ids outside [0, {vocab}) (first: {bad[0]!r}); tokenize "
                "with the teacher's own tokenizer"
            )

    def _forward(self, ids: list[int], start: int, cache: object) -> torch.Tensor:
        device = self.model.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        position_ids = torch.arange(start, start + len(ids), dtype=torch.long,
                                    device=device).unsqueeze(0)
        out = self.model(
            input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
            use_cache=True, logits_to_keep=1,
        )
        return out.logits[0, -1].to(device="cpu", dtype=torch.float32)

    def _prefill(self, prefix_ids: list[int]) -> tuple[object, torch.Tensor, float]:
        cache = self.teacher.adapter.new_cache(self.model)
        start = time.perf_counter()
        logits_V = self._forward(prefix_ids, 0, cache)
        return cache, logits_V, time.perf_counter() - start

    def _run(
        self, prefix_len: int, cache: object, logits_V: torch.Tensor,
        forced_ids: list[int] | None, sampling: SamplingConfig,
    ) -> tuple[_Trace, str]:
        trace = _Trace()
        generator = torch.Generator().manual_seed(sampling.seed)
        limit = len(forced_ids) if forced_ids is not None else sampling.max_new_tokens
        teacher = self.teacher
        with capture_routes(self.model, teacher.adapter, teacher.geometry) as capture:
            for step in range(limit):
                if forced_ids is not None:
                    token = int(forced_ids[step])
                else:
                    token = sample_token(logits_V, sampling, generator)
                logits_V = self._step(token, prefix_len + step, cache, capture, trace)
                if forced_ids is None and sampling.stop_at_eos and token in self.eos_ids:
                    return trace, FINISH_EOS
        return trace, FINISH_FORCED if forced_ids is not None else FINISH_LENGTH

    def _step(
        self, token: int, position: int, cache: object, capture: RouteCapture, trace: _Trace
    ) -> torch.Tensor:
        capture.clear()
        start = time.perf_counter()
        logits_V = self._forward([token], position, cache)
        trace.seconds += time.perf_counter() - start
        router_logits_LE = capture.router_logits_LNE()[:, 0].cpu()
        ids_LK, weights_LK = self.teacher.route(router_logits_LE)
        executed_LNK = capture.executed_ids_LNK()
        if executed_LNK is not None:
            same = ids_LK.sort(-1).values == executed_LNK[:, 0].cpu().sort(-1).values
            trace.mismatches += int((~same.all(-1)).sum())
        trace.tokens.append(token)
        trace.ids.append(ids_LK)
        trace.weights.append(weights_LK)
        scores_LE = self.teacher.selection_scores(router_logits_LE)
        trace.margins.append(router_margin(scores_LE, self.teacher.geometry.top_k))
        return logits_V

    def _finish(self, prefix_len: int, trace: _Trace, finish: str, prefill_s: float) -> DecodedTurn:
        count = len(trace.tokens)
        return DecodedTurn(
            prefix_length=prefix_len,
            token_ids=list(trace.tokens),
            ordinals=np.arange(prefix_len, prefix_len + count, dtype=np.int64),
            expert_ids_TLK=_ids_array(torch.stack(trace.ids).numpy()),
            weights_TLK=torch.stack(trace.weights).numpy().astype(np.float32),
            margins_TL=torch.stack(trace.margins).numpy().astype(np.float32),
            executed_mismatches=trace.mismatches,
            finish_reason=finish,
            timing=DecodeTiming(prefill_s=prefill_s, decode_s=trace.seconds, steps=count),
        )


def _is_token_id(value: object, vocab: int) -> bool:
    integral = isinstance(value, int | np.integer) and not isinstance(value, bool)
    return integral and 0 <= int(value) < vocab  # type: ignore[call-overload]


@contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _ids_array(ids_TLK: np.ndarray) -> np.ndarray:
    if ids_TLK.size and int(ids_TLK.max()) > np.iinfo(np.uint16).max:
        raise DecodeError("expert ids exceed uint16; this teacher has more than 65536 experts")
    return ids_TLK.astype(np.uint16)


def sample_token(
    logits_V: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator
) -> int:
    """Pick the next token: greedy when ``temperature == 0``, else filtered sampling."""
    if sampling.temperature == 0.0:
        return int(torch.argmax(logits_V))
    probs_V = torch.softmax(filtered_scores(logits_V, sampling), dim=-1)
    return int(torch.multinomial(probs_V, 1, generator=generator))


def filtered_scores(logits_V: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Float32 ``logits / temperature`` with the top-k and top-p filters applied (masked
    tokens at ``-inf``); the softmax of it is what sampled decode draws from
    (``temperature > 0``)."""
    scores_V = logits_V.to(torch.float32) / sampling.temperature
    if 0 < sampling.top_k < scores_V.numel():
        order_V = torch.sort(scores_V, descending=True, stable=True).indices
        scores_V = scores_V.clone()
        scores_V[order_V[sampling.top_k:]] = float("-inf")  # exactly k; ties keep lower ids
    if sampling.top_p < 1.0:
        scores_V = _nucleus(scores_V, sampling.top_p)
    return scores_V


def _nucleus(scores_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask tokens outside the smallest set whose probability mass reaches ``top_p``."""
    order_V = torch.sort(scores_V, descending=True, stable=True).indices
    probs_V = torch.softmax(scores_V[order_V], dim=-1)
    before_V = torch.cumsum(probs_V, dim=-1) - probs_V
    drop_V = torch.zeros_like(scores_V, dtype=torch.bool)
    drop_V[order_V] = before_V >= top_p
    return scores_V.masked_fill(drop_V, float("-inf"))
