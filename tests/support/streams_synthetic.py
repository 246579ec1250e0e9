"""Realistic capture records for tests and the bench (no model needed).

:func:`thread_messages` produces the records a decode runtime publishes for one thread
generation, in the runtime's order: for each assistant turn, one RouteObservation per
generated token and then the TranscriptTurn; other turns when they occur. Routes are
deterministic pseudo-random top-k sets (distinct experts, weights descending and
summing to 1) at any geometry, 48 layers × top-10 of 512 experts by default, packed
as ``RouteObservation.v2`` (:func:`streams.routes.to_v1` gives the v1 shape).

Records carry pseudonymous ids (``ThreadSpec.owner`` and ``thread`` are the raw ids;
:func:`tests.support.sealing.owner_pseudonym` maps them) and plaintext tokens and
routes; :func:`encode_message` seals them as the runtime publisher does
(``TranscriptTurn.v2`` / ``RouteObservation.v3``), or writes the old unsealed versions
with ``sealed=False``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.identity import with_identity_id
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.routes import is_packed, pack_routes
from tests.support.sealing import names, sealed

Message = tuple[str, bytes, dict[str, Any]]
"""``(kind, key, record)`` with kind transcripts | observations | identities."""


def make_identity(
    *, layers: int = 48, experts: int = 512, top_k: int = 10, name: str = "synthetic"
) -> dict[str, Any]:
    """A RuntimeIdentity with a correct identity_id."""
    return with_identity_id(
        {
            "model_family": "qwen3_next",
            "model_artifact_digest": "0" * 64,
            "tokenizer_digest": "1" * 64,
            "chat_template_digest": "2" * 64,
            "dtype": "float32",
            "quantization": "none",
            "routed_layer_count": layers,
            "expert_count": experts,
            "top_k": top_k,
            "tie_break_rule": "score_desc_then_expert_id_asc",
            "weight_rule": "softmax_topk_renormalized",
            "hidden_size": 64,
            "routed_intermediate_size": 32,
            "runtime_name": name,
            "runtime_version": "0",
        }
    )


@dataclass(kw_only=True)
class ProducerClock:
    """A runtime process: its id and its monotonic counter."""

    producer_id: str = "runtime-0"
    counter: int = 0

    def next(self) -> int:
        self.counter += 1
        return self.counter


@dataclass(frozen=True, kw_only=True)
class ThreadSpec:
    """One thread generation to synthesise.

    Fields:
        owner, thread, generation: its identity.
        turns: ``(role, content_tokens)`` per turn, in order.
        tokens: explicit canonical content per turn (overrides the random draw), for
            crafting exact and near duplicates.
        tags: domain tags carried by every turn.
        start_ms: wall time of the first turn (a turn every second after it).
        seed: drives token and route draws.
        vocab: token ids are drawn from ``[10, vocab)``.
    """

    owner: str
    thread: str
    generation: int = 0
    turns: tuple[tuple[str, int], ...] = (("user", 12), ("assistant", 20))
    tokens: tuple[tuple[int, ...], ...] | None = None
    tags: tuple[str, ...] = ()
    start_ms: int = 1_767_225_600_000
    seed: int = 0
    vocab: int = 4096
    closes: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.turns:
            raise ConfigError("ThreadSpec.turns must hold at least one turn")
        if self.tokens is not None and len(self.tokens) != len(self.turns):
            raise ConfigError("ThreadSpec.tokens must give one token tuple per turn")


def route_fields(rng: np.random.Generator, identity: dict[str, Any]) -> dict[str, Any]:
    """Packed (RouteObservation.v2) routes: distinct top-k experts per layer with
    descending weights summing to 1, built from arrays as a runtime does."""
    n_layers, k, experts = (
        identity["routed_layer_count"],
        identity["top_k"],
        identity["expert_count"],
    )
    stride = 37 if experts % 37 else 41
    base = rng.integers(0, experts, size=n_layers)
    ids = (base[:, None] + np.arange(k)[None, :] * stride) % experts
    raw = np.sort(rng.random((n_layers, k)) + 0.05, axis=1)[:, ::-1]
    weights = (raw / raw.sum(axis=1, keepdims=True)).astype(np.float32)
    return pack_routes(ids, weights)


def _turn_tokens(
    spec: ThreadSpec, rng: np.random.Generator, index: int, role: str, n: int
) -> list[int]:
    body = (
        list(spec.tokens[index])
        if spec.tokens is not None
        else rng.integers(10, spec.vocab, n).tolist()
    )
    role_id = {"system": 2, "user": 3, "assistant": 4, "tool": 5}[role]
    return [1, role_id, *body, 7]


def _segments(role: str, n_body: int) -> list[dict[str, Any]]:
    gen = role == "assistant"
    return [
        {"kind": "header", "start": 0, "end": 2, "generated": False},
        {
            "kind": "tool_call" if role == "tool" else "content",
            "start": 2,
            "end": 2 + n_body,
            "generated": gen,
        },
        {"kind": "footer", "start": 2 + n_body, "end": 3 + n_body, "generated": gen},
    ]


def thread_messages(
    spec: ThreadSpec, identity: dict[str, Any], clock: ProducerClock, *, raw_ids: bool = False
) -> Iterator[Message]:
    """The capture records of one thread generation, in publish order, with pseudonymous
    ids (what the stream workers see), or with ``raw_ids`` the runtime's own ids (what a
    runtime hands to :class:`~streams.publisher.RuntimePublisher`)."""
    rng = np.random.default_rng([spec.seed, spec.generation])
    pseudo = names()
    owner, thread = pseudo.owner(spec.owner), pseudo.thread(spec.owner, spec.thread)
    if raw_ids:
        owner, thread = spec.owner, spec.thread
    key = f"{owner}/{thread}".encode()
    offset = 0
    for index, (role, n) in enumerate(spec.turns):
        tokens = _turn_tokens(spec, rng, index, role, n)
        seq = f"{spec.thread}-g{spec.generation}-t{index}"
        seq = seq if raw_ids else pseudo.sequence(spec.owner, seq)
        wall = spec.start_ms + 1000 * index
        if role == "assistant":
            for pos in range(2, len(tokens)):
                obs = _observation(
                    spec, identity, clock, rng, seq, index, offset + pos, tokens[pos], wall
                )
                yield "observations", key, {**obs, "owner": owner, "thread": thread}
        closes = spec.closes and index == len(spec.turns) - 1
        turn = _turn(spec, identity, clock, seq, index, role, offset, tokens, closes, wall)
        yield "transcripts", key, {**turn, "owner": owner, "thread": thread}
        offset += len(tokens)


def _observation(
    spec: ThreadSpec,
    identity: dict[str, Any],
    clock: ProducerClock,
    rng: np.random.Generator,
    seq: str,
    turn: int,
    ordinal: int,
    token: int,
    wall: int,
) -> dict[str, Any]:
    return {
        "owner": spec.owner,
        "thread": spec.thread,
        "generation": spec.generation,
        "sequence_id": seq,
        "turn_index": turn,
        "token_ordinal": ordinal,
        "token_id": token,
        "identity_id": identity["identity_id"],
        "speculative": None,
        **route_fields(rng, identity),
        "producer_id": clock.producer_id,
        "counter": clock.next(),
        "wall_time_ms": wall,
    }


def _turn(
    spec: ThreadSpec,
    identity: dict[str, Any],
    clock: ProducerClock,
    seq: str,
    index: int,
    role: str,
    offset: int,
    tokens: list[int],
    closes: bool,
    wall: int,
) -> dict[str, Any]:
    return {
        "owner": spec.owner,
        "thread": spec.thread,
        "turn_index": index,
        "generation": spec.generation,
        "sequence_id": seq,
        "role": role,
        "token_offset": offset,
        "token_ids": tokens,
        "segments": _segments(role, len(tokens) - 3),
        "sampling": {
            "mode": "forced",
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
            "seed": 0,
            "max_new_tokens": 0,
        },
        "identity_id": identity["identity_id"],
        "domain_tags": list(spec.tags),
        "closes_thread": closes,
        "producer_id": clock.producer_id,
        "counter": clock.next(),
        "wall_time_ms": wall,
    }


SCHEMAS = {
    "transcripts": "TranscriptTurn.v1",
    "observations": "RouteObservation.v2",
    "identities": "RuntimeIdentity.v1",
}
V1_OBSERVATION_SCHEMA = "RouteObservation.v1"


def encode_message(
    kind: str, record: dict[str, Any], *, validate: bool = False, seal: bool = True
) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Single-object bytes and schema headers of a capture record, sealed
    (``TranscriptTurn.v2`` / ``RouteObservation.v3``) unless ``seal=False``. Unsealed,
    observations are written as v2 when their routes are packed, as v1 when they hold
    ``LayerRoute`` s (see :func:`streams.routes.to_v1`)."""
    if seal and kind in ("transcripts", "observations"):
        schema, record = sealed(kind, record)
        return codec.encode(schema, record, validate=validate), codec.kafka_headers(schema)
    schema = SCHEMAS[kind]
    if kind == "observations" and not is_packed(record):
        schema = V1_OBSERVATION_SCHEMA
    return codec.encode(schema, record, validate=validate), codec.kafka_headers(schema)


