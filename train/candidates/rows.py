"""Candidate-path rows as numpy arrays, one per (candidate row, routed layer).

Input: a pyarrow Table (or the union of a ``candidate_path`` snapshot's shards) in the
column contract of the candidate-path product: one row per (proposal, path, candidate
position) with ``proposal_id``, ``path_id``, ``candidate_position`` (1..B, the
Δposition from the anchor), ``candidate_token_id``, ``drafter_logprob``,
``expert_ids``/``features`` ``[layers][...]``, ``accepted_prefix_length``, ``accepted``
and the clean-path lineage columns (``split``, ``thread``, ``domain_tags``, ...).

What Model B may read at prediction time (P2 hints are issued when the drafter has
proposed a block, before the teacher verifies it): the row's ``features`` (the contract
requires these to be the sidecar feature *available at proposal time* for that
candidate position: the drafter's candidate-position feature, or the anchor's committed
teacher feature repeated; never the teacher's own features on the unverified candidate),
the candidate position, the candidate token id and the drafter's log-probability.
The native top-k and the acceptance are labels only.

Legend: n candidate rows, N = n x L flattened rows, L layers, D feature width, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hebrus_flywheel.train.exceptions import SnapshotError
from hebrus_flywheel.train.metrics import SPLITS

REQUIRED = ("split", "proposal_id", "path_id", "candidate_position", "candidate_token_id",
            "drafter_logprob", "expert_ids", "features", "accepted_prefix_length", "accepted")


@dataclass(eq=False)
class CandidateRows:
    """Every (candidate row, layer) of one split, in table order, layer fastest."""

    split: str
    feature_ND: np.ndarray
    layer_N: np.ndarray
    position_N: np.ndarray
    token_N: np.ndarray
    logprob_N: np.ndarray
    accepted_N: np.ndarray
    target_NK: np.ndarray
    path_N: np.ndarray
    """``proposal_id/path_id``: the union-growth and history key."""
    domain_N: np.ndarray
    accepted_length_N: np.ndarray

    def __len__(self) -> int:
        return int(self.layer_N.shape[0])

    @property
    def block(self) -> int:
        """B: the largest candidate position present."""
        return int(self.position_N.max())

    def take(self, index_N: np.ndarray) -> CandidateRows:
        arrays = {f.name: getattr(self, f.name)[index_N] for f in fields(self)
                  if f.name != "split"}
        return CandidateRows(split=self.split, **arrays)


def nested(table: pa.Table, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A nested list column (fixed-size or not) as one numpy array of ``shape``."""
    values: Any = table.column(name).combine_chunks()
    while pa.types.is_fixed_size_list(values.type) or pa.types.is_list(values.type):
        values = values.flatten()
    array = values.to_numpy(zero_copy_only=False)
    if array.size != int(np.prod(shape)):
        raise SnapshotError(f"column {name} holds {array.size} values, expected shape {shape}; "
                            "rows must all have the same layers and widths")
    return array.reshape(shape)


def geometry(table: pa.Table) -> tuple[int, int, int]:
    """``(L, K, D)`` of a candidate table, read from its first row."""
    if table.num_rows == 0:
        raise SnapshotError("the candidate table has no rows")
    first = table.slice(0, 1)
    ids, feats = first.column("expert_ids").to_pylist()[0], first.column("features").to_pylist()[0]
    return len(ids), len(ids[0]), len(feats[0])


def check_table(table: pa.Table) -> None:
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise SnapshotError(f"not a candidate-path table: it lacks {missing}; pass the "
                            "candidate_path product's rows")


def load_candidate_rows(table: pa.Table, split: str) -> CandidateRows:
    """The rows of ``split`` (SnapshotError when there are none)."""
    check_table(table)
    if split not in SPLITS:
        raise SnapshotError(f"unknown split {split!r}")
    mask = pc.equal(table.column("split"), split)
    part = table.filter(mask)
    if part.num_rows == 0:
        raise SnapshotError(f"the candidate table has no {split!r} rows")
    L, K, D = geometry(part)
    n = part.num_rows

    def per_row(name: str, dtype: Any) -> np.ndarray:
        return np.repeat(part.column(name).to_numpy(zero_copy_only=False).astype(dtype), L)

    paths = [f"{p}/{q}" for p, q in zip(part.column("proposal_id").to_pylist(),
                                        part.column("path_id").to_pylist(), strict=True)]
    domains = ["|".join(sorted(t)) if t else "unspecified" for t in (
        part.column("domain_tags").to_pylist() if "domain_tags" in part.column_names
        else [None] * n)]
    return CandidateRows(
        split=split,
        feature_ND=nested(part, "features", (n, L, D)).astype(np.float32).reshape(n * L, D),
        layer_N=np.tile(np.arange(L, dtype=np.int64), n),
        position_N=per_row("candidate_position", np.int64),
        token_N=per_row("candidate_token_id", np.int64),
        logprob_N=per_row("drafter_logprob", np.float32),
        accepted_N=per_row("accepted", bool),
        target_NK=nested(part, "expert_ids", (n, L, K)).astype(np.int64).reshape(n * L, K),
        path_N=np.repeat(np.asarray(paths, dtype=object), L),
        domain_N=np.repeat(np.asarray(domains, dtype=object), L),
        accepted_length_N=per_row("accepted_prefix_length", np.int64))


def acceptance_by_position(rows: CandidateRows) -> dict[int, float]:
    """Measured acceptance rate at every candidate position 1..B (one vote per
    candidate row, not per layer)."""
    out = {}
    for p in range(1, rows.block + 1):
        at = rows.position_N == p
        if at.any():
            out[p] = float(rows.accepted_N[at].mean())
    return out


def read_candidate_table(path: Any) -> pa.Table:
    """Every row of a sealed ``candidate_path`` snapshot (its shards, checked against the
    manifest); SnapshotError when the manifest names another product."""
    from pathlib import Path

    from hebrus_flywheel.core.snapshot.read import open_snapshot
    from hebrus_flywheel.core.snapshot.shard import PRODUCTS

    # opened as either product, so a clean snapshot gets this reader's own message
    sealed = open_snapshot(Path(path), products=PRODUCTS)
    product = sealed.manifest.get("product")
    if product != "candidate_path":
        raise SnapshotError(f"snapshot {sealed.snapshot_id} is a {product or 'clean_path'} "
                            "snapshot; Model B and the governor read candidate_path snapshots")
    tables = [sealed.read_shard(i, None) for i in range(len(sealed.manifest.shards))]
    if not tables:
        raise SnapshotError(f"candidate snapshot {sealed.snapshot_id} has no shards")
    table = pa.concat_tables(tables)
    check_table(table)
    return table
