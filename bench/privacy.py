"""Cost of pseudonymous, sealed capture (:mod:`streams.sealing`): CPU per record and bytes.

Figures (one JSON line each, never asserted anywhere), at the full 48-layer,
top-10-of-512 geometry of ``bench/publish.py``:

* ``seal_observation_us`` / ``open_observation_us`` — the publisher's pseudonymize +
  seal (token id and routes, two AES-256-GCM seals) and a worker's open, per
  ``RouteObservation``, in µs (median of ``--rounds``).
* ``seal_turn_us`` / ``open_turn_us`` — the same for a ``TranscriptTurn`` of
  ``--turn-tokens`` tokens.
* ``observation_bytes_added`` / ``turn_bytes_added`` — Avro single-object bytes of the
  sealed record (``RouteObservation.v3`` / ``TranscriptTurn.v2``) minus those of the
  plaintext one (v2 / v1) with raw ids of typical length.

No broker needed: a throwaway key store in a temporary directory. Usage:
``python bench/privacy.py [--records N]`` (or ``python -m bench.privacy``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.routes import pack_routes
from hebrus_flywheel.streams.sealing import (
    OBSERVATION_V3,
    TURN_V2,
    CaptureOpener,
    CaptureSealer,
)

LAYERS, TOP_K, EXPERTS = 48, 10, 512


def emit(figure: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"bench": "privacy", "figure": figure, "value": value, "unit": unit,
                      **extra}), flush=True)


def _observations(count: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        ids = (rng.integers(0, EXPERTS, LAYERS)[:, None] + 37 * np.arange(TOP_K)) % EXPERTS
        raw = np.sort(rng.random((LAYERS, TOP_K)), axis=1)[:, ::-1]
        weights = (raw / raw.sum(axis=1, keepdims=True)).astype(np.float32)
        out.append({"owner": f"user-{i % 4:08d}@example.org", "thread": f"thread-{i % 16:06d}",
                    "generation": 0, "sequence_id": f"req-{i % 16:012d}", "turn_index": 1,
                    "token_ordinal": i, "token_id": int(rng.integers(150_000)),
                    "identity_id": "f" * 64, "speculative": None,
                    **pack_routes(ids.astype(np.uint16), weights),
                    "producer_id": "bench-0", "counter": i, "wall_time_ms": 1_767_225_600_000})
    return out


def _turns(count: int, tokens: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    return [{"owner": f"user-{i % 4:08d}@example.org", "thread": f"thread-{i:06d}",
             "turn_index": 0, "generation": 0, "sequence_id": f"req-{i:012d}", "role": "user",
             "token_offset": 0, "token_ids": rng.integers(150_000, size=tokens).tolist(),
             "segments": [{"kind": "content", "start": 0, "end": tokens, "generated": False}],
             "sampling": {"mode": "forced", "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                          "seed": 0, "max_new_tokens": 0},
             "identity_id": "f" * 64, "domain_tags": [], "closes_thread": True,
             "producer_id": "bench-0", "counter": i, "wall_time_ms": 1_767_225_600_000}
            for i in range(count)]


def _median_us(run: Callable[[], object], items: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) / items * 1e6)
    return round(statistics.median(times), 2)


def _bench(kind: str, records: list[dict[str, Any]], seal: Callable[[dict[str, Any]], Any],
           plain_schema: str, sealed_schema: str, rounds: int, **extra: Any) -> None:
    opener = CaptureOpener(LocalOwnerKeyStore())
    sealed = [seal(r) for r in records]  # creates the owners' keys outside the timing
    emit(f"seal_{kind}_us", _median_us(lambda: [seal(r) for r in records], len(records),
                                       rounds), "µs/record", **extra)
    emit(f"open_{kind}_us", _median_us(lambda: [opener.open(sealed_schema, s) for s in sealed],
                                       len(records), rounds), "µs/record", **extra)
    plain = statistics.mean(len(codec.encode(plain_schema, r)) for r in records)
    after = statistics.mean(len(codec.encode(sealed_schema, s)) for s in sealed)
    emit(f"{kind}_bytes_added", round(after - plain, 1), "bytes/record",
         plaintext_bytes=round(plain, 1), sealed_bytes=round(after, 1), **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--turn-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FLYWHEEL_OWNER_KEYS"] = str(Path(tmp) / "owner-keys")
        sealer = CaptureSealer(LocalOwnerKeyStore(create=True))
        _bench("observation", _observations(args.records), sealer.observation,
               "RouteObservation.v2", OBSERVATION_V3,
               args.rounds, layers=LAYERS, top_k=TOP_K)
        _bench("turn", _turns(max(1, args.records // 10), args.turn_tokens), sealer.turn,
               "TranscriptTurn.v1", TURN_V2, args.rounds,
               tokens=args.turn_tokens)


if __name__ == "__main__":
    main()
