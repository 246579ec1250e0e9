"""Window records sealed under the owner's data key: ``Window.v2``.

The window stage cuts plaintext windows (the ``Window.v1`` shape) in memory;
:func:`seal_window` turns one into the ``Window.v2`` record the worker writes, and
:func:`open_window` turns a ``Window.v2`` record back into the ``Window.v1`` shape that
replay reads (with the v2 ids and digests):

* ``token_ids`` → ``token_ids_sealed``: int32 little-endian, sealed with a synthetic
  (deterministic) nonce (:func:`core.privacy.seal_deterministic`), field
  ``Window.token_ids``, context the window id;
* ``thread_digest``: the owner-keyed HMAC (purpose ``thread``) of the plain SHA-256;
* ``window_id``: as v1 but over the owner-keyed HMAC of the tokens (purpose
  ``window-tokens``) instead of their SHA-256;
* ``content_digest``: SHA-256 over every other field of the v2 record, the sealed
  bytes by their SHA-256;
* ``key_generation``: the generation of the key that sealed it.

Everything is a function of the content and the owner's key, so the same window sealed
twice (an at-least-once repeat, ``flywheel rebuild --from-capture``) is byte-identical
and keeps its id. Routes (expert ids and weights) and the turn lineage stay in the
clear: they are not text. After the owner's key is destroyed, :func:`open_window`
returns :class:`~streams.owner_seal.Erased`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hebrus_flywheel.core.jsonio import canonical_json
from hebrus_flywheel.core.privacy import (
    DataKey,
    PrivacyError,
    keyed_digest,
    open_sealed,
    pack_int32,
    seal_deterministic,
    unpack_int32,
)
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.owner_seal import Erased, OwnerSealer, SealOpenError
from hebrus_flywheel.streams.processors.common import sha256_hex
from hebrus_flywheel.streams.processors.window import content_digest

__all__ = ["WINDOW_V1", "WINDOW_V2", "Erased", "OwnerSealer", "SealOpenError",
           "SealedBytesError", "default_sealer", "encode_window", "open_window",
           "readable_window", "seal_window"]


class SealedBytesError(SealOpenError):
    """The owner's key is there but the sealed window bytes do not open under it: damaged
    bytes, or bytes moved from another window. A bad record, not a missing key store."""

WINDOW_V1 = "Window.v1"
WINDOW_V2 = "Window.v2"
TOKENS_FIELD = "Window.token_ids"


def _window_id(window: Mapping[str, Any], tokens_key_digest: str) -> str:
    first = int(window["first_token_ordinal"])
    body = {
        "v": 2,
        "identity_id": window["identity_id"],
        "owner": window["owner"],
        "thread": window["thread"],
        "generation": window["generation"],
        "first_token_ordinal": first,
        "anchors": [first + int(a) for a in window["anchor_positions"]],
        "tokens": tokens_key_digest,
    }
    return sha256_hex(canonical_json(body))


def seal_window(window: Mapping[str, Any], key: DataKey) -> dict[str, Any]:
    """The ``Window.v2`` record of a plaintext (``Window.v1``-shaped) window."""
    if key.owner != window["owner"]:
        raise ValueError(f"window of owner {window['owner']!r} sealed under {key.key_id}")
    packed = pack_int32(window["token_ids"])
    wid = _window_id(window, keyed_digest(key, packed, purpose="window-tokens"))
    out: dict[str, Any] = {}
    for name, value in window.items():
        if name == "token_ids":
            out["token_count"] = len(value)
            out["token_ids_sealed"] = seal_deterministic(
                key, packed, field_name=TOKENS_FIELD, context=wid.encode())
        elif name == "owner":
            out["owner"], out["key_generation"] = value, key.generation
        else:
            out[name] = value
    out["window_id"] = wid
    out["thread_digest"] = keyed_digest(key, bytes.fromhex(str(window["thread_digest"])),
                                        purpose="thread")
    out["content_digest"] = content_digest(out)
    return out


def open_window(record: Mapping[str, Any], sealer: OwnerSealer) -> dict[str, Any] | Erased:
    """The ``Window.v1``-shaped window of a ``Window.v2`` record (v2 ids and digests);
    :class:`Erased` when its key was destroyed, :class:`SealOpenError` when it does not
    open for another reason (no key store, another key store, damaged bytes)."""
    key = sealer.opening_key(str(record["owner"]), int(record["key_generation"]))
    if isinstance(key, Erased):
        return key
    try:
        tokens = unpack_int32(open_sealed(key, bytes(record["token_ids_sealed"]),
                                          field_name=TOKENS_FIELD,
                                          context=str(record["window_id"]).encode()))
    except PrivacyError as exc:
        raise SealedBytesError(f"window {record['window_id']}: {exc}") from exc
    if len(tokens) != record["token_count"]:
        raise SealedBytesError(f"window {record['window_id']} opens to {len(tokens)} tokens, "
                            f"its token_count says {record['token_count']}")
    out: dict[str, Any] = {}
    for name, value in record.items():
        if name == "token_ids_sealed":
            out["token_ids"] = tokens
        elif name not in ("token_count", "key_generation"):
            out[name] = value
    return out


def encode_window(window: Mapping[str, Any], sealer: OwnerSealer) -> tuple[bytes, dict[str, Any]]:
    """The bytes a worker writes for ``window`` and the record they encode: ``Window.v2``
    under the owner's key (a raw owner is refused: :class:`RawOwnerError`)."""
    key = sealer.sealing_key(str(window["owner"]))
    record = seal_window(window, key)
    return codec.encode_entry(codec.default_registry().get(WINDOW_V2), record,
                              validate=False), record


def readable_window(version: int, record: Mapping[str, Any],
                    sealer: OwnerSealer) -> dict[str, Any] | Erased:
    """A decoded Window record of schema ``version`` in the shape replay reads."""
    if version == 1:
        return dict(record)
    if version == 2:
        return open_window(record, sealer)
    raise SealOpenError(f"Window.v{version} is not a window version this reader knows")


_DEFAULT: dict[str, OwnerSealer] = {}


def default_sealer() -> OwnerSealer:
    """One reader :class:`OwnerSealer` per key-store directory for this process."""
    from hebrus_flywheel.core.privacy import default_owner_keys_dir

    path = str(default_owner_keys_dir())
    if path not in _DEFAULT:
        _DEFAULT[path] = OwnerSealer()
    return _DEFAULT[path]
