"""Reference-runtime capture: real KV-cache decode of agent threads, published to Kafka.

This is what a Hebrus runtime does online, run here against the frozen teacher:
each thread is rendered to its canonical token sequence, every assistant turn is
decoded token by token with a KV cache (the runtime path, never prefill), the native
top-k of every routed layer is recorded for every decoded token, and identities,
transcript turns and route observations go out through :class:`RuntimePublisher`.
Records here carry the runtime's raw owner, thread and request ids and plaintext
tokens; the publisher pseudonymizes and seals them (:mod:`streams.sealing`), so none
of that leaves the process.

Publishing order per thread, which the stream processors rely on: for an assistant
turn, its observations first (the whole decoded run through
:meth:`RuntimePublisher.publish_run`, which chunks it into ``RouteObservationChunk``
records) and then its ``TranscriptTurn``; other turns when they
occur; the last turn carries ``closes_thread=True``. ``interleave`` threads are
decoded round-robin, turn by turn, so the topics see threads interleaved the way a
serving runtime would produce them.

Decode modes: ``forced`` feeds the recorded assistant tokens through decode (the
transcript stays the recorded one); ``greedy`` and ``sample`` let the teacher
generate, and the generated tokens become the transcript.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.routes import ID_DTYPE, WEIGHT_DTYPE

if TYPE_CHECKING:
    from hebrus_flywheel.replay.conversations import Thread
    from hebrus_flywheel.replay.decode import DecodedTurn, DecodeRuntime
    from hebrus_flywheel.replay.render import RenderedTurn
    from hebrus_flywheel.streams.publisher import RuntimePublisher

log = logging.getLogger(__name__)

DECODE_MODES = ("forced", "greedy", "sample")
RUNTIME_STAGE = 0  # the reference runtime executes every layer in one pipeline stage


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    """What :func:`run_capture` decodes and how.

    Fields:
        mode: ``forced`` (decode the recorded assistant tokens), ``greedy`` or ``sample``.
        temperature, top_p, top_k: sampling knobs for ``sample`` (recorded per turn).
        seed: base seed; each turn's sampling seed derives from it and the turn's id.
        max_new_tokens: cap on generated tokens per assistant turn (``greedy``/``sample``).
        interleave: how many threads are decoded round-robin at once (>= 1).
        generation: owner generation stamped on every record.
    """

    mode: str = "forced"
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 96
    interleave: int = 4
    generation: int = 0

    def __post_init__(self) -> None:
        if self.mode not in DECODE_MODES:
            raise ConfigError(
                f"CaptureConfig.mode must be one of {DECODE_MODES}, got {self.mode!r}"
            )
        if self.interleave < 1:
            raise ConfigError(f"CaptureConfig.interleave must be >= 1, got {self.interleave}")
        if self.max_new_tokens < 1:
            raise ConfigError(
                f"CaptureConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if self.generation < 0:
            raise ConfigError(f"CaptureConfig.generation must be >= 0, got {self.generation}")


@dataclass
class CaptureSummary:
    """What a capture run produced (``bytes`` counts the Avro bytes handed to Kafka)."""

    threads: int = 0
    episodes: int = 0
    """Per-assistant-turn streams of threads whose template is not prefix-stable."""
    turns: int = 0
    decoded_tokens: int = 0
    observations: int = 0
    identity_id: str = ""
    decode_seconds: float = 0.0
    wall_seconds: float = 0.0
    delivered: int = 0
    failed: int = 0
    dropped: int = 0
    refused_no_consent: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    bytes_on_wire: dict[str, int] = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items()}
        out["decode_tokens_per_s"] = round(self.decode_tokens_per_s, 2)
        return out


@dataclass
class _ThreadState:
    thread: Thread
    turns: Iterator[RenderedTurn]
    history: list[int] = field(default_factory=list)


def observation_records(
    decoded: DecodedTurn, *, base: Mapping[str, Any], stage_of_layer: Iterable[int] | None = None
) -> Iterator[dict[str, Any]]:
    """One ``RouteObservation.v2`` dict per decoded token (``base`` holds the lineage).

    Routes are packed straight from the decode arrays (uint16 ids, float32 weights,
    one row per routed layer in layer order); no per-layer Python lists are built.
    """
    _, layers, top_k = decoded.expert_ids_TLK.shape
    stages = list(stage_of_layer) if stage_of_layer is not None else [RUNTIME_STAGE] * layers
    if len(stages) != layers:
        raise ConfigError(f"stage_of_layer names {len(stages)} stages for {layers} routed layers")
    ids_TLK = np.ascontiguousarray(decoded.expert_ids_TLK, dtype=ID_DTYPE)
    weights_TLK = np.ascontiguousarray(decoded.weights_TLK, dtype=WEIGHT_DTYPE)
    for t, token in enumerate(decoded.token_ids):
        yield {
            **base,
            "token_ordinal": int(decoded.ordinals[t]),
            "token_id": int(token),
            "speculative": None,
            "layers": list(range(layers)),
            "stages": list(stages),
            "top_k": int(top_k),
            "expert_ids": ids_TLK[t].tobytes(),
            "weights": weights_TLK[t].tobytes(),
        }


class CaptureSession:
    """Decodes threads on one teacher and publishes what the runtime observed."""

    def __init__(
        self, *, runtime: DecodeRuntime, tokenizer: Any, identity: Mapping[str, Any],
        publisher: RuntimePublisher, config: CaptureConfig,
    ) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.identity = dict(identity)
        self.publisher = publisher
        self.config = config
        self.summary = CaptureSummary(identity_id=self.identity["identity_id"])

    def run(self, threads: Iterable[Thread]) -> CaptureSummary:
        start = time.perf_counter()
        self.publisher.publish_identity(self.identity)
        source = self._streams(threads)
        active: deque[_ThreadState] = deque()
        while True:
            while len(active) < self.config.interleave and (t := next(source, None)) is not None:
                active.append(t)
            if not active:
                break
            state = active.popleft()
            if self._advance(state):
                active.append(state)
        self.summary.wall_seconds = time.perf_counter() - start
        return self.summary

    def _streams(self, threads: Iterable[Thread]) -> Iterator[_ThreadState]:
        """One state per token stream: the thread, or its episodes when the chat template
        is not prefix-stable (:func:`replay.render.render_episodes`)."""
        from hebrus_flywheel.replay.render import render_episodes

        for thread in threads:
            self.summary.threads += 1
            episodes = render_episodes(thread, self.tokenizer)
            self.summary.episodes += len(episodes) if episodes[0][0] is not thread else 0
            for stream, rendered in episodes:
                yield _ThreadState(thread=stream, turns=iter(rendered.turns))

    def _advance(self, state: _ThreadState) -> bool:
        """Decode and publish the thread's next turn; False once the thread is done."""
        turn = next(state.turns, None)
        if turn is None:
            return False
        closes = turn.turn_index == len(state.thread.messages) - 1
        if turn.role == "assistant" and any(s.generated for s in turn.segments):
            token_ids, segments = self._decode(state, turn)
        else:
            token_ids = list(turn.token_ids)
            segments = [_segment_dict(s) for s in turn.segments]
        record = self._turn_record(state, turn, token_ids, segments, closes)
        self.publisher.publish_turn(record)
        state.history.extend(token_ids)
        self.summary.turns += 1
        return not closes

    def _decode(
        self, state: _ThreadState, turn: RenderedTurn
    ) -> tuple[list[int], list[dict[str, Any]]]:
        generated = [s for s in turn.segments if s.generated]
        first, last = generated[0].start, generated[-1].end
        head, tail = list(turn.token_ids[:first]), list(turn.token_ids[last:])
        prefix = state.history + head
        if self.config.mode == "forced":
            decoded = self.runtime.decode_turn(prefix, forced_ids=list(turn.token_ids[first:last]))
            segments = [_segment_dict(s) for s in turn.segments]
        else:
            decoded = self.runtime.decode_turn(prefix, sampling=self._sampling(state, turn))
            segments = _generated_segments(len(head), len(decoded.token_ids), len(tail))
        base = self._lineage(state, turn)
        if len(decoded.token_ids):  # the whole decoded run at once: chunked, no per-token dict
            self.publisher.publish_run(
                base, first_ordinal=int(decoded.ordinals[0]), token_ids=decoded.token_ids,
                expert_ids_TLK=decoded.expert_ids_TLK, weights_TLK=decoded.weights_TLK)
            self.summary.observations += len(decoded.token_ids)
        self.summary.decoded_tokens += len(decoded.token_ids)
        self.summary.decode_seconds += decoded.timing.decode_s
        return head + list(decoded.token_ids) + tail, segments

    def _sampling(self, state: _ThreadState, turn: RenderedTurn) -> Any:
        from hebrus_flywheel.replay.decode import SamplingConfig

        cfg = self.config
        seed = _turn_seed(cfg.seed, state.thread.key, turn.turn_index)
        if cfg.mode == "greedy":
            return SamplingConfig(temperature=0.0, seed=seed, max_new_tokens=cfg.max_new_tokens)
        return SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              seed=seed, max_new_tokens=cfg.max_new_tokens)

    def _lineage(self, state: _ThreadState, turn: RenderedTurn) -> dict[str, Any]:
        thread = state.thread
        return {
            "owner": thread.owner,
            "thread": thread.thread_id,
            "generation": self.config.generation,
            "sequence_id": _sequence_id(thread.key, self.config.generation, turn.turn_index),
            "turn_index": turn.turn_index,
            "identity_id": self.identity["identity_id"],
        }

    def _turn_record(
        self, state: _ThreadState, turn: RenderedTurn, token_ids: list[int],
        segments: list[dict[str, Any]], closes: bool,
    ) -> dict[str, Any]:
        return {
            **self._lineage(state, turn),
            "role": turn.role,
            "token_offset": len(state.history),
            "token_ids": token_ids,
            "segments": segments,
            "sampling": self._sampling_record(state, turn),
            "domain_tags": list(state.thread.domain_tags),
            "closes_thread": closes,
        }

    def _sampling_record(self, state: _ThreadState, turn: RenderedTurn) -> dict[str, Any]:
        cfg = self.config
        generates = turn.role == "assistant" and cfg.mode != "forced"
        return {
            "mode": cfg.mode if turn.role == "assistant" else "forced",
            "temperature": cfg.temperature if generates and cfg.mode == "sample" else 0.0,
            "top_p": cfg.top_p if generates and cfg.mode == "sample" else 1.0,
            "top_k": cfg.top_k if generates and cfg.mode == "sample" else 0,
            "seed": _turn_seed(cfg.seed, state.thread.key, turn.turn_index) if generates else 0,
            "max_new_tokens": cfg.max_new_tokens if generates else 0,
        }


