"""Parity of an epoch's sealed ``runtime_holdout`` shards against the captured decode routes.

Used by ``flywheel seal`` when no parity file (``flywheel parity --out``) is given. It
runs the parity gate's own accumulator (:class:`replay.parity.ParityAccumulator`: exact
expert ids in exact rank order per (anchor, layer), margins summarised, per-layer
mismatch rates) over the labels AS STORED in the epoch's shards, paired with the decode
routes the same windows carry on the window topic. So it checks the very bytes being
sealed, without loading torch or the teacher. Weights are compared with a declared
tolerance: the shard's quantisation bound plus the gate's default 1e-4.

An epoch without eligible ``runtime_holdout`` windows (routes captured, history from
ordinal 0) gives ``authoritative: false``: sealing it then needs a parity file or an
explicit override.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hebrus_flywheel.consumers.epochs import EpochBoundary
from hebrus_flywheel.consumers.exceptions import SealError
from hebrus_flywheel.consumers.kafka_io import read_ranges
from hebrus_flywheel.consumers.shards import iter_shards
from hebrus_flywheel.core.snapshot import (
    U8_MAX_ABS_ERROR,
    dequantize_weights_u8,
    open_parquet,
    read_parquet,
)
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.exceptions import SchemaError
from hebrus_flywheel.streams.processors.window_seal import Erased, default_sealer, readable_window

HOLDOUT_SPLIT = "runtime_holdout"
_TOLERANCE = {"weights_u8": U8_MAX_ABS_ERROR + 1e-4, "weights_f16": 2.0**-11 + 1e-4}


@dataclass(frozen=True, kw_only=True)
class StoredLabels:
    """One window's labels read back from a shard (the fields the parity gate reads)."""

    window_id: str
    anchor_ordinals_A: np.ndarray
    token_ids_A: np.ndarray
    expert_ids_ALK: np.ndarray
    weights_ALK: np.ndarray
    margins_AL: np.ndarray


def stored_labels(path: Path) -> tuple[dict[str, StoredLabels], str]:
    """Labels per window of one shard, and the name of its weight column."""
    names = open_parquet(path).schema_arrow.names
    weight = "weights_u8" if "weights_u8" in names else "weights_f16"
    table = read_parquet(path, ["window_id", "token_ordinal", "token_id", "expert_ids",
                                weight, "margins"]).to_pydict()
    rows: dict[str, list[int]] = {}
    for i, wid in enumerate(table["window_id"]):
        rows.setdefault(wid, []).append(i)
    out = {}
    for wid, idx in rows.items():
        raw_w = np.asarray([table[weight][i] for i in idx])
        out[wid] = StoredLabels(
            window_id=wid,
            anchor_ordinals_A=np.asarray([table["token_ordinal"][i] for i in idx], np.int64),
            token_ids_A=np.asarray([table["token_id"][i] for i in idx], np.int32),
            expert_ids_ALK=np.asarray([table["expert_ids"][i] for i in idx], np.uint16),
            weights_ALK=(dequantize_weights_u8(raw_w) if weight == "weights_u8"
                         else raw_w.astype(np.float32)),
            margins_AL=np.asarray([table["margins"][i] for i in idx], np.float32))
    return out, weight


def _captured_windows(bootstrap: str, topic: str, boundary: EpochBoundary) -> list[dict[str, Any]]:
    ranges = {(topic, p): (boundary.start_of(topic, p), end)
              for p, end in boundary.end.get(topic, {}).items()}
    out = []
    for msg in read_ranges(bootstrap, ranges, error=SealError):
        try:
            key, record = codec.decode_message(msg.value(), msg.headers() or [])
        except SchemaError:
            continue  # quarantined by the worker; never in a shard
        window = readable_window(key.version, record, default_sealer())  # Window.v2: opened
        if not isinstance(window, Erased):  # an erased owner's: quarantined, never in a shard
            out.append(window)
    return out


def sequence_id_reuse(windows: Iterable[Mapping[str, Any]], *, max_examples: int = 10
                      ) -> dict[str, Any]:
    """Opaque runtime sequence ids (``Window.turns[].sequence_id``) seen under more than
    one owner or more than one generation: ``{"sequence_ids", "reused", "examples"}``."""
    seen: dict[str, set[tuple[str, int]]] = {}
    for window in windows:
        owner, generation = str(window.get("owner")), int(window.get("generation") or 0)
        for turn in window.get("turns") or ():
            seen.setdefault(str(turn.get("sequence_id")), set()).add((owner, generation))
    reused = sorted(sid for sid, where in seen.items() if len(where) > 1)
    return {"sequence_ids": len(seen), "reused": len(reused),
            "examples": [f"{sid}: " + ", ".join(f"{o} g{g}" for o, g in sorted(seen[sid]))
                         for sid in reused[:max_examples]]}


def holdout_parity(bootstrap: str, topic: str, root: Path, boundary: EpochBoundary,
                   identity: Mapping[str, Any]) -> dict[str, Any]:
    """The parity gate's result over the epoch's stored runtime_holdout labels (JSON-ready)."""
    from hebrus_flywheel.replay.parity import ParityAccumulator, ParityConfig, skip_reason

    stored: dict[str, StoredLabels] = {}
    weight_column = "weights_u8"
    for _, split, path in iter_shards(root, boundary.epoch):
        if split == HOLDOUT_SPLIT:
            found, weight_column = stored_labels(path)
            stored.update(found)
    acc = ParityAccumulator(
        ParityConfig(weight_atol=_TOLERANCE[weight_column]),
        identity_id=str(identity["identity_id"]), teacher_dtype=str(identity["dtype"]),
        tie_break_rule=str(identity["tie_break_rule"]), weight_rule=str(identity["weight_rule"]),
        kernel_path=str(identity.get("kernel_path") or ""))
    seen: set[str] = set()
    captured = _captured_windows(bootstrap, topic, boundary)
    for window in captured:
        wid = window.get("window_id")
        if wid in seen or wid not in stored:
            continue  # a repeat, or refused by the worker
        seen.add(wid)
        reason = skip_reason(window)
        if reason is not None:
            acc.skip(reason)
            continue
        acc.add(window, stored[wid])  # type: ignore[arg-type]
    result = acc.result().to_dict()
    result["source"] = f"sealed {HOLDOUT_SPLIT} shards of epoch {boundary.epoch} vs Window.routes"
    result["opaque_ids"] = {**sequence_id_reuse(captured),
                            "source": f"Window.turns[].sequence_id of the {len(captured)} "
                                      f"captured {HOLDOUT_SPLIT} windows of epoch "
                                      f"{boundary.epoch}"}
    return result
