"""Avro single-object codec: round trips, header bytes, failure modes, schema versions."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastavro.utils import generate_many

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.core.identity import with_identity_id
from hebrus_flywheel.schemas.codec import (
    CONTENT_TYPE,
    decode,
    decode_message,
    encode,
    kafka_headers,
    read_kafka_headers,
    writer_entry,
)
from hebrus_flywheel.schemas.exceptions import (
    RecordEncodeError,
    SchemaConflictError,
    SchemaError,
    SchemaHeaderError,
    SchemaNotFoundError,
    SchemaParseError,
    SchemaResolutionError,
    UndecodableRecordError,
    UnknownFingerprintError,
)
from hebrus_flywheel.schemas.registry import (
    HEADER_SIZE,
    SCHEMA_DIR,
    SchemaKey,
    SchemaRegistry,
    default_registry,
)
from hebrus_flywheel.streams.routes import pack_routes, route_arrays, to_v1

NS = "hebrus.flywheel.v1"


def identity() -> dict[str, Any]:
    return with_identity_id({
        "model_family": "qwen3_next", "model_artifact_digest": "a" * 64,
        "tokenizer_digest": "b" * 64, "chat_template_digest": "c" * 64, "dtype": "float32",
        "quantization": "none", "routed_layer_count": 4, "expert_count": 512, "top_k": 10,
        "tie_break_rule": "score_desc_then_expert_id_asc",
        "weight_rule": "softmax_topk_renormalized", "hidden_size": 64,
        "routed_intermediate_size": 32, "runtime_name": "hebrus", "runtime_version": "0.1",
        "routed_layers": [0, 1, 2, 3], "layer_count": 4,
        "kernel_path": "device=cpu;attention=sdpa;experts=tiled_mm",
    })


def test_identity_without_the_routed_layer_map_decodes_with_defaults_and_the_same_id() -> None:
    from hebrus_flywheel.core.identity import compute_identity_id

    old = with_identity_id({k: v for k, v in identity().items()
                            if k not in ("routed_layers", "layer_count", "kernel_path")})
    _key, back = decode(encode("RuntimeIdentity", old))
    assert back == {**old, "routed_layers": [], "layer_count": 0, "kernel_path": ""}
    assert compute_identity_id(back) == old["identity_id"]
    assert compute_identity_id(identity()) != old["identity_id"]


def test_identity_v3_records_the_kernel_path_and_a_v2_record_keeps_its_id() -> None:
    from hebrus_flywheel.core.identity import compute_identity_id

    path = identity()
    # no kernel_path: written before v3, or by a runtime that omits it
    v2 = with_identity_id({k: v for k, v in path.items() if k != "kernel_path"})
    _key, back = decode(encode("RuntimeIdentity.v3", v2))
    assert back["kernel_path"] == "" and compute_identity_id(back) == v2["identity_id"]
    assert path["identity_id"] != v2["identity_id"]
    _key, back = decode(encode("RuntimeIdentity.v3", path))
    assert back == path and compute_identity_id(back) == path["identity_id"]
    _key, old = decode(encode("RuntimeIdentity.v2", v2))  # v2 stays readable as written
    assert "kernel_path" not in old and compute_identity_id(old) == v2["identity_id"]


def turn() -> dict[str, Any]:
    return {
        "owner": "o1", "thread": "t1", "turn_index": 0, "generation": 0, "sequence_id": "r1",
        "role": "user", "token_offset": 0, "token_ids": [1, 2, 3, 151_000],
        "segments": [{"kind": "header", "start": 0, "end": 1, "generated": False},
                     {"kind": "content", "start": 1, "end": 4, "generated": False}],
        "sampling": {"mode": "forced", "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                     "seed": -5, "max_new_tokens": 16},
        "identity_id": "x" * 64, "domain_tags": ["code"], "closes_thread": False,
        "producer_id": "p", "counter": 7, "wall_time_ms": 1_767_000_000_123,
    }


def observation(speculative: bool = False) -> dict[str, Any]:
    """A RouteObservation.v2 record: routes packed as uint16 ids / float32 weights."""
    spec = {"proposal_id": "pr", "proposal_generation": 2, "candidate_position": 1,
            "accepted_prefix_digest": "d" * 64, "verifier_generation": 3, "accepted": True}
    ids = np.arange(4)[:, None] + np.arange(10)[None, :]
    weights = np.tile(0.5 ** np.arange(1, 11), (4, 1))
    return {
        "owner": "o1", "thread": "t1", "generation": 0, "sequence_id": "r1", "turn_index": 1,
        "token_ordinal": 9, "token_id": 42, "identity_id": "x" * 64,
        "speculative": spec if speculative else None,
        **pack_routes(ids, weights),
        "producer_id": "p", "counter": 8, "wall_time_ms": 1_767_000_000_456,
    }


def observation_v1(speculative: bool = False) -> dict[str, Any]:
    """The same observation in the v1 shape: one LayerRoute per layer."""
    return to_v1(observation(speculative))


RECORDS = {
    "RuntimeIdentity": identity,
    "TranscriptTurn.v1": turn,
    "RouteObservation.v2": observation,
    "RouteObservation.v2-speculative": lambda: observation(True),
    "RouteObservation.v1": observation_v1,
    "RouteObservation.v1-speculative": lambda: observation_v1(True),
}
VERSIONS = {"RouteObservation.v1": 1, "RouteObservation.v2": 2, "TranscriptTurn.v1": 1}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_round_trip_every_schema(name: str) -> None:
    record = RECORDS[name]()
    schema = name.split("-")[0]
    data = encode(schema, record)
    key, back = decode(data)
    short, version = schema.split(".v")[0], VERSIONS.get(schema, default_registry().get(
        schema).key.version)
    assert key == SchemaKey(f"{NS}.{short}", version)
    assert back == record
    if "wall_time_ms" in record:
        assert isinstance(back["wall_time_ms"], int)  # raw millis, not datetime


def test_every_kept_schema_file_loads_with_distinct_fingerprints() -> None:
    reg = default_registry()
    assert {e.path.name for e in reg} == {p.name for p in SCHEMA_DIR.glob("*.avsc")}
    assert len({e.fingerprint for e in reg}) == len(reg)


def test_header_is_magic_and_little_endian_fingerprint() -> None:
    entry = default_registry().get("RouteObservation.v2")
    data = encode("RouteObservation.v2", observation())
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == entry.fingerprint
    assert data[2:10] == struct.pack("<Q", entry.fingerprint_int)
    assert writer_entry(data) is entry


def test_schema_references_resolve_to_the_same_entry() -> None:
    reg = default_registry()
    entry = reg.get("TranscriptTurn")
    for ref in (f"{NS}.TranscriptTurn", "TranscriptTurn.v2", f"{NS}.TranscriptTurn.v2",
                SchemaKey(f"{NS}.TranscriptTurn", 2)):
        assert reg.get(ref) is entry
    assert reg.versions("TranscriptTurn") == [1, 2]
    for ref in ("Nope", "TranscriptTurn.v9", SchemaKey("x.Y", 1)):
        with pytest.raises(SchemaNotFoundError, match="known:"):
            reg.get(ref)


def test_unknown_fingerprint_names_the_hex_and_the_fix() -> None:
    data = b"\xc3\x01" + bytes.fromhex("0011223344556677") + b"\x00"
    with pytest.raises(UnknownFingerprintError, match="0011223344556677") as info:
        decode(data)
    assert ".avsc" in str(info.value)
    assert info.value.fingerprint == bytes.fromhex("0011223344556677")
    assert info.value.reason == "unknown_fingerprint"
    assert isinstance(info.value, UndecodableRecordError)
    assert isinstance(info.value, FlywheelError)


@pytest.mark.parametrize("cut", [0, 1, 5, 9, 10, 20, -1])
def test_truncated_messages_are_undecodable(cut: int) -> None:
    data = encode("RouteObservation.v2", observation())
    with pytest.raises(UndecodableRecordError):
        decode(data[:cut])


def test_wrong_magic_trailing_bytes_and_garbage_are_undecodable() -> None:
    data = encode("TranscriptTurn.v1", turn())
    with pytest.raises(UndecodableRecordError, match="magic"):
        decode(b"\x00\x01" + data[2:])
    with pytest.raises(UndecodableRecordError, match="trailing"):
        decode(data + b"\x00")
    with pytest.raises(UndecodableRecordError):
        decode(data[:10] + b"\xff" * 40)
    with pytest.raises(UndecodableRecordError, match="tombstone"):
        decode(None)  # type: ignore[arg-type]
    assert decode(memoryview(data))[1] == turn()


@pytest.mark.parametrize(("change", "field"), [
    ({"turn_index": "one"}, "turn_index"),
    ({"turn_index": 2**40}, "turn_index"),
    ({"token_id": True}, "token_id"),
    ({"extra": 1}, "extra"),
])
def test_encode_rejects_records_that_do_not_fit(change: dict[str, Any], field: str) -> None:
    record = {**observation(), **change}
    with pytest.raises(RecordEncodeError) as info:
        encode("RouteObservation.v2", record)
    assert info.value.field is not None and info.value.field.endswith(field)
    assert info.value.reason == "schema_violation"


def test_encode_names_missing_fields_and_unknown_schemas() -> None:
    record = observation()
    del record["layers"]
    with pytest.raises(RecordEncodeError, match="layers") as info:
        encode("RouteObservation.v2", record)
    assert info.value.field == "layers"
    with pytest.raises(SchemaNotFoundError):
        encode("NoSuchSchema", record)
    with pytest.raises(RecordEncodeError):
        encode("RouteObservation", ["not", "a", "mapping"])  # type: ignore[arg-type]


def test_unvalidated_encode_still_wraps_writer_errors() -> None:
    with pytest.raises(RecordEncodeError):
        encode("RouteObservation", {**observation(), "turn_index": "x"}, validate=False)


def test_kafka_headers_round_trip_and_mismatch() -> None:
    headers = kafka_headers("RouteObservation.v2")
    assert headers == [("schema", f"{NS}.RouteObservation".encode()),
                       ("schema-version", b"2"),
                       ("content-type", b"application/vnd.apache.avro.single-object")]
    parsed = read_kafka_headers(headers)
    assert parsed.key == SchemaKey(f"{NS}.RouteObservation", 2)
    assert parsed.content_type == CONTENT_TYPE
    data = encode("RouteObservation.v2", observation())
    assert decode_message(data, headers)[1] == observation()
    assert decode_message(data, dict(headers))[0] == parsed.key
    with pytest.raises(SchemaHeaderError, match="fingerprint"):
        decode_message(data, kafka_headers("TranscriptTurn.v1"))
    with pytest.raises(SchemaHeaderError, match="fingerprint"):  # v2 bytes, v1 headers
        decode_message(data, kafka_headers("RouteObservation.v1"))
    with pytest.raises(SchemaHeaderError, match="schema-version"):
        read_kafka_headers(headers[:1] + headers[2:])
    with pytest.raises(SchemaHeaderError):
        read_kafka_headers([*headers[:2], ("content-type", b"application/json")])
    with pytest.raises(SchemaHeaderError):
        read_kafka_headers(None)


def _observation_v3(path: Path) -> None:
    """A stand-in third RouteObservation version (replacing the kept, sealed v3): v2 plus
    ``runtime_note`` with a default."""
    schema = json.loads((SCHEMA_DIR / "RouteObservation.v2.avsc").read_text())
    schema["fields"].append({"name": "runtime_note", "type": "string", "default": "none"})
    (path / "RouteObservation.v3.avsc").write_text(json.dumps(schema))


@pytest.fixture
def three_versions(tmp_path: Path) -> SchemaRegistry:
    for src in SCHEMA_DIR.glob("*.avsc"):
        if src.name != "RouteObservation.v3.avsc":
            shutil.copy(src, tmp_path / src.name)
    _observation_v3(tmp_path)
    return SchemaRegistry(tmp_path)


def test_every_kept_observation_version_decodes_by_its_own_fingerprint() -> None:
    reg = default_registry()
    v1, v2 = reg.get("RouteObservation.v1"), reg.get("RouteObservation.v2")
    assert reg.get("RouteObservation") is reg.get("RouteObservation.v3")  # latest by default
    assert reg.versions("RouteObservation") == [1, 2, 3]
    old, new = encode("RouteObservation.v1", observation_v1()), encode(v2.key, observation())
    assert old[2:HEADER_SIZE] == v1.fingerprint and new[2:HEADER_SIZE] == v2.fingerprint
    assert decode(old) == (v1.key, observation_v1())
    assert decode(new) == (v2.key, observation())
    # the two shapes carry the same routes
    a, b = route_arrays(decode(old)[1]), route_arrays(decode(new)[1])
    assert np.array_equal(a.expert_ids, b.expert_ids) and np.array_equal(a.weights, b.weights)
    assert np.array_equal(a.layers, b.layers) and np.array_equal(a.stages, b.stages)


def test_v2_routes_are_packed_little_endian() -> None:
    record = decode(encode("RouteObservation.v2", observation()))[1]
    assert record["layers"] == [0, 1, 2, 3] and record["stages"] == [0] * 4
    assert record["top_k"] == 10
    assert len(record["expert_ids"]) == 4 * 10 * 2 and len(record["weights"]) == 4 * 10 * 4
    ids = np.frombuffer(record["expert_ids"], dtype="<u2").reshape(4, 10)
    assert ids[2].tolist() == list(range(2, 12))
    assert record["expert_ids"][:4] == b"\x00\x00\x01\x00"  # rank 0 first, little-endian
    weights = np.frombuffer(record["weights"], dtype="<f4").reshape(4, 10)
    assert weights[0, 0] == 0.5 and weights[3, 9] == 0.5**10


def test_later_version_resolves_by_its_own_fingerprint(three_versions: SchemaRegistry) -> None:
    reg = three_versions
    v2, v3 = reg.get("RouteObservation.v2"), reg.get("RouteObservation.v3")
    assert reg.get("RouteObservation") is v3  # latest by default
    assert v2.fingerprint != v3.fingerprint
    assert reg.versions("RouteObservation") == [1, 2, 3]
    new = encode("RouteObservation", {**observation(), "runtime_note": "hi"}, registry=reg)
    old = encode("RouteObservation.v2", observation(), registry=reg)
    assert old == encode("RouteObservation.v2", observation())  # v2 bytes are stable
    assert decode(new, registry=reg) == (v3.key, {**observation(), "runtime_note": "hi"})
    assert decode(old, registry=reg) == (v2.key, observation())
    # schema evolution: old bytes read as v3 get the default; new bytes read as v2 drop it
    assert decode(old, "RouteObservation.v3", registry=reg)[1]["runtime_note"] == "none"
    assert "runtime_note" not in decode(new, "RouteObservation.v2", registry=reg)[1]
    # a reader that only knows v1 and v2 refuses v3 bytes with the fix in the message
    with pytest.raises(UnknownFingerprintError, match=v3.fingerprint.hex()):
        decode(new)


def test_incompatible_reader_schema_raises_resolution_error(three_versions: SchemaRegistry
                                                            ) -> None:
    data = encode("TranscriptTurn.v1", turn(), registry=three_versions)
    with pytest.raises(SchemaResolutionError):
        decode(data, "RouteObservation.v3", registry=three_versions)
    v1_bytes = encode("RouteObservation.v1", observation_v1())
    with pytest.raises(SchemaResolutionError):  # layers changed type: no v1 -> v2 resolution
        decode(v1_bytes, "RouteObservation.v2")


@pytest.mark.parametrize(("name", "text", "error"), [
    ("RouteObservation.avsc", "{}", SchemaParseError),
    ("Thing.v1.avsc", "not json", SchemaParseError),
    ("Thing.v1.avsc", '{"type": "record", "name": "Other", "fields": []}', SchemaParseError),
    ("Thing.v1.avsc", '{"type": "record", "name": "Thing", "fields": [{"name": "a"}]}',
     SchemaParseError),
])
def test_bad_schema_files_fail_closed(tmp_path: Path, name: str, text: str,
                                      error: type[SchemaError]) -> None:
    shutil.copy(SCHEMA_DIR / "TranscriptTurn.v1.avsc", tmp_path)
    (tmp_path / name).write_text(text)
    with pytest.raises(error):
        SchemaRegistry(tmp_path)


def test_same_fingerprint_twice_is_a_conflict(tmp_path: Path) -> None:
    schema = json.loads((SCHEMA_DIR / "TranscriptTurn.v1.avsc").read_text())
    (tmp_path / "TranscriptTurn.v1.avsc").write_text(json.dumps(schema))
    schema["doc"] = "only the doc changed"
    (tmp_path / "TranscriptTurn.v2.avsc").write_text(json.dumps(schema))
    with pytest.raises(SchemaConflictError, match="identical bytes"):
        SchemaRegistry(tmp_path)


def test_empty_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match=r"no \.avsc"):
        SchemaRegistry(tmp_path)


@pytest.mark.parametrize("name", ["RuntimeIdentity", "TranscriptTurn", "RouteObservation.v1",
                                  "RouteObservation.v2"])
def test_random_schema_valid_records_round_trip_byte_exactly(name: str) -> None:
    entry = default_registry().get(name)
    for record in generate_many(entry.plain, 50):
        data = encode(name, record)
        key, back = decode(data)
        assert key == entry.key
        assert encode(name, back) == data


@pytest.mark.parametrize("version", [1, 2])
def test_corrupted_bytes_only_ever_raise_undecodable(version: int) -> None:
    record = observation(True) if version == 2 else observation_v1(True)
    data = encode(f"RouteObservation.v{version}", record)
    rng = random.Random(7)
    for _ in range(300):
        corrupt = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            corrupt[rng.randrange(HEADER_SIZE, len(corrupt))] = rng.randrange(256)
        if rng.random() < 0.3:
            corrupt = corrupt[: rng.randrange(len(corrupt))]
        with contextlib.suppress(UndecodableRecordError):  # anything else fails the test
            decode(bytes(corrupt))
