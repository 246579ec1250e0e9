"""The codec of the processor tables: MessagePack with three extension types, never a
code-running format.

Table values are plain Python structures (dicts, lists, tuples, ints, floats, strings,
bytes, None). Their changelog (and store) records are :data:`MAGIC` followed by one
MessagePack object, so a restored value equals the value that was set, type for type:
bytes stay binary (a chunk's routes are ~250 KB of them: no base64, no text escaping),
maps may have any hashable key, and what MessagePack lacks is an extension type:

* ``tuple``  → ext :data:`EXT_TUPLE` holding a MessagePack array;
* an ``int`` outside 64 bits → ext :data:`EXT_BIGINT` holding its decimal digits;
* :class:`SealedState` (a value sealed under its owner's data key, see
  :mod:`streams.processors.state_seal`) → ext :data:`EXT_SEALED` holding
  ``[owner, generation, body]``; the codec carries it, it never opens it.

Decoding builds nothing but those types: no class is looked up and no code runs (any
other extension type, MessagePack's timestamp included, is refused), so a record written
by anyone able to produce to a changelog topic is at worst *refused*
(:class:`StateDecodeError`). Any other value type is refused when the table writes it
(:class:`StateEncodeError`) rather than changed silently.

Records of workers before this codec are tagged UTF-8 JSON (``{"$tuple": [...]}``,
``{"$bytes": "<base64>"}``, ``{"$map": [[k, v], ...]}``, ``{"$sealed": {"o", "g", "c"}}``);
they still decode (:data:`MAGIC` is never the first byte of a JSON text), so a home
restores across the upgrade. Measured on a 64-token chunk's run value (48 layers x
top-10): JSON 1.3 ms to encode and 1.0 ms to decode, twice over once sealed (the sealed
body is base64 again); MessagePack a few hundredths of that.

How the worker treats a refused changelog record: a record whose key or value does not
decode stops the worker during the restore with one log line naming the topic,
partition and offset and exit status :data:`~streams.processors.crash.CRASH_EXIT_STATUS`
(fail closed: a table restored without one of its records would be wrong state). The
worker's tables (sealed RocksDB stores) read their changelog undecoded and refuse in the
store, which decodes each record once (:class:`StoreDecodedChangelogTopic`); a table on
another store refuses as faust decodes (:class:`RefusingChangelogTopic`).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

import msgpack
from faust import Topic
from faust.serializers import codecs

from hebrus_flywheel.streams.processors.crash import crash

log = logging.getLogger(__name__)
STATE_CODEC = "flywheel-state"
MAGIC = b"\xc1\x01"  # 0xc1: never used by MessagePack, never the start of UTF-8 JSON
EXT_TUPLE, EXT_BIGINT, EXT_SEALED = 1, 2, 3
TUPLE, BYTES, MAP, SEALED = "$tuple", "$bytes", "$map", "$sealed"  # legacy JSON tags
_TAGS = frozenset((TUPLE, BYTES, MAP, SEALED))


class StateEncodeError(TypeError):
    """A table value holds a type the state codec does not carry."""


class StateDecodeError(ValueError):
    """A changelog record is not a state-codec record."""


@dataclass(frozen=True, kw_only=True)
class SealedState:
    """A table value sealed under its owner's data key: the state-codec bytes of the
    value, AES-GCM sealed (:mod:`streams.processors.state_seal` seals and opens)."""

    owner: str
    generation: int
    body: bytes


def _default(obj: Any) -> msgpack.ExtType:
    # strict_types: only exact list/dict/int/... are packed natively; everything else
    # comes here, where tuples, big ints and sealed values become extension types
    t = type(obj)
    if t is tuple:
        return msgpack.ExtType(EXT_TUPLE, _pack(list(obj)))
    if t is int:
        return msgpack.ExtType(EXT_BIGINT, str(obj).encode("ascii"))
    if t is SealedState:
        return msgpack.ExtType(EXT_SEALED, _pack([obj.owner, obj.generation, obj.body]))
    raise StateEncodeError(
        f"a table value holds a {t.__module__}.{t.__qualname__}; the state codec carries "
        "only None, bool, int, float, str, bytes, list, tuple and dict"
    )


def _pack(value: Any) -> bytes:
    # an int beyond 64 bits raises OverflowError inside msgpack, which then hands it to
    # _default (EXT_BIGINT)
    return msgpack.packb(value, use_bin_type=True, strict_types=True, default=_default)


_MAX_EXT_DEPTH = 64  # extensions inside extensions; table values nest two or three
_depth = threading.local()


def _ext(code: int, data: bytes) -> Any:
    # each extension is unpacked by a nested unpackb call: without a bound, a crafted
    # record nesting thousands of them overflows the C stack (a crash, not an error)
    depth = getattr(_depth, "n", 0)
    if depth >= _MAX_EXT_DEPTH:
        raise StateDecodeError(f"not a state-codec record: extensions nested over "
                               f"{_MAX_EXT_DEPTH} deep")
    _depth.n = depth + 1
    try:
        return _ext_value(code, data)
    finally:
        _depth.n = depth


def _ext_value(code: int, data: bytes) -> Any:
    if code == EXT_TUPLE:
        items = _unpack(data)
        if type(items) is not list:
            raise StateDecodeError("malformed tuple extension: wants an array")
        return tuple(items)
    if code == EXT_BIGINT:
        if not data or not data.lstrip(b"-").isdigit():
            raise StateDecodeError("malformed big-int extension: wants decimal digits")
        return int(data)
    if code == EXT_SEALED:
        fields = _unpack(data)
        if type(fields) is not list or len(fields) != 3:
            raise StateDecodeError("malformed sealed extension: wants [owner, generation, body]")
        return _sealed({"o": fields[0], "g": fields[1], "c": fields[2]})
    raise StateDecodeError(f"extension type {code} is not a state-codec type")


def _unpack(data: bytes | memoryview) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True,
                               ext_hook=_ext, timestamp=0)
    except StateDecodeError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # ExtraData, FormatError, StackError, invalid UTF-8, unhashable map keys
        raise StateDecodeError(f"not a state-codec record: {type(exc).__name__}: {exc}") from exc


_PLAIN = frozenset((str, int, bool, float, type(None), bytes, SealedState))


def _foreign(value: Any) -> type | None:
    """The first type in ``value`` the codec does not carry, else None. Checked both ways:
    msgpack would pack a bytearray or memoryview as bytes (a silent change), and its own
    timestamp extension decodes to a class of its own."""
    t = type(value)
    if t in _PLAIN:
        return None
    if t is list or t is tuple:
        for item in value:
            if type(item) not in _PLAIN:
                found = _foreign(item)
                if found is not None:
                    return found
        return None
    if t is dict:
        for k, v in value.items():  # plain keys and values need no call (most of them)
            if type(k) not in _PLAIN or type(v) not in _PLAIN:
                found = _foreign(k) or _foreign(v)
                if found is not None:
                    return found
        return None
    return t


def _sealed(body: dict[str, Any]) -> SealedState:
    owner, generation, sealed = body.get("o"), body.get("g"), body.get("c")
    if (len(body) != 3 or type(owner) is not str or type(generation) is not int
            or type(sealed) is not bytes):
        raise StateDecodeError(f"malformed {SEALED} tag: wants o (str), g (int), c (bytes)")
    return SealedState(owner=owner, generation=generation, body=sealed)


_last_sealed: list[tuple[SealedState, bytes]] = []


def dumps(value: Any) -> bytes:
    """One table value as a changelog record (:class:`StateEncodeError` if it cannot be).

    A :class:`SealedState` is immutable and is encoded twice in a row (its changelog
    record, then the sealed store's copy): the second time reuses the first's bytes."""
    if type(value) is SealedState:
        if _last_sealed and _last_sealed[0][0] is value:
            return _last_sealed[0][1]
        data = MAGIC + _pack(value)
        _last_sealed[:] = [(value, data)]
        return data
    foreign = _foreign(value)
    if foreign is not None:
        raise StateEncodeError(
            f"a table value holds a {foreign.__module__}.{foreign.__qualname__}; the state "
            "codec carries only None, bool, int, float, str, bytes, list, tuple and dict")
    return MAGIC + _pack(value)


def loads(data: bytes) -> Any:
    """A changelog record back to the table value (:class:`StateDecodeError` if it is not
    one): MessagePack after :data:`MAGIC`, else the tagged JSON of older workers."""
    if data[:2] == MAGIC:
        try:
            value = _unpack(memoryview(data)[2:])
            foreign = _foreign(value)
        except RecursionError as exc:
            raise StateDecodeError("not a state-codec record: nested too deeply") from exc
        if foreign is not None:
            raise StateDecodeError(f"not a state-codec record: holds a {foreign.__qualname__}")
        return value
    try:
        return json.loads(data.decode("utf-8"), object_hook=_hook)
    except StateDecodeError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StateDecodeError(f"not a state-codec record: {type(exc).__name__}: {exc}") from exc


# -- the tagged JSON of older workers (decode only) -------------------------------------


def _hook(obj: dict[str, Any]) -> Any:
    if len(obj) != 1:
        return obj
    (tag, body), = obj.items()
    if tag == TUPLE and type(body) is list:
        return tuple(body)
    if tag == BYTES and type(body) is str:
        try:
            return base64.b64decode(body.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as exc:
            raise StateDecodeError(f"bad base64 in a {BYTES} tag: {exc}") from exc
    if tag == MAP and type(body) is list:
        return _map(body)
    if tag == SEALED and type(body) is dict:
        return _sealed(body)
    if tag in _TAGS:
        raise StateDecodeError(f"malformed {tag} tag")
    return obj


def _map(pairs: list[Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            raise StateDecodeError(f"a {MAP} entry must be a [key, value] pair")
        try:
            out[pair[0]] = pair[1]
        except TypeError as exc:  # an unhashable key (a list or a dict)
            raise StateDecodeError(f"unhashable {MAP} key: {exc}") from exc
    return out


class _StateCodec(codecs.Codec):
    def _dumps(self, obj: Any) -> bytes:
        return dumps(obj)

    def _loads(self, s: bytes) -> Any:
        return loads(s)


codecs.register(STATE_CODEC, _StateCodec())


class StateValue:
    """Value type of the processor tables: faust picks the serializer from
    ``_options.serializer`` and hands decoded values to ``from_data`` unchanged."""

    class _options:
        serializer = STATE_CODEC

    @classmethod
    def from_data(cls, data: Any, preferred_type: Any = None) -> Any:
        return data


class RefusingChangelogTopic(Topic):
    """A table changelog topic whose undecodable records stop the worker (fail closed).

    faust's own handling logs a warning during the restore and leaves the record out
    of the table; here the worker exits instead, naming the record.
    """

    async def on_key_decode_error(self, exc: Exception, message: Any) -> None:
        refuse_changelog_record("key", exc, message)

    async def on_value_decode_error(self, exc: Exception, message: Any) -> None:
        refuse_changelog_record("value", exc, message)


class StoreDecodedChangelogTopic(RefusingChangelogTopic):
    """The changelog topic of a table whose store decodes (and refuses) every restored
    record itself (:class:`~streams.processors.state_store.SealedRocksDBStore`).

    faust's table manager reads a changelog (restore and standby replicas) through a
    clone of its topic, and that clone decoded each record's key and value into an
    event that the RocksDB store then ignores: it writes the record's bytes and decoded
    them once more to open and check them. The clone made here hands the records over
    undecoded, so a restored record is decoded once. Records this topic *sends* are
    encoded as before (faust passes the table's serializers with each one).
    """

    def clone_using_queue(self, queue: Any) -> Any:
        return self.clone(queue=queue, is_iterator=True, schema=None, key_type=None,
                          value_type=None, key_serializer="raw", value_serializer="raw")


def refuse_changelog_record(part: str, exc: Exception, message: Any) -> NoReturn:
    """Stop the worker on a changelog record whose ``part`` (key or value) does not
    decode: a table restored without it would be wrong state."""
    log.critical(
        "changelog %s[%s]@%s is no state-codec record: it was written by something other "
        "than a streams worker (or by a worker older than the state codec). The table "
        "cannot be restored past it; restrict who may write to the changelog topics, then "
        "rebuild the stream state from the capture topics under a fresh --app-id",
        message.topic, message.partition, message.offset)
    # No record coordinates for crash(): its hooks would count a changelog record
    # towards poison and skip it, and a table restored without it is wrong state.
    crash(f"changelog restore (bad record {part}, refused unread) on "
          f"{message.topic}[{message.partition}]@{message.offset}", exc)


def refuse_bad_changelog(table: Any) -> Any:
    """Make ``table``'s changelog topic refuse records that do not decode (same
    settings): a :class:`StoreDecodedChangelogTopic` when the table's store decodes
    restored records itself (``decodes_restored``), a :class:`RefusingChangelogTopic`
    otherwise."""
    kind = (StoreDecodedChangelogTopic if getattr(table.data, "decodes_restored", False)
            else RefusingChangelogTopic)
    table.changelog_topic = kind(**table.changelog_topic._clone_args())
    return table
