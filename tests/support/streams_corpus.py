"""A corpus of hostile capture records, one per class, for the hostile streams tests.

Each entry is ``(class name, capture kind, key, value, headers)``; every record is for
its own thread of owner ``bad`` (unless the class is about the key or the owner), so a
valid thread published after them is untouched. Ids are pseudonyms and records are
sealed (:mod:`tests.support.sealing`), as the runtime publisher writes them.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from hebrus_flywheel.streams.routes import pack_routes
from tests.support.sealing import thread_pseudonym
from tests.support.streams_synthetic import (
    ProducerClock,
    ThreadSpec,
    encode_message,
    thread_messages,
)

Entry = tuple[str, str, bytes | None, bytes, list[tuple[str, bytes]]]
BIG = 900_000
INFLATED = 64 * 1024 * 1024
ZSTD_CLASSES = frozenset({"zstd_inflates_64mb"})
"""Classes published with ``compression.type=zstd`` (see the corpus test)."""
STRING_FIELDS = ("owner", "thread", "sequence_id", "identity_id", "producer_id")


def _routes(ids: Any, weights: Any, **kw: Any) -> dict[str, Any]:
    return pack_routes(np.asarray(ids, dtype=np.int64),
                       np.asarray(weights, dtype=np.float32), **kw)


class Corpus:
    """Builds the hostile entries around one valid observation of ``identity``."""

    def __init__(self, identity: dict[str, Any]) -> None:
        self.identity = identity
        self.clock = ProducerClock(producer_id="hostile", counter=1000)
        msgs = list(thread_messages(ThreadSpec(owner="bad", thread="base"), identity,
                                    ProducerClock(producer_id="base")))
        self.obs = next(m[2] for m in msgs if m[0] == "observations")
        self.layers, self.k = identity["routed_layer_count"], identity["top_k"]
        self.entries: list[Entry] = []

    def observation(self, name: str, **fields: Any) -> dict[str, Any]:
        rec = copy.deepcopy(self.obs)
        rec.update({"thread": thread_pseudonym("bad", name), "counter": self.clock.next(),
                    **fields})
        return rec

    def add(self, name: str, record: dict[str, Any], *, key: bytes | None = None,
            kind: str = "observations",
            edit: Callable[[bytes, list[tuple[str, bytes]]], tuple[bytes, list[Any]]]
            | None = None) -> None:
        value, headers = encode_message(kind, record)
        headers = list(headers)
        if edit is not None:
            value, headers = edit(value, headers)
        if key is None:
            key = f"{record.get('owner', 'bad')}/{record.get('thread', name)}".encode()
        self.entries.append((name, kind, key, value, headers))

    def raw(self, name: str, value: bytes, key: bytes | None = b"bad/raw",
            headers: list[tuple[str, bytes]] | None = None) -> None:
        self.entries.append((name, "observations", key, value, headers or []))


def _bytes_classes(c: Corpus) -> None:
    good, headers = encode_message("observations", c.observation("bytes"))
    rng = random.Random(20)
    c.raw("empty", b"")
    c.raw("truncated", good[: len(good) // 2], headers=list(headers))
    c.raw("random_bytes", bytes(rng.getrandbits(8) for _ in range(512)))
    c.raw("wrong_magic", b"\x00\x00" + good[2:], headers=list(headers))
    c.raw("unknown_fingerprint", good[:2] + b"\xff" * 8 + good[10:], headers=list(headers))
    flipped = bytearray(good)
    flipped[12] ^= 0xFF
    c.raw("flipped_byte", bytes(flipped), headers=list(headers))
    c.raw("random_900kb", rng.randbytes(BIG))
    c.raw("compressible_1_8mb", good[:10] + b"\x00" * 1_800_000, headers=list(headers))
    # a few KiB on the wire, 64 MiB once the consumer inflates its batch
    c.raw("zstd_inflates_64mb", good[:10] + b"\x00" * (INFLATED - 10), key=b"bad/zstd",
          headers=list(headers))


def _header_classes(c: Corpus) -> None:
    c.add("header_900kb", c.observation("header_900kb"),
          edit=lambda v, h: (v, [*h, ("x-big", b"h" * BIG)]))
    c.add("headers_1000", c.observation("headers_1000"),
          edit=lambda v, h: (v, [*h, *((f"x-{i}", b"v") for i in range(1000))]))
    c.add("future_version_header", c.observation("future_version"),
          edit=lambda v, h: (v, [(k, b"99" if k == "schema-version" else x) for k, x in h]))


def _key_classes(c: Corpus) -> None:
    c.entries.append(("null_key", "observations", None,
                      *encode_message("observations", c.observation("null_key"))))
    c.add("key_mismatch", c.observation("key_mismatch"), key=b"someone/else")
    c.add("slash_key", c.observation("slash_key"), key=b"/")
    c.add("key_900kb", c.observation("key_900kb"), key=b"k" * BIG)


def _route_classes(c: Corpus) -> None:
    ids = np.frombuffer(c.obs["expert_ids"], "<i2").reshape(c.layers, c.k).astype(np.int64)
    w = np.frombuffer(c.obs["weights"], "<f4").reshape(c.layers, c.k).copy()
    bad_ids = ids.copy()
    bad_ids[0, 0] = 9999
    c.add("expert_9999", c.observation("expert_9999", **_routes(bad_ids, w)))
    for name, val in (("nan_weight", np.nan), ("inf_weight", np.inf), ("negative_weight", -0.5)):
        ww = w.copy()
        ww[0, 0] = val
        c.add(name, c.observation(name, **_routes(ids, ww)))
    c.add("wrong_k", c.observation("wrong_k", **_routes(ids[:, :-1], w[:, :-1])))
    c.add("top_k_0", c.observation("top_k_0", **_routes(ids[:, :0], w[:, :0])))
    dup = ids.copy()
    dup[0, 1] = dup[0, 0]
    c.add("duplicate_expert", c.observation("duplicate_expert", **_routes(dup, w)))
    c.add("negative_ordinal", c.observation("negative_ordinal", token_ordinal=-1))
    c.add("layer_999", c.observation("layer_999", **_routes(
        ids, w, layers=[*range(c.layers - 1), 999])))
    many = np.tile(ids[:1], (10_000, 1))
    c.add("layers_10000", c.observation("layers_10000", **_routes(
        many, np.tile(w[:1], (10_000, 1)))))


def _state_classes(c: Corpus) -> None:
    c.add("counter_regression", c.observation("counter_regression"))
    regress = c.observation("counter_regression", token_ordinal=c.obs["token_ordinal"] + 1)
    regress["counter"] = 1
    c.add("counter_regression", regress)
    first = c.observation("conflicting_ordinal")
    c.add("conflicting_ordinal", first)
    other = copy.deepcopy(first)
    other.update(counter=c.clock.next(), token_id=int(first["token_id"]) + 1)
    c.add("conflicting_ordinal", other)
    forged = {**c.identity, "runtime_name": "forged"}
    c.add("forged_identity", forged, kind="identities", key=c.identity["identity_id"].encode())
    for name in STRING_FIELDS:
        c.add(f"string_900kb_{name}", c.observation(f"s_{name}", **{name: "s" * BIG}),
              key=b"bad/s_" + name.encode())


def hostile_corpus(identity: dict[str, Any]) -> list[Entry]:
    """Every hostile class; two-record classes (a valid record, then its offender)
    list the valid one first under the same name."""
    c = Corpus(identity)
    for build in (_bytes_classes, _header_classes, _key_classes, _route_classes,
                  _state_classes):
        build(c)
    return c.entries