def _segment_dict(segment: Any) -> dict[str, Any]:
    return {"kind": segment.kind, "start": segment.start, "end": segment.end,
            "generated": segment.generated}


def _generated_segments(head: int, produced: int, tail: int) -> list[dict[str, Any]]:
    segments = [{"kind": "header", "start": 0, "end": head, "generated": False},
                {"kind": "content", "start": head, "end": head + produced, "generated": True}]
    if tail:
        end = head + produced
        segments.append({"kind": "footer", "start": end, "end": end + tail, "generated": False})
    return segments


def _sequence_id(thread_key: str, generation: int, turn_index: int) -> str:
    return f"{thread_key}#g{generation}#t{turn_index}"


def _turn_seed(seed: int, thread_key: str, turn_index: int) -> int:
    import hashlib

    digest = hashlib.sha256(f"{seed}|{thread_key}|{turn_index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def load_threads(
    threads_file: Path | None, synthetic: int | None, *, seed: int
) -> Iterable[Thread]:
    """Threads from a JSONL file, or ``synthetic`` generated ones (exactly one of both)."""
    if (threads_file is None) == (synthetic is None):
        raise ConfigError("give exactly one of --threads FILE or --synthetic N")
    if threads_file is not None:
        from hebrus_flywheel.replay.conversations import read_threads

        return read_threads(threads_file)
    from hebrus_flywheel.replay.synthetic import generate_threads

    if synthetic is None or synthetic < 1:
        raise ConfigError(f"--synthetic must be >= 1, got {synthetic}")
    return generate_threads(synthetic, seed=seed)
