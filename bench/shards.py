"""Cost of encryption at rest: shard write (what sealing data costs) and read, encrypted
vs plaintext, in the same run on the same rows.

Rows: synthetic router labels shaped like the default teacher's shards (48 routed
layers, top-10 of 512, D = 64 fp16 features, uint8 weights), packed by
``consumers.labels.pack_rows`` and written by ``consumers.shards.write_shard`` with the
default :class:`ShardConfig` (zstd 3, 8192-row groups): once with the default encryption
(encrypted footer, two column keys wrapped by the local key file's KEK; the writer also
encodes the rows once more without encryption for ``plaintext_sha256``), once with
``crypto=None``. Reads go through ``core.snapshot.read_parquet`` (decrypting). Each
figure is the best of ``--repeats`` interleaved runs; ratios are reported, never asserted.
Uses a throw-away ``FLYWHEEL_HOME`` (and so a throw-away key file) unless one is set.

    .venv/bin/python bench/shards.py [--windows 16] [--anchors 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run by path, sys.path[0] is bench/: the repository root makes tests.support importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def emit(figure: str, value: float | int | str, unit: str, **extra: Any) -> None:
    print(json.dumps({"bench": "shards", "figure": figure, "value": value, "unit": unit,
                      **extra}), flush=True)


def _table(windows: int, anchors: int) -> Any:
    from hebrus_flywheel.consumers.labels import SourceRef, pack_rows
    from hebrus_flywheel.core.snapshot import shard_metadata
    from tests.support.windows import synthetic_labels, synthetic_layout

    layout = synthetic_layout(layers=48, top_k=10, feature_dim=64, hidden_dim=64)
    rows = [(synthetic_labels(f"w{i}", anchors, seed=i, first=anchors * i, layers=48,
                              feature_dim=64), SourceRef(topic="bench", partition=0, offset=i))
            for i in range(windows)]
    table = pack_rows(rows, layout)
    return table.replace_schema_metadata(shard_metadata(layout, {
        "epoch": 0, "rows": table.num_rows, "identity_id": "i" * 64, "windows": windows}))


def _best(run: Callable[[int], Any], repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for i in range(repeats):
        start = time.perf_counter()
        out = run(i)
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=512, help="rows per window")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as scratch:
        os.environ.setdefault("FLYWHEEL_HOME", str(Path(scratch) / "home"))
        from hebrus_flywheel.consumers.shards import ShardConfig, write_shard
        from hebrus_flywheel.core.snapshot import read_parquet

        table = _table(args.windows, args.anchors)
        root = Path(scratch) / "shards"
        modes: dict[str, Any] = {"encrypted": "default", "plaintext": None}
        times: dict[str, dict[str, float]] = {}
        infos: dict[str, Any] = {}
        for _ in range(args.repeats):  # interleaved, so load drifts hit both modes alike
            for mode, crypto in modes.items():
                rel = f"{mode}-{time.perf_counter_ns()}.parquet"
                write_s, infos[mode] = _best(lambda _i, rel=rel, crypto=crypto: write_shard(
                    root, rel, table, ShardConfig(), windows=args.windows, crypto=crypto), 1)
                read_s, _ = _best(lambda _i, rel=rel: read_parquet(root / rel), 1)
                entry = times.setdefault(mode, {"write": float("inf"), "read": float("inf")})
                entry["write"], entry["read"] = min(entry["write"], write_s), min(
                    entry["read"], read_s)
        mib = table.nbytes / 2**20
        extra = {"rows": table.num_rows, "arrow_mib": round(mib, 1), "repeats": args.repeats}
        for mode in modes:
            emit(f"seal_write_{mode}_mib_per_s", round(mib / times[mode]["write"], 1), "MiB/s",
                 **extra)
            emit(f"read_{mode}_mib_per_s", round(mib / times[mode]["read"], 1), "MiB/s",
                 **extra)
        for step, figure in (("write", "seal"), ("read", "read")):
            emit(f"{figure}_encrypted_to_plaintext_ratio", round(
                times["encrypted"][step] / times["plaintext"][step], 2), "x time", **extra)
        emit("encrypted_bytes_overhead",
             round(infos["encrypted"].bytes / infos["plaintext"].bytes - 1, 4), "fraction",
             encrypted_bytes=infos["encrypted"].bytes, plaintext_bytes=infos["plaintext"].bytes,
             **extra)


if __name__ == "__main__":
    main()
