"""The processor tables' state codec: exact round trips, and no code run on decode."""

from __future__ import annotations

import base64
import json
import os
import pickle
import tomllib
from pathlib import Path
from typing import Any

import msgpack
import pytest

from hebrus_flywheel.streams.processors.pipeline import LocalPipeline
from hebrus_flywheel.streams.processors.state_codec import (
    EXT_BIGINT,
    EXT_SEALED,
    EXT_TUPLE,
    MAGIC,
    SealedState,
    StateDecodeError,
    StateEncodeError,
    dumps,
    loads,
)
from tests.support.streams_corpus import hostile_corpus
from tests.support.streams_synthetic import Scenario, random_specs

SAMPLES: list[Any] = [
    None, True, 0, -(2**70), 1.5, float("inf"), "", "é\x1f\x00",
    b"", b"\x00\xff" * 5, [1, [2, (3, b"x")]], (), ("a", 1, None, (2.5,)),
    {"a": 1, "wm": {"transcripts": 4}, "seq": {7: 3, "s": 2}},
    {"$tuple": [1]}, {"$bytes": "AA=="}, {"$map": []}, {"$other": 1},
    {(1, 2): "tuple key", 3: {b"k": []}},
    {"outbox": [("summary", "o/t", {"minhash": [1, 2], "tags": []})]},
]


@pytest.mark.parametrize("value", SAMPLES, ids=range(len(SAMPLES)))
def test_values_round_trip_type_for_type(value: Any) -> None:
    back = loads(dumps(value))
    assert back == value
    assert _types(back) == _types(value)
    assert loads(dumps(back)) == back


def _types(value: Any) -> Any:
    if isinstance(value, dict):
        return ("dict", [(_types(k), _types(v)) for k, v in value.items()])
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_types(v) for v in value])
    return type(value).__name__


def test_records_are_messagepack_after_the_magic_bytes() -> None:
    data = dumps({"t": (1, b"\x01")})
    assert data[:2] == MAGIC
    body = msgpack.unpackb(data[2:], raw=False, ext_hook=lambda code, raw: (code, raw))
    assert body == {"t": (EXT_TUPLE, msgpack.packb([1, b"\x01"], use_bin_type=True))}


def test_bytes_are_carried_as_they_are() -> None:
    payload = os.urandom(250_000)  # a chunk's routes: no base64, no text escaping
    data = dumps({"ids": payload})
    assert len(data) < len(payload) + 32 and payload in data
    assert loads(data)["ids"] == payload


@pytest.mark.parametrize("value", SAMPLES, ids=range(len(SAMPLES)))
def test_records_of_older_workers_still_decode(value: Any) -> None:
    """Changelogs written before MessagePack hold tagged JSON: a home restores across it."""
    assert loads(_legacy_json(value)) == value


def _legacy_json(value: Any) -> bytes:
    def enc(obj: Any) -> Any:
        if isinstance(obj, tuple):
            return {"$tuple": [enc(v) for v in obj]}
        if isinstance(obj, bytes):
            return {"$bytes": base64.b64encode(obj).decode()}
        if isinstance(obj, list):
            return [enc(v) for v in obj]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and not (
                    len(obj) == 1 and next(iter(obj)).startswith("$")):
                return {k: enc(v) for k, v in obj.items()}
            return {"$map": [[enc(k), enc(v)] for k, v in obj.items()]}
        return obj
    return json.dumps(enc(value)).encode()


def test_sealed_state_round_trips_from_both_formats() -> None:
    sealed = SealedState(owner="o", generation=3, body=b"\x00cipher")
    assert loads(dumps(sealed)) == sealed
    legacy = b'{"$sealed": {"o": "o", "g": 3, "c": {"$bytes": "AGNpcGhlcg=="}}}'
    assert loads(legacy) == sealed


def _record(obj: Any) -> bytes:
    return MAGIC + msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("data", [
    _record(msgpack.Timestamp(1, 2)),  # MessagePack's own extension: a class of its own
    _record(msgpack.ExtType(9, b"")),  # an extension the codec does not define
    _record([msgpack.ExtType(EXT_TUPLE, b"\x01")]),  # a tuple that is not an array
    _record(msgpack.ExtType(EXT_BIGINT, b"12a")),
    _record(msgpack.ExtType(EXT_SEALED, msgpack.packb(["o", "3", b""]))),
    _record(1) + b"\x00",  # trailing bytes
    MAGIC + b"\x93\x01",  # truncated
    MAGIC + bytes([0x81, 0x91, 0x01, 0x02]),  # a map keyed by an array (unhashable)
    MAGIC + b"\x91" * 5000 + b"\x01",  # nested deeper than the unpacker allows
], ids=["timestamp", "unknown-ext", "tuple-not-array", "bigint-not-digits",
        "sealed-bad-generation", "trailing", "truncated", "unhashable-key", "deep"])
