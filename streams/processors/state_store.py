"""The processor tables' store: faust's RocksDB store (rocksdict driver), sealed at rest.

faust's ``rocksdb://`` store keeps a table on disk, one RocksDB per partition, with
the last changelog offset it holds, so a restarted worker reads only the changelog
records written after that offset instead of the whole topic. As it comes, it writes a
value as the table's value serializer encodes it: an owner's token ids would lie in
plaintext in the RocksDB files. This store writes every value of an owner exactly as
the changelog holds it: sealed under the owner's data key
(:class:`~streams.processors.state_seal.StateSealer`, AES-GCM bound to the table and
key), and opens it on every read. So:

* ``flywheel erase`` (the owner's key destroyed) leaves the RocksDB files unreadable
  for that owner, like the changelog; a value that opens as erased reads as absent;
* a restored changelog record is stored as it was read (it is sealed already); before
  that its seal is checked once (decrypted, not decoded: ``StateSealer.check``), so a
  record that does not open stops the worker (fail closed, as with the memory store)
  and one of an erased owner is deleted instead;
* a value written for an owner whose key is destroyed is deleted, never stored.

Keys (pseudonymous ids, ordinals) and values of no owner (counters, expiry buckets)
are stored as they are. ``restored_records`` (and the worker counter
``state.<table>_restored_records``) counts the changelog records this store applied
since it was opened: a restart on the same data directory reads only the records
written after what the RocksDB files hold, not the whole changelog.

RocksDB writes here skip its write-ahead log (:data:`WRITE_AHEAD_LOG`), as Kafka
Streams' stores do: the changelog is the table's log. Every put and every restored batch
was a second copy and a ``write`` call into the log file; a worker draining a backlog
took 12 % less CPU without it, and a restore applies records 1.7 times as fast
(``bench/changelog_restore.py``). The memtables are flushed when faust lets a
database go (a stop, a revocation).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from faust.exceptions import KeyDecodeError, ValueDecodeError
from faust.stores import STORES
from faust.stores.rocksdb import RocksDBOptions
from faust.stores.rocksdb import Store as RocksDBStore
from faust.streams import current_event

from hebrus_flywheel.core.processes import malloc_gauges
from hebrus_flywheel.streams.owner_seal import Erased, SealOpenError
from hebrus_flywheel.streams.processors.crash import crash
from hebrus_flywheel.streams.processors.state_codec import (
    SealedState,
    StateDecodeError,
    refuse_changelog_record,
)
from hebrus_flywheel.streams.processors.state_seal import StateSealer

log = logging.getLogger(__name__)
SCHEME = "sealed-rocksdb"
STORE_URL = f"{SCHEME}://"
"""The store URL of the processor tables (registered with faust on import)."""
STORES.aliases[SCHEME] = f"{__name__}:SealedRocksDBStore"
MIB = 1024 * 1024
ROCKSDB_OPTIONS = {
    "driver": "rocksdict",
    "write_buffer_size": 8 * MIB,
    "max_write_buffer_number": 2,
    "target_file_size_base": 16 * MIB,
}
"""Table ``options`` for this store: the rocksdict driver (RocksDB 8). faust's defaults
give every partition's database 3 memtables of 64 MiB and its own 2 GiB block cache,
so a worker's resident set grew by gigabytes with its partitions; the memory is bounded
for the whole process instead (:data:`PROCESS_ROCKSDB_BYTES`)."""
PROCESS_ROCKSDB_BYTES = 64 * MIB
"""RocksDB memory of one worker process, whatever its tables and partitions: one block
cache of this size shared by every database, with the memtables (at most half of it,
through one write buffer manager) and the index and filter blocks charged to it.
``bench/soak.py`` grew 321.7 MiB per million observations with faust's defaults and
91.0 with per-database bounds (2 x 8 MiB memtables and an 8 MiB cache for each of the
worker's dozens of databases)."""
WRITE_AHEAD_LOG = False
"""Whether the tables' RocksDB writes go through its write-ahead log. They do not, as in
Kafka Streams' RocksDB stores: the changelog is the table's log. A database holds its
writes in order, faust's changelog offset among them (written once the changelog record
is acknowledged), and what a crash leaves of a database without its log is a prefix of
those writes (the memtables flushed before it), never a write without the ones before
it. A restart restores the changelog from that offset on, as it does after any crash:
it reads more of the changelog, never less. A clean stop flushes the memtables (RocksDB
does on close when writes are not in a log)."""
_shared: tuple[Any, Any] | None = None


def _process_memory() -> tuple[Any, Any]:
    """The process's one block cache and write buffer manager (created on first use)."""
    global _shared
    if _shared is None:
        import rocksdict

        cache = rocksdict.Cache(PROCESS_ROCKSDB_BYTES)
        manager = rocksdict.WriteBufferManager.new_write_buffer_manager_with_cache(
            PROCESS_ROCKSDB_BYTES // 2, False, cache)
        _shared = (cache, manager)
    return _shared


def memory_gauges() -> dict[str, int]:
    """Where the worker's memory is, in bytes: RocksDB's shared block cache (memtables
    charged to it included) and pinned part, the memtables alone, the Python heap's
    allocated blocks (a count) and the C heap in use and free
    (:func:`core.processes.malloc_gauges`: RocksDB's and large Python objects'
    allocations). Logged with the counters; ``bench/soak.py`` prints them with each RSS
    sample, so growth can be told apart (a cache filling to its bound, the Python heap,
    or free memory the allocator keeps: fragmentation)."""
    gauges = {"python_allocated_blocks": sys.getallocatedblocks(), **malloc_gauges()}
    if _shared is not None:
        cache, manager = _shared
        gauges.update(rocksdb_cache_bytes=int(cache.get_usage()),
                      rocksdb_pinned_bytes=int(cache.get_pinned_usage()),
                      rocksdb_memtable_bytes=int(manager.get_usage()))
    return gauges


class ProcessBoundedOptions(RocksDBOptions):
    """faust's rocksdict options with the process-wide cache and write buffer manager."""

    def as_options(self) -> Any:
        import rocksdict

        options = super().as_options()
        cache, manager = _process_memory()
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(self.bloom_filter_size, block_based=True)
        table.set_block_cache(cache)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        table.set_index_type(rocksdict.BlockBasedIndexType.binary_search())
        options.set_block_based_table_factory(table)
        options.set_write_buffer_manager(manager)
        return options

    def open(self, path: Any, *, read_only: bool = False) -> Any:
        """faust's database, writing without RocksDB's write-ahead log (see
        :data:`WRITE_AHEAD_LOG`)."""
        db = super().open(path, read_only=read_only)
        if self.use_rocksdict and not WRITE_AHEAD_LOG:
            import rocksdict

            options = rocksdict.WriteOptions()
            options.disable_wal = True  # type: ignore[method-assign,assignment]  # a property (the stubs say method)
            db.set_write_options(options)
        return db


CACHED_KINDS = ("h", "c")
"""Key kinds whose last values are also kept opened in memory (thread headers and
producer counters: small, read back by every record of their thread or producer)."""
CACHE_ENTRIES = 4096
"""Most values kept opened in memory per store (the oldest written goes first)."""


class SealedRocksDBStore(RocksDBStore):
    """faust's RocksDB store holding owner values sealed (see the module docstring)."""

    seals_at_rest = True
    decodes_restored = True
    """Restored changelog records reach :meth:`apply_changelog_batch` undecoded
    (:func:`~streams.processors.state_codec.refuse_bad_changelog`): it decodes each once."""
    state_sealer: StateSealer | None = None
    """Set by :func:`streams.processors.state_seal.seal_table` before the table is used."""
    restored_records: int = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.use_rocksdict:  # the same options faust built, memory bounded per process
            self.rocksdb_options = ProcessBoundedOptions(**(self.options or {}),
                                                         use_rocksdict=True)

    def _sealer(self) -> StateSealer:
        if self.state_sealer is None:
            raise RuntimeError(f"table {self.table_name}: the sealed store has no sealer; "
                               "wrap the table with state_seal.seal_table")
        return self.state_sealer

    def __setitem__(self, key: Any, value: Any) -> None:
        self._drop_probe()
        skey = str(key)
        sealed = self._sealer().seal_again(skey, value)
        if sealed is None:  # the owner was erased: nothing of it is stored
            self._forget(skey)
            self._del(self._encode_key(key))
            return
        self._set(self._encode_key(key), self._encode_value(sealed))
        if skey[:1] in CACHED_KINDS:
            self._remember(skey, sealed, value)

    # -- the opened-value cache: what was written last, so a read need not open it -----
    # A hit is the value object that was written (what a dict store returns); a hit of
    # an owner whose key was destroyed since reads as absent, like the stored value.

    def _cache(self) -> dict[str, tuple[str | None, int, Any]]:
        cache: dict[str, tuple[str | None, int, Any]] | None = self.__dict__.get("_opened_cache")
        if cache is None:
            cache = self.__dict__["_opened_cache"] = {}
        return cache

    def _remember(self, key: str, sealed: Any, value: Any) -> None:
        cache = self._cache()
        cache.pop(key, None)
        if isinstance(sealed, SealedState):
            cache[key] = (sealed.owner, sealed.generation, value)
        else:
            cache[key] = (None, 0, value)
        if len(cache) > CACHE_ENTRIES:
            del cache[next(iter(cache))]

    def _forget(self, key: str | None = None) -> None:
        if key is None:
            self._cache().clear()
        else:
            self._cache().pop(key, None)

    def _cached(self, key: str) -> tuple[bool, Any]:
        hit = self._cache().get(key)
        if hit is None:
            return False, None
        owner, generation, value = hit
        if owner is not None and isinstance(
                self._sealer().sealer.opening_key(owner, generation), Erased):
            self._forget(key)
            return True, Erased(owner, generation)
        return True, value

    def __delitem__(self, key: Any) -> None:
        self._forget(str(key))
        self._drop_probe()
        super().__delitem__(key)

    def revoke_partitions(self, table: Any, tps: Any) -> None:
        self._forget()
        self._drop_probe()
        self._flush_memtables(tp.partition for tp in tps
                              if tp.topic in table.changelog_topic.topics)
        super().revoke_partitions(table, tps)

    async def stop(self) -> None:
        self._flush_memtables(list(self._dbs))
        await super().stop()

    def _flush_memtables(self, partitions: Iterable[int]) -> None:
        """Write the memtables of these partitions' databases to disk before faust lets
        them go: without the write-ahead log (:data:`WRITE_AHEAD_LOG`) a database dropped
        unflushed would leave a restart more changelog to read, and RocksDB flushes on
        close only once the last reference is gone."""
        for partition in partitions:
            db = self._dbs.get(partition)
            if db is not None and hasattr(db, "flush"):
                db.flush()

    # -- one RocksDB read per table read, not two: faust's Table.__getitem__ asks ``key in
    # store`` (faust's _contains: a get that copies the whole value) and then gets the key
    # again. The probe keeps what that get read for the read that follows.

    def __contains__(self, key: Any) -> bool:
        skey = str(key)
        if skey in self._cache():
            return True  # written by this store and still there (an erased one too)
        if current_event() is None:  # no partition to route to: faust's search
            return bool(super().__contains__(key))
        raw = self._get(self._encode_key(key))
        self.__dict__["_probe"] = (skey, raw)
        return raw is not None

    def _probed(self, key: str) -> tuple[bool, bytes | None]:
        probe = self.__dict__.pop("_probe", None)
        if probe is None or probe[0] != key:
            return False, None
        return True, probe[1]

    def _drop_probe(self) -> None:
        self.__dict__.pop("_probe", None)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """``Table.update`` (a chunk's staged keys) ends here after faust wrote their
        changelog records; faust's stores have no dict behind them, so set each key
        (sealed) like ``__setitem__``."""
        for mapping in (*args, kwargs):
            for key, value in dict(mapping).items():
                self[key] = value

    def __getitem__(self, key: Any) -> Any:
        skey = str(key)
        probed, raw = self._probed(skey)
        hit, value = self._cached(skey)
        if hit:
            if isinstance(value, Erased):
                raise KeyError(key)
            return value
        if not probed:
            raw = self._get(self._encode_key(key))
        if raw is None:
            raise KeyError(key)
        value = self._opened(skey, self._decode_value(raw))
        if isinstance(value, Erased):
            raise KeyError(key)
        return value

    def _opened(self, key: str, value: Any) -> Any:
        if not isinstance(value, SealedState):
            return value
        try:
            return self._sealer().open(key, value)
        except SealOpenError as exc:  # written by this store: damage or another key store
            crash(f"table {self.table_name}: the stored value of a key does not open", exc)

    def _items_decoded(self) -> Iterator[tuple[Any, Any]]:
        for raw_key, raw in self._iteritems():
            key = self._decode_key(raw_key)
            value = self._opened(str(key), self._decode_value(raw))
            if not isinstance(value, Erased):
                yield key, value

    def _values_decoded(self) -> Iterator[Any]:
        for _, value in self._items_decoded():
            yield value

    def apply_changelog_batch(self, batch: Iterable[Any], to_key: Callable[[Any], Any],
                              to_value: Callable[[Any], Any]) -> None:
        """Store restored changelog records as they are (sealed), after opening each once:
        an erased owner's record is deleted instead, one that does not open stops the
        worker."""
        events = list(batch)
        self._drop_probe()
        kept = [self._checked(event) for event in events]
        self.restored_records += len(events)
        self._sealer().counters.inc("state", f"{self.table_name}_restored_records", len(events))
        super().apply_changelog_batch(kept, to_key, to_value)

    def _checked(self, event: Any) -> Any:
        # the restored record replaces what was written under its key (only that key: a
        # standby batch of the other worker's partitions leaves this one's cache alone)
        msg = event.message
        key = str(self._restored_part("key", self._decode_key, msg))
        self._forget(key)
        if msg.value is None:
            return event
        value = self._restored_part("value", self._decode_value, msg)
        try:
            opened = (self._sealer().check(key, value) if isinstance(value, SealedState)
                      else value)
        except (SealOpenError, ValueError, TypeError) as exc:
            log.critical(
                "changelog %s[%s]@%s holds a sealed value that does not open (and its owner was "
                "not erased): point $FLYWHEEL_OWNER_KEYS at the key store the capture was "
                "sealed with; otherwise rebuild the stream state under a fresh --app-id",
                msg.topic, msg.partition, msg.offset)
            crash(f"changelog restore (sealed value refused) on {msg.topic}[{msg.partition}]"
                  f"@{msg.offset}", exc)
        if isinstance(opened, Erased):
            self._sealer().counters.inc("sealing", f"{self.table_name}_erased_on_restore")
            return _Tombstone(event)
        return event

    @staticmethod
    def _restored_part(part: str, decode: Callable[[Any], Any], msg: Any) -> Any:
        """A restored record's key or value, decoded here only (the changelog topic hands
        records over undecoded, :class:`StoreDecodedChangelogTopic`); one that does not
        decode stops the worker."""
        try:
            return decode(getattr(msg, part))
        except (KeyDecodeError, ValueDecodeError, StateDecodeError, ValueError,
                TypeError) as exc:
            refuse_changelog_record(part, exc, msg)


class _Tombstone:
    """A changelog event seen as a deletion (its owner's key is destroyed)."""

    def __init__(self, event: Any) -> None:
        self.message = _TombstoneMessage(event.message)


class _TombstoneMessage:
    def __init__(self, message: Any) -> None:
        self.tp, self.offset = message.tp, message.offset
        self.partition, self.key, self.value = message.partition, message.key, None
        self.topic = message.topic
