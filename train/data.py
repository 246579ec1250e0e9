"""Stream a sealed snapshot as flat per-(token, layer) batches for the sidecar.

Opening reads ``manifest.json`` only: its digest must equal its snapshot id (and the
expected id, when one is given), so a snapshot of 10,000 shards opens without touching
a shard. Each shard is verified (regular file, byte count, SHA-256, row count, row
groups, geometry in its footer) by the process that first reads it, before any of its
rows is used; ``verify="full"`` runs :func:`core.snapshot.verify_snapshot` at open
instead (also refuses extra files). Any mismatch raises SnapshotError. The checks are
the snapshot contract's (:mod:`hebrus_flywheel.core.snapshot`).

Work division. A *unit* is one (shard, row group) of the selected splits, in manifest
order (row groups per shard follow from its row count and the recorded
``row_group_rows``). Each epoch, units are permuted by ``(seed, epoch)`` (when
shuffling) and dealt round-robin to the ``world_size * num_workers`` slots
``rank * num_workers + worker``: every unit goes to exactly one (rank, DataLoader
worker). A slot reads its units one row group at a time and mixes up to
``shuffle_buffer`` (token, layer) rows with a generator seeded by
``(seed, epoch, rank, worker)`` before cutting batches, so the stream is a pure function
of the seed, the epoch and the slot. With ``shuffle=False`` rows keep manifest order,
which keeps each thread's tokens in ordinal order (history baselines rely on it).

A batch (dict) holds ``B`` (token, layer) rows, O layer offsets:

* ``feature_BD`` (stored dtype, float16 by default), ``layer_B`` int64;
* ``target_ids_BK`` int64 (rank 0 first), ``target_weights_BK`` float32;
* ``offset_target_ids_BOK`` / ``offset_target_weights_BOK`` / ``offset_valid_BO``: the
  same token's routes at layers ``l + dl`` for ``dl`` in ``layer_offsets`` (P1 uses
  ``(0, 1)``); ``valid`` is False past the last layer;
* ``ordinal_B`` int64, ``split_code_B`` int8 (index into ``train.metrics.SPLITS``) and,
  unless ``lineage=False``, the lists ``split``, ``domain`` (``+``-joined domain tags)
  and ``thread`` (``owner/thread#generation``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.snapshot import (
    U8_LEVELS,
    SnapshotContractError,
    manifest_path,
    open_snapshot,
)
from hebrus_flywheel.train.consent import sealed_refusals, sealed_summary
from hebrus_flywheel.train.exceptions import SnapshotError
from hebrus_flywheel.train.metrics import NO_DOMAIN, SPLITS

_GEOMETRY_CHECKED = ("layers", "top_k", "feature_dim", "weight_encoding", "feature_dtype",
                     "identity_id")
_LINEAGE_COLUMNS = ("split", "owner", "thread", "generation", "domain_tags", "token_ordinal")


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One (shard, row group) of a split: the smallest piece of work dealt out."""

    shard: int
    """Index of the shard in the manifest's ``shards`` list."""
    row_group: int | None
    """Row group inside the shard; None reads every row group (no recorded row-group size)."""


