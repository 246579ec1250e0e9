"""Pseudonymous, sealed capture records: what leaves the runtime, and how workers open it.

The runtime publisher hands every ``TranscriptTurn`` and ``RouteObservation`` to a
:class:`CaptureSealer`: owner, thread and request ids become pseudonyms
(:class:`core.privacy.Pseudonymizer`), and the fields that reveal what was said are
sealed (AES-256-GCM, :func:`core.privacy.seal`) under the owner's data key:

* ``TranscriptTurn.v2``: ``token_ids`` → ``sealed_token_ids`` (int32 LE);
* ``RouteObservation.v3``: ``token_id`` → ``sealed_token_id`` (int32 LE), and
  ``expert_ids`` + ``weights`` → ``sealed_routes`` (a token's routes identify it):
  int32 LE byte length of ``expert_ids``, then ``expert_ids``, then ``weights``.

Each seal's context binds it to its record (kind, thread pseudonym, generation,
request pseudonym, turn index, token offset or ordinal, speculative candidate), so
sealed bytes copied into another record do not open. ``key_generation`` names the
owner key generation that sealed it.

The stream workers' :class:`CaptureOpener` opens those fields right after Avro decode
and returns the record in the plaintext shape of the previous version
(``TranscriptTurn.v1`` / ``RouteObservation.v2``, with pseudonymous ids), so every later
check works unchanged on plaintext held in memory only. It refuses, with a reason code:
an older unsealed version (``unsealed_capture``), a record whose owner key was
destroyed (``owner_erased``), and sealed fields that do not open (``sealed_field_invalid``)
or whose owner key is unknown here (``owner_key_missing``).

Pure: no Kafka, no files beyond the key store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hebrus_flywheel.core.privacy import (
    DataKey,
    OwnerKeyDestroyedError,
    OwnerKeyMissingError,
    OwnerKeyStore,
    Pseudonymizer,
    SealedFieldError,
    is_pseudonym,
    open_sealed,
    pack_int32,
    seal,
    unpack_int32,
)
from hebrus_flywheel.core.privacy.pseudonyms import OWNER, SEQUENCE, THREAD

TURN_V1 = "hebrus.flywheel.v1.TranscriptTurn.v1"
TURN_V2 = "hebrus.flywheel.v1.TranscriptTurn.v2"
OBSERVATION_V1 = "hebrus.flywheel.v1.RouteObservation.v1"
OBSERVATION_V2 = "hebrus.flywheel.v1.RouteObservation.v2"
OBSERVATION_V3 = "hebrus.flywheel.v1.RouteObservation.v3"
OBSERVATION_CHUNK_V1 = "hebrus.flywheel.v1.RouteObservationChunk.v1"
SEALED_SCHEMAS = frozenset({TURN_V2, OBSERVATION_V3, OBSERVATION_CHUNK_V1})
UNSEALED_SCHEMAS = frozenset({TURN_V1, OBSERVATION_V1, OBSERVATION_V2})

SEALING_REASONS: dict[str, str] = {
    "unsealed_capture": "a capture record of an old, unsealed schema version (plaintext "
    "token ids, raw ids); kept metadata-only — upgrade the runtime publisher",
    "owner_erased": "the record is sealed under an owner key destroyed by an erasure; kept "
    "metadata-only, its content is unreadable for good",
    "sealed_field_invalid": "a sealed field does not open: moved from another record, "
    "damaged, or sealed under another key; or an id is not a pseudonym",
    "owner_key_missing": "no data key for the record's owner in this worker's key store "
    "(another key store?); the sealed value is kept",
}
"""Reason codes of the opener (added to the stream processors' quarantine codes)."""

METADATA_ONLY_REASONS = frozenset({"owner_erased"})
"""Reasons whose quarantine records keep no value bytes (only ids, sizes, digests) although
their schema seals its content: an erased owner's sealed bytes can never be opened again.
(An ``unsealed_capture`` record is metadata-only already: ``streams.quarantine.bound``
keeps content only of sealed schemas.)"""


class SealingError(Exception):
    """A capture record cannot be opened: ``reason`` is a :data:`SEALING_REASONS` code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _context(*parts: object) -> bytes:
    return "\x1f".join("" if p is None else str(p) for p in parts).encode()


def _speculative_part(record: Mapping[str, Any]) -> str:
    spec = record.get("speculative")
    if not spec:
        return ""
    return f"{spec['proposal_id']}#{spec['proposal_generation']}#{spec['candidate_position']}"


def turn_context(record: Mapping[str, Any]) -> bytes:
    """What a turn's seal is bound to: it opens only in the record it was made for."""
    return _context("turn", record["thread"], record["generation"], record["sequence_id"],
                    record["turn_index"], record["token_offset"])


def observation_context(record: Mapping[str, Any]) -> bytes:
    """What an observation's seals are bound to."""
    return _context("observation", record["thread"], record["generation"],
                    record["sequence_id"], record["turn_index"], record["token_ordinal"],
                    _speculative_part(record), record["top_k"],
                    ",".join(map(str, record["layers"])))


def pseudonymized(record: Mapping[str, Any], names: Pseudonymizer) -> dict[str, Any]:
    """A copy of a runtime record (raw ids) with owner, thread and sequence_id replaced
    by their pseudonyms."""
    raw_owner = str(record["owner"])
    return {**record, "owner": names.owner(raw_owner),
            "thread": names.thread(raw_owner, str(record["thread"])),
            "sequence_id": names.sequence(raw_owner, str(record["sequence_id"]))}


class CaptureSealer:
    """The runtime side: raw-id, plaintext records in, pseudonymous sealed records out.

    ``keys`` is a writer key store (``LocalOwnerKeyStore(create=True)``): the first
    record of an owner creates the owner's data key.
    """

    CACHE_SIZE = 65_536
    """Pseudonyms remembered (every token of a turn shares its ids); cleared when full."""

    def __init__(self, keys: OwnerKeyStore) -> None:
        self.keys = keys
        self.names = Pseudonymizer(keys)
        self._ids: dict[tuple[str, str, str], tuple[str, str, str]] = {}
        self._owners: dict[str, str] = {}

    def owner_pseudonym(self, raw_owner: str) -> str:
        """The pseudonym of a raw owner id (what the consent ledger is keyed by)."""
        named = self._owners.get(raw_owner)
        if named is None:
            if len(self._owners) >= self.CACHE_SIZE:
                self._owners.clear()
            named = self._owners[raw_owner] = self.names.owner(raw_owner)
        return named

    def turn(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """A ``TranscriptTurn.v2`` dict from a v1-shaped dict with raw ids."""
        return seal_turn(self.keys, self._pseudonymized(record))

    def observation(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """A ``RouteObservation.v3`` dict from a packed v2-shaped dict with raw ids."""
        return seal_observation(self.keys, self._pseudonymized(record))

    def ids(self, record: Mapping[str, Any]) -> tuple[str, str, str]:
        """The pseudonyms of a raw-id record's ``(owner, thread, sequence_id)`` (cached)."""
        raw = (str(record["owner"]), str(record["thread"]), str(record["sequence_id"]))
        ids = self._ids.get(raw)
        if ids is None:
            if len(self._ids) >= self.CACHE_SIZE:
                self._ids.clear()
            named = pseudonymized(record, self.names)
            ids = self._ids[raw] = (named["owner"], named["thread"], named["sequence_id"])
        return ids

    def chunk(self, header: Mapping[str, Any], payload: bytes) -> dict[str, Any]:
        """A ``RouteObservationChunk.v1`` dict from its header (pseudonymous ids) and its
        plaintext payload (:mod:`streams.chunks`), sealed under the owner's live key."""
        from hebrus_flywheel.streams.chunks import seal_chunk

        return seal_chunk(self.keys.data_key(header["owner"], create=True), header, payload)

    def _pseudonymized(self, record: Mapping[str, Any]) -> dict[str, Any]:
        ids = self.ids(record)
        return {**record, "owner": ids[0], "thread": ids[1], "sequence_id": ids[2]}


def seal_turn(keys: OwnerKeyStore, record: Mapping[str, Any], *,
              key: DataKey | None = None) -> dict[str, Any]:
    """``TranscriptTurn.v2`` from a v1-shaped dict whose ids are pseudonyms already,
    sealed under the owner's live data key (or ``key``: tests that forge records)."""
    out = dict(record)
    key = key if key is not None else keys.data_key(out["owner"], create=True)
    tokens = out.pop("token_ids")
    out["sealed_token_ids"] = seal(key, pack_int32(tokens), field_name="token_ids",
                                   context=turn_context(out))
    out["key_generation"] = key.generation
    return out


def seal_observation(keys: OwnerKeyStore, record: Mapping[str, Any], *,
                     key: DataKey | None = None) -> dict[str, Any]:
    """``RouteObservation.v3`` from a packed v2-shaped dict whose ids are pseudonyms."""
    out = dict(record)
    key = key if key is not None else keys.data_key(out["owner"], create=True)
    context = observation_context(out)
    out["sealed_token_id"] = seal(key, pack_int32([out.pop("token_id")]),
                                  field_name="token_id", context=context)
    ids = bytes(out.pop("expert_ids"))
    routes = pack_int32([len(ids)]) + ids + bytes(out.pop("weights"))
    out["sealed_routes"] = seal(key, routes, field_name="routes", context=context)
    out["key_generation"] = key.generation
    return out


class CaptureOpener:
    """The stream workers' side: opens sealed capture records with a reader key store
    (``LocalOwnerKeyStore()``, which never creates keys)."""

    def __init__(self, keys: OwnerKeyStore) -> None:
        self.keys = keys

    def open(self, schema: str, record: Mapping[str, Any]) -> dict[str, Any]:
        """The plaintext (previous-version) shape of a sealed record, or
        :class:`SealingError`."""
        if schema in UNSEALED_SCHEMAS:
            raise SealingError(
                "unsealed_capture",
                f"a {schema} record carries plaintext token ids and raw ids; capture must be "
                "pseudonymous and sealed (TranscriptTurn.v2, RouteObservation.v3): upgrade "
                "the runtime publisher (streams.publisher.RuntimePublisher) and republish")
        if schema == TURN_V2:
            return self._open_turn(record)
        if schema == OBSERVATION_V3:
            return self._open_observation(record)
        if schema == OBSERVATION_CHUNK_V1:
            raise SealingError("sealed_field_invalid", f"{schema} holds many tokens: open it "
                               "with CaptureOpener.open_chunk")
        raise SealingError("sealed_field_invalid", f"{schema} is not a capture record schema")

    def open_chunk(self, record: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The plaintext ``RouteObservation.v2`` records of a ``RouteObservationChunk.v1``
        (:func:`streams.chunks.unroll`), or :class:`SealingError`; a payload that does not
        fit the chunk's header raises :class:`streams.chunks.ChunkError`."""
        from hebrus_flywheel.streams import chunks

        return chunks.unroll(record, self.open_chunk_arrays(record))

    def open_chunk_arrays(self, record: Mapping[str, Any]) -> Any:
        """A chunk's plaintext as arrays (:class:`streams.chunks.ChunkTokens`), not
        unrolled; the same errors as :meth:`open_chunk`."""
        from hebrus_flywheel.streams import chunks

        chunks.check_chunk(record)  # before any key look-up
        key = self._key(record)
        try:
            return chunks.open_chunk(key, record)
        except SealedFieldError as exc:
            raise SealingError("sealed_field_invalid", str(exc)) from exc

    def _key(self, record: Mapping[str, Any]) -> Any:
        for name, kind in (("owner", OWNER), ("thread", THREAD), ("sequence_id", SEQUENCE)):
            if not is_pseudonym(str(record.get(name)), kind):
                raise SealingError(
                    "sealed_field_invalid",
                    f"{name} is not a {kind}-pseudonym ({kind} + 32 hex digits); the runtime "
                    "publisher pseudonymizes every id — publish through it")
        try:
            return self.keys.data_key(record["owner"], generation=int(record["key_generation"]))
        except OwnerKeyDestroyedError as exc:
            raise SealingError("owner_erased", str(exc)) from exc
        except OwnerKeyMissingError as exc:
            raise SealingError("owner_key_missing", str(exc)) from exc

    def _open_turn(self, record: Mapping[str, Any]) -> dict[str, Any]:
        key = self._key(record)
        out = dict(record)
        sealed = out.pop("sealed_token_ids")
        del out["key_generation"]
        try:
            out["token_ids"] = unpack_int32(open_sealed(
                key, sealed, field_name="token_ids", context=turn_context(record)))
        except SealedFieldError as exc:
            raise SealingError("sealed_field_invalid", str(exc)) from exc
        return out

    def _open_observation(self, record: Mapping[str, Any]) -> dict[str, Any]:
        key = self._key(record)
        out = dict(record)
        context = observation_context(record)
        try:
            token = unpack_int32(open_sealed(key, out.pop("sealed_token_id"),
                                             field_name="token_id", context=context))
            routes = open_sealed(key, out.pop("sealed_routes"), field_name="routes",
                                 context=context)
        except SealedFieldError as exc:
            raise SealingError("sealed_field_invalid", str(exc)) from exc
        del out["key_generation"]
        ids_end = 4 + (unpack_int32(routes[:4])[0] if len(routes) >= 4 else -5)
        if len(token) != 1 or not 4 <= ids_end <= len(routes):
            raise SealingError(
                "sealed_field_invalid",
                f"the sealed token id holds {len(token)} ids and the sealed routes "
                f"({len(routes)} bytes) do not start with the length of their expert ids; "
                "they were not sealed by the runtime publisher")
        out.update(token_id=token[0], expert_ids=routes[4:ids_end], weights=routes[ids_end:])
        return out
