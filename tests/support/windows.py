"""Helpers for tests and the bench: craft and publish windows, run workers.

:func:`make_window` builds a valid ``Window.v1`` record (window id and content digest
computed the way the stream processors compute them) from real token ids of the
teacher's tokenizer; :func:`publish_windows` produces records to the window topics with
the codec's headers; :class:`WorkerProcess` runs
``python -m hebrus_flywheel.consumers replay worker`` as a subprocess (optionally with
``FLYWHEEL_FAULT`` set, for kill -9 tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers.exceptions import ConsumersError
from hebrus_flywheel.consumers.faults import FAULT_ENV
from hebrus_flywheel.core import kafka
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.processors.window import content_digest
from hebrus_flywheel.streams.processors.window_seal import encode_window
from hebrus_flywheel.streams.topics import window_topic
from tests.support.consent import grant_owners

# The corpus ships inside the package (replay/data), two folders above tests/support.
DATA_DIR = Path(__file__).resolve().parents[2] / "replay" / "data"


def _sha(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()


CORPUS_FILES = ("prose_en.txt", "code_python.txt")


def corpus_token_ids(tokenizer_dir: Path, *, files: Sequence[str] = CORPUS_FILES) -> list[int]:
    """Real token ids of the project's text corpus under the teacher's tokenizer."""
    from hebrus_flywheel.replay.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    text = "\n".join((DATA_DIR / name).read_text(encoding="utf-8") for name in files)
    return list(tok.tokenizer.encode(text).ids)


def make_window(*, token_ids: Sequence[int], anchors: Sequence[int], identity_id: str,
                owner: str, thread: str, split: str = "train", generation: int = 0,
                first_token_ordinal: int = 0, window_index: int = 0, window_count: int = 1,
                domain_tags: Sequence[str] = ("prose",),
                routes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A ``Window.v1`` record with a correct ``window_id`` and ``content_digest``."""
    tokens = [int(t) for t in token_ids]
    anchor_list = [int(a) for a in anchors]
    tokens_digest = _sha(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    ident = {"v": 1, "identity_id": identity_id, "owner": owner, "thread": thread,
             "generation": generation, "first_token_ordinal": first_token_ordinal,
             "anchors": [a + first_token_ordinal for a in anchor_list], "tokens": tokens_digest}
    window: dict[str, Any] = {
        "window_id": _sha(json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()),
        "content_digest": "", "split": split, "split_rule": "owner", "owner": owner,
        "thread": thread, "generation": generation, "identity_id": identity_id,
        "domain_tags": list(domain_tags), "thread_digest": tokens_digest,
        "thread_token_count": first_token_ordinal + len(tokens), "window_index": window_index,
        "window_count": window_count, "token_ids": tokens,
        "first_token_ordinal": first_token_ordinal, "anchor_positions": anchor_list,
        "turns": [], "routes": None if routes is None else dict(routes),
        "config_digest": "0" * 64,
    }
    window["content_digest"] = content_digest(window)
    return window


def thread_windows(tokens: Sequence[int], *, identity_id: str, owner: str, thread: str,
                   split: str = "train", count: int = 3, length: int = 48,
                   anchors_per_window: int = 6, start: int = 0) -> list[dict[str, Any]]:
    """``count`` consecutive causal windows of one thread cut from ``tokens``."""
    out = []
    for i in range(count):
        first = start + i * anchors_per_window
        piece = tokens[first:first + length]
        anchors = list(range(len(piece) - anchors_per_window, len(piece)))
        out.append(make_window(token_ids=piece, anchors=anchors, identity_id=identity_id,
                               owner=owner, thread=thread, split=split,
                               first_token_ordinal=first, window_index=i, window_count=count))
    return out


def publish_windows(bootstrap: str, prefix: str, windows: Iterable[Mapping[str, Any]],
                    *, partition: int | None = None,
                    consent: bool = True,
                    sealer: Any = None) -> list[tuple[str, int, int]]:
    """Produce windows to their split topics (key owner/thread); their coordinates. With
    ``consent`` (the default) the windows' owners are first granted every scope on the
    prefix's consent ledger (a test of refusals passes ``consent=False``). With a
    ``sealer`` (:class:`streams.owner_seal.OwnerSealer`) they go out as the stream
    workers write them (``Window.v2``, sealed under the owner's key), else as plaintext
    ``Window.v1`` records."""
    windows = list(windows)
    if consent:
        grant_owners(bootstrap, {w["owner"] for w in windows}, prefix=prefix)
    entry = codec.default_registry().get("Window.v1")
    producer = kafka.make_producer(
        kafka.client_config(bootstrap),
        settings={"acks": "all", "enable.idempotence": True, "partitioner": "murmur2_random"})
    coords: list[tuple[str, int, int]] = []
    errors: list[str] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            coords.append((msg.topic(), msg.partition(), msg.offset()))

    for window in windows:
        value, record = (encode_window(window, sealer) if sealer is not None
                         else (codec.encode_entry(entry, window), window))
        schema = entry if sealer is None else codec.default_registry().get("Window.v2")
        producer.produce(prefix + window_topic(window["split"]),
                         key=f"{window['owner']}/{window['thread']}".encode(),
                         value=value,
                         headers=[*codec.kafka_headers(schema),
                                  ("window_id", record["window_id"].encode())],
                         on_delivery=on_delivery,
                         partition=-1 if partition is None else partition)
        producer.poll(0)
    if errors or producer.flush(30):
        raise ConsumersError(f"could not publish windows: {errors or 'timeout'}")
    return coords


def holdout_window(teacher: Any, tokens: Sequence[int], *, identity_id: str, owner: str,
                   thread: str, anchors: int = 6) -> dict[str, Any]:
    """A ``runtime_holdout`` window whose routes come from REAL KV-cache decode.

    The last ``anchors`` tokens are decoded one at a time (teacher forcing) after a
    prefill of the rest, as the reference runtime does; their native top-k become the
    window's captured ``routes`` (the parity gate's decode truth).
    """
    from hebrus_flywheel.replay.decode import DecodeRuntime

    tokens = [int(t) for t in tokens]
    cut = len(tokens) - anchors
    turn = DecodeRuntime(teacher).decode_turn(tokens[:cut], forced_ids=tokens[cut:])
    layers, top_k = turn.expert_ids_TLK.shape[1:]
    routes = {"layer_count": int(layers), "top_k": int(top_k), "layers": list(range(layers)),
              "stages": [0] * int(layers),
              "expert_ids": turn.expert_ids_TLK.astype("<i2").tobytes(),
              "weights": turn.weights_TLK.astype("<f4").tobytes()}
    return make_window(token_ids=tokens, anchors=list(range(cut, len(tokens))),
                       identity_id=identity_id, owner=owner, thread=thread,
                       split="runtime_holdout", domain_tags=("runtime_capture",), routes=routes)


def router_labels(rng: Any, anchors: int, layers: int = 4, *, experts: int = 512, top_k: int = 10,
                  logit_std: float = 2.0) -> tuple[Any, Any, Any]:
    """Ranked top-k ids (uint16), renormalised softmax weights and margins of random logits.

    Logits are N(0, ``logit_std``^2) per expert, like the generated teacher's routers.
    """
    import numpy as np

    logits = rng.normal(0.0, logit_std, size=(anchors, layers, experts))
    top = np.argsort(-logits, axis=-1, kind="stable")[..., : top_k + 1]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.take_along_axis(probs, top[..., :top_k], -1)
    scores = np.take_along_axis(logits, top, -1)
    return (top[..., :top_k].astype(np.uint16),
            (chosen / chosen.sum(-1, keepdims=True)).astype(np.float32),
            (scores[..., top_k - 1] - scores[..., top_k]).astype(np.float32))


def synthetic_labels(wid: str, anchors: int, *, seed: int = 0, first: int = 0, layers: int = 4,
                     feature_dim: int = 16, hidden_dim: int = 64, hidden: bool = False) -> Any:
    """A real ``replay.prefill.WindowLabels`` holding synthetic router output (no model run)."""
    import numpy as np

    from hebrus_flywheel.replay.prefill import WindowLabels

    rng = np.random.default_rng(seed)
    ids, weights, margins = router_labels(rng, anchors, layers)
    return WindowLabels(
        window_id=wid, split="train", owner=f"owner-{wid}", thread="t", generation=0,
        identity_id="i" * 64, domain_tags=("prose",),
        anchor_ordinals_A=np.arange(first, first + anchors, dtype=np.int64),
        token_ids_A=rng.integers(0, 4000, anchors).astype(np.int32),
        expert_ids_ALK=ids, weights_ALK=weights, margins_AL=margins,
        features_ALD=rng.normal(size=(anchors, layers, feature_dim)).astype(np.float16),
        hidden_ALH=(rng.normal(size=(anchors, layers, hidden_dim)).astype(np.float32)
                    if hidden else None),
    )


class WorkerProcess:
    """``python -m hebrus_flywheel.consumers replay worker ARGS`` as a subprocess.

    Its output goes to a log file.
    """

    def __init__(self, args: Sequence[str], *, log_path: Path, fault: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        full_env = {**os.environ, **(env or {})}
        full_env.pop(FAULT_ENV, None)
        if fault is not None:
            full_env[FAULT_ENV] = fault
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hebrus_flywheel.consumers", "replay", "worker", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._log.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


def synthetic_layout(*, layers: int = 4, top_k: int = 10, feature_dim: int = 16,
                     hidden_dim: int = 64, experts: int = 512,
                     weight_encoding: str = "uint8") -> Any:
    """A ``ShardLayout`` for :func:`synthetic_labels` rows (contiguous routed layers)."""
    from hebrus_flywheel.core.geometry import RouteGeometry
    from hebrus_flywheel.core.snapshot import ShardLayout

    route = RouteGeometry(family="synthetic", routed_layers=tuple(range(layers)),
                          layer_count=layers, expert_count=experts, top_k=top_k,
                          hidden_size=hidden_dim, routed_intermediate_size=16)
    return ShardLayout(route=route, feature_dim=feature_dim, hidden_dim=hidden_dim,
                       weight_encoding=weight_encoding, projection_id="p" * 64, projection_seed=0)