class Snapshot:
    """A sealed epoch opened from its manifest alone (see the module doc)."""

    def __init__(self, path: Path, *, expected_id: str | None = None,
                 verify: Literal["lazy", "full"] = "lazy") -> None:
        if verify not in ("lazy", "full"):
            raise ConfigError(f"verify must be 'lazy' or 'full', got {verify!r}")
        try:
            self._sealed = open_snapshot(Path(path), expected_id=expected_id, verify=verify)
        except SnapshotContractError as exc:
            raise SnapshotError(f"refusing snapshot {manifest_path(Path(path)).parent}: "
                                f"{exc}") from exc
        self.directory = self._sealed.directory
        self.manifest = self._sealed.manifest
        if self.manifest.layout is None or not self.manifest.shards:
            raise SnapshotError(f"snapshot {self.snapshot_id} holds no shards; nothing to read")
        self.layout = self.manifest.layout
        self.geometry = dict(self.manifest["geometry"])
        self.expert_count = self.layout.route.expert_count
        self.row_group_rows = self.manifest.row_group_rows
        # fail closed: rows the seal refused for lack of consent are never read
        self.excluded: dict[str, frozenset[str]] = sealed_refusals(self.manifest)
        self.consent: dict[str, Any] = sealed_summary(self.manifest)

    @property
    def snapshot_id(self) -> str:
        return self.manifest.snapshot_id

    @property
    def feature_contract(self) -> dict[str, Any] | None:
        """The replay's feature contract (projection seed, H, D, digest), if recorded."""
        return self.manifest.feature_contract

    def split_rows(self, split: str) -> int:
        """Tokens (rows) of ``split``; 0 when the snapshot has none."""
        return int((self.manifest.get("splits") or {}).get(split, {}).get("rows", 0))

    def units(self, splits: Sequence[str]) -> list[Unit]:
        """The units of ``splits`` in manifest order."""
        unknown = set(splits) - set(SPLITS)
        if unknown:
            raise ConfigError(f"unknown split(s) {sorted(unknown)}; use {', '.join(SPLITS)}")
        return [Unit(shard=index, row_group=g)
                for index, entry in enumerate(self.manifest.shards) if entry.split in splits
                for g in self._sealed.row_groups(index)]

    def lineage(self) -> dict[str, Any]:
        """What a checkpoint records about the data it was trained on."""
        return {"snapshot_id": self.snapshot_id, "path": str(self.directory),
                "epoch": self.manifest.get("epoch"),
                "identity_id": self.manifest.identity.get("identity_id"),
                "geometry": {**self.geometry, "expert_count": self.expert_count},
                "feature_contract": self.feature_contract,
                "splits": self.manifest.get("splits"), "consent": dict(self.consent)}

    def exclude(self, owners: Mapping[str, frozenset[str]]) -> None:
        """Skip the rows of ``owners`` per split in every later :meth:`read`."""
        self.excluded = {**self.excluded, **{s: frozenset(o) for s, o in owners.items()}}

    def read(self, unit: Unit, columns: Sequence[str], *, filtered: bool = True) -> pa.Table:
        """Rows of one unit (verifying its shard first, once per process), without the
        rows of excluded owners (:mod:`train.consent`) unless ``filtered`` is False."""
        excluded = self.excluded.get(self.manifest.shards[unit.shard].split) if filtered else None
        wanted = list(columns) if not excluded or "owner" in columns else [*columns, "owner"]
        try:
            table = self._sealed.read_shard(unit.shard, wanted, unit.row_group)
        except SnapshotContractError as exc:
            raise SnapshotError(str(exc)) from exc
        if excluded:
            keep = pc.invert(pc.is_in(table.column("owner"), value_set=pa.array(sorted(excluded))))
            table = table.filter(keep).select(list(columns))
        return table


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """How :class:`SnapshotDataset` streams one selection of splits."""

    splits: tuple[str, ...] = ("train",)
    """Splits to read, by name (``train``, ``validation``, ...)."""
    batch_size: int = 4096
    """(token, layer) rows per batch."""
    shuffle: bool = True
    """Permute units and rows (by seed and epoch); False keeps manifest order."""
    shuffle_buffer: int = 65536
    """(token, layer) rows mixed together before batches are cut (when shuffling)."""
    seed: int = 0
    """Seed of the permutations."""
    epoch: int = 0
    """First epoch (part of every permutation's seed)."""
    epochs: int | None = 1
    """Passes over the data; None streams forever (epoch, epoch+1, ...)."""
    layer_offsets: tuple[int, ...] = (0,)
    """``dl`` of the same-token targets in ``offset_*`` (P1: ``(0, 1)``)."""
    drop_last: bool = False
    """Drop each slot's last, partial batch of an epoch."""
    lineage: bool = True
    """Carry the string lists ``split``, ``domain`` and ``thread`` (evaluation needs
    them); without, batches are lighter and hold the split as ``split_code_B`` only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "splits", tuple(self.splits))
        object.__setattr__(self, "layer_offsets", tuple(int(o) for o in self.layer_offsets))
        if not self.splits or set(self.splits) - set(SPLITS):
            raise ConfigError(f"StreamConfig.splits {self.splits!r} must name splits among "
                              f"{', '.join(SPLITS)}")
        for name in ("batch_size", "shuffle_buffer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"StreamConfig.{name} must be a positive integer, got {value!r}")
        if self.seed < 0 or self.epoch < 0 or (self.epochs is not None and self.epochs < 1):
            raise ConfigError("StreamConfig.seed and .epoch must be >= 0 and .epochs >= 1 or None")
        if not self.layer_offsets or min(self.layer_offsets) < 0:
            raise ConfigError("StreamConfig.layer_offsets must be non-empty and >= 0")


class SnapshotDataset(IterableDataset):
    """Batches of one snapshot's splits; see the module doc. Iterate through
    :func:`make_loader` (``batch_size=None``: the dataset batches itself)."""

    def __init__(self, snapshot: Snapshot, config: StreamConfig, *, rank: int | None = None,
                 world_size: int | None = None) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.config = config
        self.units = snapshot.units(config.splits)
        self._rank, self._world = rank, world_size
        weights = snapshot.layout.weight_column
        lineage = _LINEAGE_COLUMNS if config.lineage else ("split", "token_ordinal")
        self._columns = (*lineage, "features", "expert_ids", weights)

    def rank_world(self) -> tuple[int, int]:
        """This process's (rank, world size): explicit, else torch.distributed, else (0, 1)."""
        if self._rank is not None and self._world is not None:
            return self._rank, self._world
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def assigned(self, epoch: int, slot: int, slots: int) -> list[Unit]:
        """The units slot ``slot`` of ``slots`` reads in ``epoch``, in reading order."""
        order = np.arange(len(self.units))
        if self.config.shuffle:
            order = _rng(self.config.seed, epoch).permutation(len(self.units))
        return [self.units[i] for i in order[slot::slots]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rank, world = self.rank_world()
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        slot, slots = rank * workers + worker, world * workers
        c = self.config
        epoch = c.epoch
        while c.epochs is None or epoch < c.epoch + c.epochs:
            units = self.assigned(epoch, slot, slots)
            if not units:
                return
            yield from self._epoch(units, _rng(c.seed, epoch, rank, worker))
            epoch += 1

    def _epoch(self, units: list[Unit], rng: np.random.Generator) -> Iterator[dict[str, Any]]:
        c, pool = self.config, _Pool()
        limit = c.shuffle_buffer if c.shuffle else c.batch_size
        own = c.layer_offsets.index(0) if 0 in c.layer_offsets else None
        shuffle = rng if c.shuffle else None
        for unit in units:
            pool.add(self._pairs(self.snapshot.read(unit, self._columns)))
            if pool.size >= max(limit, c.batch_size):
                yield from pool.drain(shuffle, c.batch_size, keep_tail=True, own=own)
        if pool.size:
            yield from pool.drain(shuffle, c.batch_size, keep_tail=False, own=own,
                                  drop_last=c.drop_last)

    def _pairs(self, table: pa.Table) -> dict[str, np.ndarray]:
        """Flat (token, layer) arrays of one row group."""
        g = self.snapshot.geometry
        n, L, K, D = table.num_rows, g["layers"], g["top_k"], g["feature_dim"]
        ids_nLK = _fixed(table, "expert_ids", (n, L, K)).astype(np.int64)
        if g["weight_encoding"] == "uint8":
            weights_nLK = _fixed(table, "weights_u8", (n, L, K)).astype(np.float32) / U8_LEVELS
        else:
            weights_nLK = _fixed(table, "weights_f16", (n, L, K)).astype(np.float32)
        layer_L = np.arange(L)
        target_LO = np.minimum(layer_L[:, None] + np.array(self.config.layer_offsets), L - 1)
        valid_LO = layer_L[:, None] + np.array(self.config.layer_offsets) < L
        meta = _token_meta(table, self.config.lineage)
        own = {} if 0 in self.config.layer_offsets else {  # else views of the offset arrays
            "target_ids_BK": ids_nLK.reshape(n * L, K),
            "target_weights_BK": weights_nLK.reshape(n * L, K)}
        return {
            "feature_BD": _fixed(table, "features", (n, L, D)).reshape(n * L, D),
            "layer_B": np.tile(layer_L, n), **own,
            "offset_target_ids_BOK": ids_nLK[:, target_LO].reshape(n * L, -1, K),
            "offset_target_weights_BOK": weights_nLK[:, target_LO].reshape(n * L, -1, K),
            "offset_valid_BO": np.broadcast_to(valid_LO, (n, *valid_LO.shape)).reshape(n * L, -1),
            **{name: np.repeat(values, L) for name, values in meta.items()},
        }


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([0x5EED, *key])))


