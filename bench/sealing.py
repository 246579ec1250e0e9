"""Cost of crypto-shredding what the stream workers write; one JSON line per figure.

Per window (``Window.v1`` plaintext vs ``Window.v2`` sealed, encode and decode+open) and
per table write (the state-codec record vs the sealed value, write and restore) and per sealed
internal-topic summary: microseconds per operation (median of ``--repeat`` rounds of
``--n`` operations, this process only, no Kafka) and bytes added. Usage::

    python bench/sealing.py [--n 2000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.owner_seal import OwnerSealer, open_fields, seal_fields
from hebrus_flywheel.streams.processors.common import header_key, instance_id, obs_key, turn_key
from hebrus_flywheel.streams.processors.state_codec import dumps, loads
from hebrus_flywheel.streams.processors.state_seal import StateSealer
from hebrus_flywheel.streams.processors.window_seal import encode_window, readable_window
from tests.support.windows import make_window


def _us(fn: Callable[[], Any], n: int, repeat: int) -> float:
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return round(statistics.median(rounds), 2)


def _windows(owner: str, rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    tokens = rng.integers(0, 151_000, 2048).tolist()
    train = make_window(token_ids=tokens, anchors=list(range(2048 - 256, 2048)),
                        identity_id="i" * 64, owner=owner, thread="t" + "0" * 32)
    layers, top_k, anchors = 48, 10, 64
    routes = {"layer_count": layers, "top_k": top_k, "layers": list(range(layers)),
              "stages": [0] * layers,
              "expert_ids": rng.integers(0, 512, anchors * layers * top_k).astype("<i2").tobytes(),
              "weights": rng.random(anchors * layers * top_k).astype("<f4").tobytes()}
    holdout = make_window(token_ids=rng.integers(0, 151_000, 8192).tolist(),
                          anchors=list(range(8192 - anchors, 8192)), identity_id="i" * 64,
                          owner=owner, thread="t" + "1" * 32, split="runtime_holdout",
                          routes=routes)
    return {"train_2048_tokens": train, "holdout_8192_tokens_64x48x10_routes": holdout}


def bench_windows(sealer: OwnerSealer, owner: str, n: int, repeat: int) -> None:
    v1 = codec.default_registry().get("Window.v1")
    for name, window in _windows(owner, np.random.default_rng(0)).items():
        plain = codec.encode_entry(v1, window, validate=False)
        sealed, record = encode_window(window, sealer)
        decoded = codec.decode(sealed)[1]
        k = max(1, n // 20)
        print(json.dumps({
            "figure": "window", "window": name,
            "v1_bytes": len(plain), "v2_bytes": len(sealed),
            "bytes_added": len(sealed) - len(plain),
            "v1_encode_us": _us(lambda w=window: codec.encode_entry(v1, w, validate=False),
                                k, repeat),
            "v2_seal_encode_us": _us(lambda w=window: encode_window(w, sealer), k, repeat),
            "v1_decode_us": _us(lambda b=plain: codec.decode(b), k, repeat),
            "v2_decode_open_us": _us(
                lambda b=sealed: readable_window(2, codec.decode(b)[1], sealer), k, repeat),
            "open_only_us": _us(lambda r=decoded: readable_window(2, r, sealer), k, repeat),
            "window_id_changed": record["window_id"] != window["window_id"],
        }))


def _state_values(owner: str, rng: np.random.Generator) -> dict[str, tuple[str, Any]]:
    iid = instance_id(owner, "t" + "0" * 32, 0)
    header = {"owner": owner, "thread": "t" + "0" * 32, "generation": 0, "identity_id": "i" * 64,
              "partition": 0, "status": "open", "wm": {"transcripts": 10, "observations": 900},
              "failed": [], "turns": [[0, 6]], "tokens": [[0, 1800]], "gen": [[40, 600]],
              "obs": [[40, 590]], "seq": {"s" + "0" * 32: 589}, "close": None, "end": None,
              "start_ms": 1, "tags": ["prose"], "tool_turns": 0, "tool_call_segments": 0,
              "last_ms": 2, "outbox": []}
    turn = {"turn_index": 3, "role": "assistant", "token_offset": 1200,
            "token_ids": rng.integers(0, 151_000, 300).tolist(),
            "segments": [("header", 0, 2, False), ("content", 2, 299, True)],
            "sequence_id": "s" + "0" * 32, "sampling_mode": "greedy"}
    obs = {"token_id": 17, "turn_index": 3,
           "ids": rng.integers(0, 512, 480).astype("<u2").tobytes(),
           "weights": rng.random(480).astype("<f4").tobytes(), "stages": [0] * 48}
    return {"header": (header_key(iid), header), "turn_300_tokens": (turn_key(iid, 3), turn),
            "observation_48x10": (obs_key(iid, 590), obs)}


def bench_state(sealer: OwnerSealer, owner: str, n: int, repeat: int) -> None:
    state = StateSealer(sealer, "capture-state")
    for name, (key, value) in _state_values(owner, np.random.default_rng(1)).items():
        plain, sealed = dumps(value), dumps(state.seal(key, value))
        restored = loads(sealed)
        print(json.dumps({
            "figure": "state_write", "value": name,
            "plain_bytes": len(plain), "sealed_bytes": len(sealed),
            "bytes_added": len(sealed) - len(plain),
            "plain_write_us": _us(lambda v=value: dumps(v), n, repeat),
            "sealed_write_us": _us(lambda k=key, v=value: dumps(state.seal(k, v)), n, repeat),
            "plain_restore_us": _us(lambda b=plain: loads(b), n, repeat),
            "sealed_restore_us": _us(lambda k=key, b=sealed: state.open(k, loads(b)), n, repeat),
            "open_only_us": _us(lambda k=key, r=restored: state.open(k, r), n, repeat),
        }))


def bench_summary(sealer: OwnerSealer, owner: str, n: int, repeat: int) -> None:
    summary = {"iid": "x", "owner": owner, "digest": "ab" * 32,
               "minhash": list(range(4_000_000_000, 4_000_000_128)), "split": "train"}
    wire = seal_fields(summary, ("digest", "minhash"), sealer, context="x")
    print(json.dumps({
        "figure": "threads_topic_summary",
        "plain_bytes": len(json.dumps(summary)), "sealed_bytes": len(json.dumps(wire)),
        "seal_us": _us(lambda: seal_fields(summary, ("digest", "minhash"), sealer, context="x"),
                       n, repeat),
        "open_us": _us(lambda: open_fields(wire, sealer, context="x"), n, repeat),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        writer = LocalOwnerKeyStore(Path(tmp) / "owners", create=True)
        owner = Pseudonymizer(writer).owner("bench")
        writer.data_key(owner, create=True)
        sealer = OwnerSealer(lambda: LocalOwnerKeyStore(Path(tmp) / "owners"))
        bench_windows(sealer, owner, args.n, args.repeat)
        bench_state(sealer, owner, args.n, args.repeat)
        bench_summary(sealer, owner, args.n, args.repeat)


if __name__ == "__main__":
    main()
