"""The codec of the processor tables: tagged JSON, never a code-running format.

Table values are plain Python structures (dicts, lists, tuples, ints, floats, strings,
bytes, None). Their changelog records are UTF-8 JSON in which the types JSON lacks
carry a one-key tag object, so a restored value equals the value that was set, type
for type:

* ``tuple``  → ``{"$tuple": [...]}``
* ``bytes``  → ``{"$bytes": "<base64>"}``
* a ``dict`` with a non-string key, or whose only key is a tag → ``{"$map": [[k, v], ...]}``
* :class:`SealedState` (a value sealed under its owner's data key, see
  :mod:`streams.processors.state_seal`) → ``{"$sealed": {"o": owner, "g": generation,
  "c": {"$bytes": ...}}}``; the codec carries it, it never opens it

Decoding builds nothing but those types: no class is looked up and no code runs, so a
record written by anyone able to produce to a changelog topic is at worst *refused*
(:class:`StateDecodeError`). Any other value type is refused when the table writes it
(:class:`StateEncodeError`) rather than changed silently.

How the worker treats a refused changelog record: :class:`RefusingChangelogTopic` is
the changelog topic of every processor table; a record whose key or value does not
decode stops the worker during the restore with one log line naming the topic,
partition and offset and exit status :data:`~streams.processors.crash.CRASH_EXIT_STATUS`
(fail closed: a table restored without one of its records would be wrong state).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from dataclasses import dataclass
from typing import Any

from faust import Topic
from faust.serializers import codecs

from hebrus_flywheel.streams.processors.crash import crash

log = logging.getLogger(__name__)
STATE_CODEC = "flywheel-state-json"
TUPLE, BYTES, MAP, SEALED = "$tuple", "$bytes", "$map", "$sealed"
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


_SCALARS = frozenset((str, int, bool, float, type(None)))
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _enc(obj: Any) -> Any:
    # scalars are tested inline (not by a call per element): table values are mostly
    # lists of ints and small dicts, and every table write encodes one
    t = type(obj)
    if t in _SCALARS:
        return obj
    if t is list or t is tuple:
        items = [v if type(v) in _SCALARS else _enc(v) for v in obj]
        return items if t is list else {TUPLE: items}
    if t is dict:
        return _enc_dict(obj)
    if t is bytes:
        return {BYTES: base64.b64encode(obj).decode("ascii")}
    if t is SealedState:
        return {SEALED: {"o": obj.owner, "g": obj.generation, "c": _enc(obj.body)}}
    raise StateEncodeError(
        f"a table value holds a {t.__module__}.{t.__qualname__}; the state codec carries "
        "only None, bool, int, float, str, bytes, list, tuple and dict"
    )


def _enc_dict(obj: dict[Any, Any]) -> Any:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if type(k) is not str:
            break
        out[k] = v if type(v) in _SCALARS else _enc(v)
    else:
        if len(out) != 1 or next(iter(out)) not in _TAGS:
            return out
    return {MAP: [[_enc(k), _enc(v)] for k, v in obj.items()]}


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


def _sealed(body: dict[str, Any]) -> SealedState:
    owner, generation, sealed = body.get("o"), body.get("g"), body.get("c")
    if (len(body) != 3 or type(owner) is not str or type(generation) is not int
            or type(sealed) is not bytes):
        raise StateDecodeError(f"malformed {SEALED} tag: wants o (str), g (int), c (bytes)")
    return SealedState(owner=owner, generation=generation, body=sealed)


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


_last_sealed: list[tuple[SealedState, bytes]] = []


def dumps(value: Any) -> bytes:
    """One table value as a changelog record (:class:`StateEncodeError` if it cannot be).

    A :class:`SealedState` is immutable and is encoded twice in a row (its changelog
    record, then the sealed store's copy): the second time reuses the first's bytes."""
    if type(value) is SealedState:
        if _last_sealed and _last_sealed[0][0] is value:
            return _last_sealed[0][1]
        data = _ENCODER.encode(_enc(value)).encode("utf-8")
        _last_sealed[:] = [(value, data)]
        return data
    return _ENCODER.encode(_enc(value)).encode("utf-8")


def loads(data: bytes) -> Any:
    """A changelog record back to the table value (:class:`StateDecodeError` if it is not one)."""
    try:
        return json.loads(data.decode("utf-8"), object_hook=_hook)
    except StateDecodeError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StateDecodeError(f"not a state-codec record: {type(exc).__name__}: {exc}") from exc


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
        _refuse("key", exc, message)

    async def on_value_decode_error(self, exc: Exception, message: Any) -> None:
        _refuse("value", exc, message)


def _refuse(part: str, exc: Exception, message: Any) -> None:
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
    """Make ``table``'s changelog topic a :class:`RefusingChangelogTopic` (same settings)."""
    table.changelog_topic = RefusingChangelogTopic(**table.changelog_topic._clone_args())
    return table