def _fixed(table: pa.Table, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A nested fixed-size-list column as one numpy array of ``shape``."""
    values: Any = table.column(name).combine_chunks()
    while pa.types.is_fixed_size_list(values.type):
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False).reshape(shape)


def _token_meta(table: pa.Table, lineage: bool) -> dict[str, np.ndarray]:
    splits = table.column("split").to_pylist()
    unknown = set(splits) - set(SPLITS)
    if unknown:
        raise SnapshotError(f"rows name unknown split(s) {sorted(unknown)}; the snapshot was "
                            "written by another version of the pipeline")
    meta = {"ordinal_B": table.column("token_ordinal").to_numpy(),
            "split_code_B": np.array([SPLITS.index(s) for s in splits], dtype=np.int8)}
    if not lineage:
        return meta
    owners, threads = table.column("owner").to_pylist(), table.column("thread").to_pylist()
    generations = table.column("generation").to_pylist()
    tags = table.column("domain_tags").to_pylist()
    return {
        **meta, "split": np.array(splits, dtype=object),
        "domain": np.array(["+".join(t) if t else NO_DOMAIN for t in tags], dtype=object),
        "thread": np.array([f"{o}/{t}#{g}" for o, t, g in zip(owners, threads, generations,
                                                               strict=True)], dtype=object),
    }


def batch_splits(batch: dict[str, Any]) -> np.ndarray:
    """The split name of every row of a batch (from ``split``, else ``split_code_B``)."""
    if "split" in batch:
        return np.asarray(batch["split"], dtype=object)
    return _SPLIT_NAMES[batch["split_code_B"].numpy()]


_SPLIT_NAMES = np.array(SPLITS, dtype=object)


class _Pool:
    """(token, layer) rows waiting to be batched."""

    def __init__(self) -> None:
        self.parts: list[dict[str, np.ndarray]] = []
        self.size = 0

    def add(self, part: dict[str, np.ndarray]) -> None:
        self.parts.append(part)
        self.size += len(part["layer_B"])

    def drain(self, rng: np.random.Generator | None, batch: int, *, keep_tail: bool,
              own: int | None, drop_last: bool = False) -> Iterator[dict[str, Any]]:
        rows = {k: np.concatenate([p[k] for p in self.parts]) for k in self.parts[0]}
        order = rng.permutation(self.size) if rng is not None else np.arange(self.size)
        full = self.size // batch * batch
        self.parts, self.size = [], 0
        if keep_tail and full < len(order):
            self.add({k: v[order[full:]] for k, v in rows.items()})
        stop = full if keep_tail or drop_last else len(order)
        for start in range(0, stop, batch):
            yield _batch(rows, order[start:start + batch], own)


def _batch(rows: dict[str, np.ndarray], index: np.ndarray, own: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, values in rows.items():
        picked = values[index]
        out[key] = picked.tolist() if picked.dtype == object else torch.from_numpy(
            np.ascontiguousarray(picked))
    if own is not None:  # views: DataLoader workers ship the shared storage once
        out["target_ids_BK"] = out["offset_target_ids_BOK"][:, own]
        out["target_weights_BK"] = out["offset_target_weights_BOK"][:, own]
    return out


def make_loader(dataset: SnapshotDataset, *, num_workers: int = 0,
                pin_memory: bool = False) -> DataLoader:
    """A DataLoader over the dataset's own batches (its workers split the units)."""
    if num_workers < 0:
        raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
    return DataLoader(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                      collate_fn=_as_is, prefetch_factor=4 if num_workers else None)


def _as_is(batch: Any) -> Any:
    """The dataset's batches are final (the default would walk every string in them)."""
    return batch
