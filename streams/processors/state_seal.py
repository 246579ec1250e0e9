"""Table values sealed under their owner's data key in the changelog topics.

The processor tables hold plaintext values in memory (token ids of a thread being
assembled, routes, a thread's digest and MinHash signature). What a table writes to its
changelog topic is sealed when the value belongs to an owner, and the owner comes from
the table key (:func:`owner_of_key`): ``h|t|o|d|p<SEP><owner><SEP>…`` (headers, turns,
observations, dedup decisions, summaries waiting for their turn), ``q|g|u|k<SEP><owner>…``
(the band-partitioned dedup's probes, candidates, subscribers and known decisions,
:mod:`streams.processors.dedup_bands`) and
``s<SEP><owner>/<thread>`` (sticky splits). Other keys (producer counters, the decision
sequence, capture partitions' marks) hold no owner's data and stay plain.

A sealed value is :class:`~streams.processors.state_codec.SealedState`: the state-codec
bytes of the value, AES-256-GCM under the owner's live data key (random nonce), bound to
the table name and the key, so a value copied to another key does not open.

On restore (the changelog read back into the table on start or rebalance):

* a value whose owner key was destroyed (``flywheel erase``) is left out of the table,
  as if the owner had never been seen: the owner is erased, the worker goes on;
* a value that does not open for any other reason (no key store, a key of another
  store, damaged or moved bytes) stops the worker with one log line and the crash
  status, like a record that is no state-codec record (fail closed).

A value written for an owner whose key is already destroyed is written as a tombstone:
it cannot be sealed, and it must not be written in the clear.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NoReturn

from hebrus_flywheel.core.counters import Counters
from hebrus_flywheel.core.privacy import OwnerKeyDestroyedError, PrivacyError, open_sealed, seal
from hebrus_flywheel.streams.owner_seal import Erased, OwnerSealer, SealOpenError
from hebrus_flywheel.streams.processors.common import SEP
from hebrus_flywheel.streams.processors.crash import crash
from hebrus_flywheel.streams.processors.state_codec import (
    SealedState,
    StateDecodeError,
    dumps,
    loads,
)

log = logging.getLogger(__name__)
FIELD = "state"
_OWNER_KINDS = frozenset("htodpqguk")


def owner_of_key(key: str) -> str | None:
    """The owner a table key belongs to; None for keys of no owner."""
    kind, sep, rest = key.partition(SEP)
    if not sep:
        return None
    if kind in _OWNER_KINDS:
        return rest.split(SEP, 1)[0]
    if kind == "s":
        return rest.split("/", 1)[0]
    return None


class StateSealer:
    """Seals the values of one table for its changelog and opens them on restore."""

    def __init__(self, sealer: OwnerSealer, table: str, counters: Counters | None = None) -> None:
        self.sealer = sealer
        self.table = table
        self.counters = counters or Counters()
        self._last: tuple[str, Any, Any] | None = None

    def seal_again(self, key: str, value: Any) -> Any:
        """:meth:`seal`, or what it returned for this very value object just before: faust
        sends a key's changelog record, then the sealed store writes the same value; one
        AES-GCM seal serves both (the changelog and RocksDB hold the same sealed bytes)."""
        last = self._last
        if last is not None and last[0] == key and last[1] is value:
            self._last = None
            return last[2]
        return self.seal(key, value)

    def _context(self, key: str) -> bytes:
        return f"{self.table}\0{key}".encode()

    def seal(self, key: str, value: Any) -> Any:
        """What the changelog gets for ``table[key] = value`` (None stays a tombstone)."""
        owner = None if value is None else owner_of_key(key)
        if owner is None:
            return value
        try:
            data_key = self.sealer.sealing_key(owner)
        except OwnerKeyDestroyedError:
            self.counters.inc("sealing", f"{self.table}_erased_tombstones")
            return None
        body = seal(data_key, dumps(value), field_name=FIELD, context=self._context(key))
        sealed = SealedState(owner=owner, generation=data_key.generation, body=body)
        self._last = (key, value, sealed)
        return sealed

    def open(self, key: str, value: SealedState) -> Any:
        """The value of a restored :class:`SealedState`; :class:`Erased` for a destroyed
        key; :class:`SealOpenError` when it does not open for another reason."""
        plaintext = self._plaintext(key, value)
        if isinstance(plaintext, Erased):
            return plaintext
        try:
            return loads(plaintext)
        except StateDecodeError as exc:
            raise SealOpenError(f"table {self.table} key {key!r}: {exc}") from exc

    def check(self, key: str, value: SealedState) -> Erased | None:
        """What a store that keeps values sealed needs at restore: :class:`Erased` for a
        destroyed key, None when the value opens, :class:`SealOpenError` as :meth:`open`.

        It decrypts without decoding: AES-GCM's tag already proves the bytes are the ones
        sealed for this table and key, and decoding (most of :meth:`open`'s time on a
        standby replica, which checks every record the other worker writes) is left to
        the read that needs the value."""
        plaintext = self._plaintext(key, value)
        return plaintext if isinstance(plaintext, Erased) else None

    def _plaintext(self, key: str, value: SealedState) -> bytes | Erased:
        if owner_of_key(key) != value.owner:
            raise SealOpenError(f"key {key!r} of table {self.table} holds a value sealed for "
                                f"owner {value.owner!r}")
        data_key = self.sealer.opening_key(value.owner, value.generation)
        if isinstance(data_key, Erased):
            return data_key
        try:
            return open_sealed(data_key, value.body, field_name=FIELD, context=self._context(key))
        except PrivacyError as exc:
            raise SealOpenError(f"table {self.table} key {key!r}: {exc}") from exc

    def restored(self, data: dict[Any, Any], key_partition: dict[Any, int],
                 events: Iterable[Any]) -> None:
        """Open (in place) every sealed value a changelog batch left in ``data``."""
        last: dict[Any, Any] = {}
        for event in events:
            last[event.key] = event
        for key, event in last.items():
            value = data.get(key)
            if not isinstance(value, SealedState):
                continue
            try:
                opened = self.open(str(key), value)
            except SealOpenError as exc:
                _refuse(event, exc)
            if isinstance(opened, Erased):
                data.pop(key, None)
                key_partition.pop(key, None)
                self.counters.inc("sealing", f"{self.table}_erased_on_restore")
            else:
                data[key] = opened


def _refuse(event: Any, exc: Exception) -> NoReturn:
    msg = event.message
    log.critical(
        "changelog %s[%s]@%s holds a sealed value that does not open (and its owner was not "
        "erased): the owner key store is missing or another one, or the record was damaged "
        "or moved. Point $FLYWHEEL_OWNER_KEYS at the key store the capture was sealed with; "
        "otherwise rebuild the stream state from the capture topics under a fresh --app-id",
        msg.topic, msg.partition, msg.offset)
    crash(f"changelog restore (sealed value refused) on {msg.topic}[{msg.partition}]"
          f"@{msg.offset}", exc)


def seal_table(table: Any, sealer: OwnerSealer, counters: Counters | None = None) -> Any:
    """Make ``table`` seal owner values in its changelog and open them when it is
    restored. On the memory store restored values are opened in memory; a store that
    seals at rest (:class:`~streams.processors.state_store.SealedRocksDBStore`) gets the
    sealer and keeps them sealed."""
    state = StateSealer(sealer, str(table.name), counters)
    send, apply = table.send_changelog, table.apply_changelog_batch
    table.state_sealer = state

    def send_changelog(partition: int | None, key: Any, value: Any,
                       key_serializer: Any = None, value_serializer: Any = None) -> Any:
        sealed = state.seal(str(key), value)
        if sealed is None and value is not None:
            value_serializer = "raw"  # a tombstone, as faust writes for a deleted key
        return send(partition, key, sealed, key_serializer, value_serializer)

    def apply_changelog_batch(batch: Iterable[Any]) -> None:
        events = list(batch)
        apply(events)
        store = table.data
        state.restored(store.data, store._key_partition, events)

    table.send_changelog = send_changelog
    if getattr(table.data, "seals_at_rest", False):
        table.data.state_sealer = state  # the store opens on read and on restore
    else:
        table.apply_changelog_batch = apply_changelog_batch
    return table