def test_malformed_messagepack_records_are_refused(data: bytes) -> None:
    with pytest.raises(StateDecodeError):
        loads(data)


def test_nested_extensions_are_refused_not_a_crash() -> None:
    """Each extension is unpacked by a nested call: thousands of them nested would overflow
    the C stack (a segmentation fault) without the codec's depth bound."""
    data = msgpack.packb(1)
    for _ in range(5000):
        data = msgpack.packb(msgpack.ExtType(EXT_TUPLE, b"\x91" + data))
    with pytest.raises(StateDecodeError, match="nested"):
        loads(MAGIC + data)


@pytest.mark.parametrize("value", [
    {1, 2}, object(), {"a": Path("/")}, bytearray(b"x"),
    {"a": 1, "b": {"c": [1, memoryview(b"x")]}},  # nested under plain keys and values
    [1, "s", {"k": [2.0, None, {"deep": bytearray(b"y")}]}],
    {("t", 1): {"v": b"ok", "w": frozenset()}},
])
def test_other_types_are_refused_on_write(value: Any) -> None:
    with pytest.raises(StateEncodeError, match="state codec carries only"):
        dumps(value)


class _Marker:
    """Unpickling this creates a file: the visible side effect a pickle codec would run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_a_pickle_payload_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Marker(marker), protocol=5)
    for data in (payload, pickle.dumps(_Marker(marker), protocol=0)):
        with pytest.raises(StateDecodeError, match="not a state-codec record"):
            loads(data)
    assert not marker.exists()
    pickle.loads(payload)
    assert marker.exists()


@pytest.mark.parametrize("data", [b"", b"{", b'{"$tuple": 1}', b'{"$bytes": "***"}',
                                  b'{"$map": [[1]]}', b'{"$map": [[[1], 2]]}',
                                  b"[" * 100_000])
def test_malformed_records_are_refused(data: bytes) -> None:
    with pytest.raises(StateDecodeError):
        loads(data)


class RestoredStore(dict[str, Any]):
    """A table store that keeps what a restore would give back: every value written
    passes through the codec (as it does on its way to the changelog)."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, loads(dumps(value)))


def _run(restored: bool, corpus: list[Any]) -> LocalPipeline:
    pipeline = LocalPipeline()
    if restored:
        pipeline.capture_store = RestoredStore()
        pipeline.dedup_store = RestoredStore()
        pipeline.reconfigure(pipeline.config)
    scenario = Scenario(pipeline)
    scenario.publish_identity()
    for spec in random_specs(12, seed=5):
        scenario.send_thread(spec)
    for _, kind, key, value, headers in corpus:
        pipeline.feed(kind, 1, 10_000 + len(pipeline.quarantined), key, value, headers)
    for spec in random_specs(3, seed=6):  # left open: idle completion on the tick below
        messages = scenario.messages(spec)
        for kind, key, record in messages[:-1]:
            scenario.send(kind, key, record)
    for partition in range(4):
        pipeline.tick(partition, 10**13)
    pipeline.flush()
    return pipeline


def _unsealed(quarantined: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Quarantine records without the refused bytes: each run seals its records with
    fresh nonces, so copied values differ while everything else must not."""
    return [{k: v for k, v in q.items() if k not in ("value", "value_sha256")}
            for q in quarantined]


def test_the_pipeline_behaves_the_same_on_restored_state() -> None:
    # one corpus for both runs: sealing draws fresh nonces, and quarantine records copy
    # the bytes they refused
    corpus = list(hostile_corpus(Scenario(LocalPipeline()).identity))
    plain, restored = _run(False, corpus), _run(True, corpus)
    assert plain.windows and plain.decisions and plain.quarantined
    assert restored.windows == plain.windows
    assert restored.decisions == plain.decisions
    assert _unsealed(restored.quarantined) == _unsealed(plain.quarantined)
    assert restored.counters.as_dict() == plain.counters.as_dict()


def test_no_package_source_mentions_pickle() -> None:
    """``grep -rn pickle`` over the packages finds nothing (issue 12)."""
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    dirs = set(config["tool"]["setuptools"]["package-dir"].values())
    assert {"flywheel", "streams", "core"} <= dirs
    found = [f"{path.relative_to(root)}:{n}"
             for d in sorted(dirs) for path in sorted((root / d).rglob("*"))
             if path.is_file() and path.suffix not in {".pyc", ".parquet"}
             for n, line in enumerate(path.read_bytes().splitlines(), 1) if b"pickle" in line]
    assert found == []