def random_specs(
    n_threads: int,
    *,
    n_owners: int = 8,
    seed: int = 0,
    assistant_tokens: int = 24,
    turns: int = 4,
    start_ms: int = 1_767_225_600_000,
) -> list[ThreadSpec]:
    """``n_threads`` specs alternating user/assistant turns, spread over ``n_owners``."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(n_threads):
        shape = tuple(
            ("assistant", int(rng.integers(assistant_tokens // 2, assistant_tokens + 1)))
            if t % 2
            else ("user", int(rng.integers(4, 16)))
            for t in range(turns)
        )
        specs.append(
            ThreadSpec(
                owner=f"owner-{i % n_owners:04d}",
                thread=f"thread-{i:05d}",
                turns=shape,
                seed=seed * 1_000_003 + i,
                start_ms=start_ms + 60_000 * i,
            )
        )
    return specs


def partition_for(key: bytes, partitions: int = 4) -> int:
    """A stable partition for a key (tests only; Kafka producers use their own partitioner)."""
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") % partitions


@dataclass(kw_only=True)
class Feeder:
    """Assigns partitions and offsets to synthetic messages, like a topic would."""

    partitions: int = 4
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    def place(self, kind: str, key: bytes) -> tuple[int, int]:
        partition = 0 if kind == "identities" else partition_for(key, self.partitions)
        offset = self.offsets.get((kind, partition), 0)
        self.offsets[(kind, partition)] = offset + 1
        return partition, offset

    def encoded(self, messages: Iterable[Message]) -> list[tuple[str, int, int, bytes, bytes]]:
        """``(kind, partition, offset, key, value)`` for each message, in order."""
        out = []
        for kind, key, record in messages:
            value, _ = encode_message(kind, record)
            partition, offset = self.place(kind, key)
            out.append((kind, partition, offset, key, value))
        return out


def identity_message(identity: dict[str, Any]) -> Message:
    return "identities", identity["identity_id"].encode(), identity


class Scenario:
    """A :class:`~streams.processors.pipeline.LocalPipeline` plus the means to feed it."""

    def __init__(self, pipeline: Any, *, identity: dict[str, Any] | None = None) -> None:
        self.pipeline = pipeline
        self.feeder = Feeder()
        self.clock = ProducerClock()
        self.identity = identity or make_identity(layers=4, experts=64, top_k=4)

    def publish_identity(self, identity: dict[str, Any] | None = None) -> None:
        self.send(*identity_message(identity or self.identity))

    def send(
        self,
        kind: str,
        key: bytes,
        record: dict[str, Any] | None = None,
        *,
        value: bytes | None = None,
        now_ms: int = 0,
        partition: int | None = None,
    ) -> None:
        """Encode (unless ``value`` is given) and feed one message."""
        if value is None:
            value, _ = encode_message(kind, record or {})
        placed, offset = self.feeder.place(kind, key)
        part = placed if partition is None else partition
        self.pipeline.feed(kind, part, offset, key, value, now_ms=now_ms)

    def messages(self, spec: ThreadSpec) -> list[Message]:
        return list(thread_messages(spec, self.identity, self.clock))

    def send_thread(self, spec: ThreadSpec, *, now_ms: int = 0) -> None:
        for kind, key, record in self.messages(spec):
            self.send(kind, key, record, now_ms=now_ms)
