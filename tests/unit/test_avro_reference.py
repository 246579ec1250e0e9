"""Cross-check the codec against the Apache ``avro`` reference library.

The body after the 10-byte single-object header must be plain Avro binary that the
reference reader decodes, and our fingerprints must be the CRC-64-AVRO the reference
computes. Our schemas carry no logical types on purpose: for a primitive with a
``logicalType`` the Python reference library writes ``{"type":"long"}`` into the parsing
canonical form where Java, Rust and fastavro write ``"long"``, so fingerprints would
disagree between readers.
"""

from __future__ import annotations

import io
from typing import Any

import avro.io
import avro.schema
import numpy as np
import pytest
from fastavro.utils import generate_many

from hebrus_flywheel.schemas.codec import decode, encode
from hebrus_flywheel.schemas.registry import HEADER_SIZE, SchemaEntry, default_registry
from hebrus_flywheel.streams.routes import pack_routes

_ENTRIES = {f"{e.short_name}.v{e.key.version}": e for e in default_registry()}
"""Every kept version of every schema (RouteObservation.v1 and .v2 both)."""


def _samples(entry: SchemaEntry, count: int = 25) -> list[dict[str, Any]]:
    """Random schema-valid records (full int/long ranges, unions both ways), normalised
    through our codec once so floats are exact float32 values."""
    return [decode(encode(entry.key, r))[1] for r in generate_many(entry.plain, count)]


def _reference(entry: SchemaEntry) -> avro.schema.Schema:
    return avro.schema.parse(entry.path.read_text())


def _crc64(data: bytes) -> bytes:
    """The reference library's Rabin fingerprint of arbitrary bytes (8 bytes, LE)."""
    fn = getattr(avro.schema, "_crc_64_fingerprint", None)
    if fn is None:
        pytest.skip("this avro version does not expose its CRC-64-AVRO function")
    return bytes(fn(data))


@pytest.mark.parametrize("name", sorted(_ENTRIES))
def test_reference_reader_decodes_our_body(name: str) -> None:
    entry = _ENTRIES[name]
    reader = avro.io.DatumReader(_reference(entry))
    for record in _samples(entry):
        data = encode(entry.key, record)
        body = io.BytesIO(data[HEADER_SIZE:])
        decoded = reader.read(avro.io.BinaryDecoder(body))
        assert body.tell() == len(data) - HEADER_SIZE
        assert decoded == record


@pytest.mark.parametrize("name", sorted(_ENTRIES))
def test_reference_rabin_of_our_canonical_form_is_our_fingerprint(name: str) -> None:
    entry = _ENTRIES[name]
    assert _crc64(entry.canonical_form.encode()) == entry.fingerprint


@pytest.mark.parametrize("name", sorted(_ENTRIES))
def test_reference_canonical_form_and_fingerprint_equal_ours(name: str) -> None:
    """No schema uses logical types, so the Python reference agrees with Java and fastavro."""
    entry = _ENTRIES[name]
    ref = _reference(entry)
    assert "logicalType" not in entry.path.read_text()
    assert ref.canonical_form == entry.canonical_form
    assert bytes(ref.fingerprint("CRC-64-AVRO")) == entry.fingerprint


@pytest.mark.parametrize("name", sorted(_ENTRIES))
def test_reference_writer_bytes_equal_ours(name: str) -> None:
    entry = _ENTRIES[name]
    writer = avro.io.DatumWriter(_reference(entry))
    for record in _samples(entry, 10):
        ours = encode(entry.key, record)[HEADER_SIZE:]
        out = io.BytesIO()
        writer.write(record, avro.io.BinaryEncoder(out))
        assert out.getvalue() == ours


def test_every_kept_version_is_cross_checked() -> None:
    assert {"RouteObservation.v1", "RouteObservation.v2"} <= set(_ENTRIES)


def test_reference_reader_unpacks_v2_routes_we_packed() -> None:
    """The packed layout is plain Avro bytes: the reference reader returns them untouched,
    and numpy reads them back to the arrays the runtime packed."""
    entry = _ENTRIES["RouteObservation.v2"]
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(512, 10, replace=False) for _ in range(48)]).astype(np.uint16)
    weights = np.sort(rng.random((48, 10)), axis=1)[:, ::-1].astype(np.float32)
    record = {
        "owner": "o", "thread": "t", "generation": 0, "sequence_id": "s", "turn_index": 1,
        "token_ordinal": 7, "token_id": 5, "identity_id": "i", "speculative": None,
        **pack_routes(ids, weights, stages=[i // 24 for i in range(48)]),
        "producer_id": "p", "counter": 1, "wall_time_ms": 1_767_000_000_000,
    }
    data = encode(entry.key, record)
    body = io.BytesIO(data[HEADER_SIZE:])
    decoded = avro.io.DatumReader(_reference(entry)).read(avro.io.BinaryDecoder(body))
    assert decoded == record
    got_ids = np.frombuffer(decoded["expert_ids"], dtype="<u2").reshape(48, decoded["top_k"])
    got_w = np.frombuffer(decoded["weights"], dtype="<f4").reshape(48, decoded["top_k"])
    assert np.array_equal(got_ids, ids) and np.array_equal(got_w, weights)
    assert decoded["layers"] == list(range(48)) and decoded["stages"][24] == 1
