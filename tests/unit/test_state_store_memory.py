"""The processor tables' RocksDB memory is bounded per process: every database a worker
opens (one per table partition) shares one block cache, and their memtables are charged
to it through one write buffer manager."""

from __future__ import annotations

from pathlib import Path

from hebrus_flywheel.streams.processors import state_store
from hebrus_flywheel.streams.processors.state_store import (
    PROCESS_ROCKSDB_BYTES,
    ROCKSDB_OPTIONS,
    ProcessBoundedOptions,
)


def _options() -> ProcessBoundedOptions:
    settings = {k: v for k, v in ROCKSDB_OPTIONS.items() if k != "driver"}
    return ProcessBoundedOptions(**settings, use_rocksdict=True)


def test_every_database_charges_one_process_cache(tmp_path: Path) -> None:
    cache, manager = state_store._process_memory()
    assert state_store._process_memory() == (cache, manager)  # one per process
    assert manager.get_buffer_size() == PROCESS_ROCKSDB_BYTES // 2
    dbs = [_options().open(tmp_path / f"partition-{i}") for i in range(24)]
    try:
        before = cache.get_usage()
        for n, db in enumerate(dbs):
            for i in range(2000):
                db[f"k{n}-{i}".encode()] = bytes(200)
        # 24 databases x 2000 x 200 bytes of memtables: charged to the one cache, which
        # stays within its capacity (per-database caches would each be counted apart)
        assert manager.get_usage() > 0 and cache.get_usage() > before
        assert cache.get_usage() <= PROCESS_ROCKSDB_BYTES * 1.1
        assert all(db[b"k3-1999"] == bytes(200) for db in dbs[3:4])
    finally:
        for db in dbs:
            db.close()


def test_memory_gauges_see_the_rocksdb_cache_and_the_c_heap(tmp_path: Path) -> None:
    """The gauges the worker logs (and bench/soak.py prints with its RSS samples) read
    the process cache, the memtables and the C heap, so a soak can tell them apart."""
    from hebrus_flywheel.core.processes import malloc_gauges

    db = _options().open(tmp_path / "gauged")
    try:
        for i in range(2000):
            db[f"k{i}".encode()] = bytes(200)
        gauges = state_store.memory_gauges()
        assert gauges["rocksdb_memtable_bytes"] > 0
        assert gauges["rocksdb_cache_bytes"] >= gauges["rocksdb_memtable_bytes"]
        assert gauges["python_allocated_blocks"] > 0
    finally:
        db.close()
    before = malloc_gauges()["malloc_in_use_bytes"]
    block = bytearray(64 * 1024 * 1024)  # a C-heap allocation (mmapped at this size)
    assert malloc_gauges()["malloc_in_use_bytes"] - before >= len(block)
    del block
