"""Collection-time projection from this machine's measured replay throughput.

The design note's table ("How long will collection take?") from a measurement, not an
illustration: ``collection_seconds = replay_tokens / sustained_teacher_prefill_tokens/s``
for 100k, 1M and 10M tokens. The throughput is the snapshot manifest's
``replay_throughput`` (:mod:`consumers.throughput`: the frozen teacher's prefill tokens
and wall seconds while the replay worker produced this snapshot). Two clean-path
columns: per *replay* token (the design's formula) and per *labelled* token (one row,
one anchor: causal windows overlap, so a labelled token costs more than one replay
token). Candidate-path replay (DFlash 2 speculative prefixes) has no snapshot yet: its
column says "not measured". Serialization, checkpoint loading and failed shards are
not included (the note says to add them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hebrus_flywheel.core.errors import ConfigError

PROJECTION_TOKENS: tuple[int, ...] = (100_000, 1_000_000, 10_000_000)
"""The design note's milestones: schema/parity/overfit, first held-out curves, coverage."""
NOT_MEASURED = "not measured"
CANDIDATE_NOTE = (
    "no candidate-path snapshot given (`flywheel replay candidates` makes one; "
    "`flywheel qualify --candidate-snapshot` projects it)")


@dataclass(frozen=True, kw_only=True)
class ReplayThroughput:
    """A measured replay speed (the manifest's ``replay_throughput``).

    Fields:
        path: ``clean`` (accepted threads) or ``candidate`` (speculative prefixes).
        tokens: window tokens the teacher replayed in prefill.
        rows: labelled tokens (anchors) those windows produced.
        seconds: wall seconds of the teacher's prefill calls.
        tokens_per_s: ``tokens / seconds``.
        rows_per_s: ``rows / seconds``.
        shards_measured: shards with a record, of ``shards``.
        shards: shards in the snapshot.
        machines: architecture and CPU count of the replaying machine(s).
        measured: what was timed.
    """

    path: str = "clean"
    tokens: int
    rows: int
    seconds: float
    tokens_per_s: float
    rows_per_s: float
    shards_measured: int
    shards: int
    machines: tuple[str, ...] = ()
    measured: str = ""

    def __post_init__(self) -> None:
        if self.path not in ("clean", "candidate"):
            raise ConfigError("ReplayThroughput.path must be clean or candidate, got "
                              f"{self.path!r}")
        for name in ("tokens_per_s", "rows_per_s", "seconds"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"ReplayThroughput.{name} must be a positive number, "
                                  f"got {value!r}")
        object.__setattr__(self, "machines", tuple(self.machines))

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], path: str = "clean"
                      ) -> ReplayThroughput | None:
        """The manifest's measurement; None when it has none (sealed before it existed,
        or no record had a positive time)."""
        node = manifest.get("replay_throughput")
        if not isinstance(node, Mapping) or not node.get("tokens_per_s") \
                or not node.get("rows_per_s"):
            return None
        return cls(path=path, tokens=int(node["tokens"]), rows=int(node["rows"]),
                   seconds=float(node["seconds"]), tokens_per_s=float(node["tokens_per_s"]),
                   rows_per_s=float(node["rows_per_s"]),
                   shards_measured=int(node["shards_measured"]), shards=int(node["shards"]),
                   machines=tuple(str(m) for m in node.get("machines") or ()),
                   measured=str(node.get("measured") or ""))


def _hours(tokens: int, per_s: float | None) -> float | None:
    return None if not per_s else round(tokens / per_s / 3600.0, 3)


def projection(clean: ReplayThroughput | None,
               candidate: ReplayThroughput | None = None) -> dict[str, Any]:
    """The table: one row per :data:`PROJECTION_TOKENS`, hours per column (None when
    not measured), plus the rates it was computed from."""
    rows = []
    for tokens in PROJECTION_TOKENS:
        rows.append({
            "tokens": tokens,
            "clean_replay_hours": _hours(tokens, None if clean is None else clean.tokens_per_s),
            "clean_labelled_hours": _hours(tokens, None if clean is None else clean.rows_per_s),
            "candidate_replay_hours": _hours(
                tokens, None if candidate is None else candidate.tokens_per_s),
        })
    return {
        "formula": "collection_seconds = replay_tokens / sustained_teacher_prefill_tokens_per_s",
        "clean": None if clean is None else {
            "tokens_per_s": clean.tokens_per_s, "labelled_tokens_per_s": clean.rows_per_s,
            "replay_tokens_per_labelled_token": round(clean.tokens / clean.rows, 3)
            if clean.rows else None,
            "measured_tokens": clean.tokens, "measured_seconds": clean.seconds,
            "shards_measured": clean.shards_measured, "shards": clean.shards,
            "machines": list(clean.machines)},
        "candidate": None if candidate is None else {"tokens_per_s": candidate.tokens_per_s},
        "candidate_note": CANDIDATE_NOTE if candidate is None else "",
        "rows": rows,
        "excludes": "serialization, checkpoint loading, candidate-path generation and "
                    "failed shards (add them)",
    }


def _cell(hours: float | None) -> str:
    return NOT_MEASURED if hours is None else f"{hours:,.3g} h"


def projection_lines(table: Mapping[str, Any]) -> list[str]:
    """The table as aligned text lines (the CLI, the demo)."""
    clean = table.get("clean")
    rate = (f"clean path measured at {clean['tokens_per_s']:,.1f} replay tokens/s = "
            f"{clean['labelled_tokens_per_s']:,.1f} labelled tokens/s "
            f"({clean['measured_tokens']:,} tokens in {clean['measured_seconds']:.1f} s of "
            f"teacher prefill, {clean['shards_measured']}/{clean['shards']} shards, "
            f"{', '.join(clean['machines'])})" if clean else
            "clean path not measured (the snapshot's manifest has no replay_throughput)")
    head = f"{'tokens':>12} | {'clean (replay)':>16} | {'clean (labelled)':>16} | candidate"
    out = [rate, head, "-" * len(head)]
    for row in table["rows"]:
        out.append(f"{row['tokens']:>12,} | {_cell(row['clean_replay_hours']):>16} | "
                   f"{_cell(row['clean_labelled_hours']):>16} | "
                   f"{_cell(row['candidate_replay_hours'])}")
    if table.get("candidate_note"):
        out.append(f"candidate path: {table['candidate_note']}")
    return out


def projection_figures(table: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One ``{"figure": ..., "value": ...}`` line per measured cell and rate."""
    out: list[dict[str, Any]] = []
    clean = table.get("clean")
    if clean:
        out.append({"figure": "replay_tokens_per_s", "path": "clean",
                    "value": clean["tokens_per_s"]})
        out.append({"figure": "labelled_tokens_per_s", "path": "clean",
                    "value": clean["labelled_tokens_per_s"]})
    for row in table["rows"]:
        for key, path, per in (("clean_replay_hours", "clean", "replay"),
                               ("clean_labelled_hours", "clean", "labelled"),
                               ("candidate_replay_hours", "candidate", "replay")):
            out.append({"figure": "collection_hours", "tokens": row["tokens"], "path": path,
                        "per": per, "value": row[key]})
    return out
