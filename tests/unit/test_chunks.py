"""Chunked observations (``RouteObservationChunk.v1``): codec, seal, checks, and the stream
workers' capture stage cutting the same windows from chunks as from per-token records."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams import chunks
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from hebrus_flywheel.streams.publisher.batching import ChunkRuns, Run, signature
from hebrus_flywheel.streams.sealing import CaptureOpener, SealingError
from tests.support.chunks import chunk_record, chunked, encode_chunk
from tests.support.sealing import session_keys
from tests.support.streams_synthetic import (
    ProducerClock,
    Scenario,
    ThreadSpec,
    encode_message,
    make_identity,
    random_specs,
    thread_messages,
)

IDENTITY = make_identity(layers=4, experts=64, top_k=4)


def _observations(spec: ThreadSpec) -> list[dict[str, Any]]:
    return [r for k, _, r in thread_messages(spec, IDENTITY, ProducerClock())
            if k == "observations"]


def _run(records: list[dict[str, Any]]) -> Run:
    first = records[0]
    ids = (first["owner"], first["thread"], first["sequence_id"])
    run = Run(ids, first, 0.0, signature(first, ids))
    for record in records:
        run.append(record)
    return run


def _header_of(value: bytes) -> dict[str, Any]:
    return codec.decode(value)[1]


# -- codec and seal -----------------------------------------------------------------------


def test_a_chunk_opens_into_exactly_its_tokens_observations() -> None:
    records = _observations(ThreadSpec(owner="owner-c", thread="thread-c",
                                       turns=(("user", 3), ("assistant", 9))))
    schema, chunk = codec.decode(encode_chunk(_run(records), counter=77))
    assert schema.name == chunks.CHUNK_NAME
    assert chunk["token_count"] == len(records)
    assert chunk["first_ordinal"] == records[0]["token_ordinal"] == 8
    assert "token_id" not in chunk and "expert_ids" not in chunk
    opened = CaptureOpener(session_keys()).open_chunk(chunk)
    assert len(opened) == len(records)
    for got, want in zip(opened, records, strict=True):
        for name in ("owner", "thread", "sequence_id", "turn_index", "token_ordinal",
                     "token_id", "layers", "stages", "top_k", "expert_ids", "weights",
                     "identity_id", "producer_id"):
            assert got[name] == want[name], name
        assert got["counter"] == 77 and got["speculative"] is None


def test_a_sealed_payload_does_not_open_in_another_chunk() -> None:
    records = _observations(ThreadSpec(owner="owner-c", thread="thread-c"))
    _, chunk = codec.decode(encode_chunk(_run(records), counter=1))
    opener = CaptureOpener(session_keys())
    for change in ({"first_ordinal": chunk["first_ordinal"] + 1},
                   {"turn_index": chunk["turn_index"] + 2}, {"stages": [1, 0, 0, 0]}):
        with pytest.raises(SealingError) as info:
            opener.open_chunk({**chunk, **change})
        assert info.value.reason == "sealed_field_invalid"


@pytest.mark.parametrize(("change", "detail"), [
    ({"token_count": 0}, "token_count=0"),
    ({"token_count": chunks.MAX_CHUNK_TOKENS + 1}, "token_count="),
    ({"first_ordinal": -1}, "leave [0, 2**63)"),
    ({"stages": [0, 0]}, "stages for 4 layers"),
])
def test_header_checks_name_the_problem(change: dict[str, Any], detail: str) -> None:
    records = _observations(ThreadSpec(owner="owner-c", thread="thread-c"))
    _, chunk = codec.decode(encode_chunk(_run(records), counter=1))
    with pytest.raises(chunks.ChunkError) as info:
        chunks.check_chunk({**chunk, **change})
    assert info.value.reason == "chunk_malformed" and detail in info.value.detail


# -- batching -----------------------------------------------------------------------------


def test_runs_close_on_size_gap_turn_change_and_age() -> None:
    records = _observations(ThreadSpec(owner="owner-c", thread="thread-c",
                                       turns=(("user", 3), ("assistant", 9))))
    ids = ("o", "t", "s")
    runs = ChunkRuns(max_tokens=4, max_ms=100.0)
    closed = [run for record in records[:6] for run in runs.add(ids, record, 0.0)]
    assert [len(r) for r in closed] == [4] and runs.buffered == 2
    # a gap in the ordinals closes the open run
    assert [len(r) for r in runs.add(ids, records[7], 0.0)] == [2]
    # another turn of the same thread closes it too
    assert [len(r) for r in runs.add(ids, {**records[8], "turn_index": 3}, 0.0)] == [1]
    assert runs.pop_due(0.05) == [] and [len(r) for r in runs.pop_due(0.1)] == [1]
    assert runs.buffered == 0 and runs.pop_all() == []


def test_pop_thread_returns_only_that_threads_run() -> None:
    records = _observations(ThreadSpec(owner="owner-c", thread="thread-c"))
    runs = ChunkRuns(max_tokens=64, max_ms=1000.0)
    runs.add(("o", "t1", "s"), records[0], 0.0)
    runs.add(("o", "t2", "s"), records[0], 0.0)
    run = runs.pop_thread("o", "t1")
    assert run is not None and run.header["thread"] == "t1" and runs.buffered == 1
    assert runs.pop_thread("o", "t1") is None


# -- the capture stage --------------------------------------------------------------------


def _pipeline_windows(encoded: list[tuple[str, bytes, bytes]]) -> LocalPipeline:
    sc = Scenario(LocalPipeline(ProcessorConfig()), identity=IDENTITY)
    sc.publish_identity()
    for kind, key, value in encoded:
        sc.send(kind, key, value=value)
    sc.pipeline.flush()
    return sc.pipeline


def _messages(n_threads: int) -> list[Any]:
    clock = ProducerClock(producer_id="runtime-eq")
    out: list[Any] = []
    for spec in random_specs(n_threads, n_owners=3, seed=5, assistant_tokens=30):
        out.extend(thread_messages(spec, IDENTITY, clock))
    return out


@pytest.mark.parametrize("max_tokens", [2, 7, 64])
def test_chunks_and_per_token_records_cut_identical_windows(max_tokens: int) -> None:
    messages = _messages(6)
    per_token = [(k, key, encode_message(k, copy.deepcopy(r))[0]) for k, key, r in messages]
    as_chunks = chunked(copy.deepcopy(messages), max_tokens=max_tokens)
    assert sum(k == "observations" for k, _, _ in as_chunks) < sum(
        k == "observations" for k, _, _ in per_token)
    a, b = _pipeline_windows(per_token), _pipeline_windows(as_chunks)
    assert a.quarantined == [] and b.quarantined == []
    assert len(a.windows) >= 6
    assert [w["window_id"] for w in a.windows] == [w["window_id"] for w in b.windows]
    assert a.windows == b.windows


def _forged(records: list[dict[str, Any]], *, corrupt: int | None = None,
            payload_cut: int = 0) -> bytes:
    run = _run(records)
    header = run.chunk_header(records[-1]["counter"])
    payload = run.payload()
    if corrupt is not None:  # expert id 999 (> 64 experts) in token `corrupt`, row 0
        ids = np.frombuffer(payload, "<u2", offset=4 * len(run)).copy()
        ids[corrupt * 4 * 4] = 999
        payload = payload[:4 * len(run)] + ids.tobytes() + payload[4 * len(run) + ids.nbytes:]
    return chunk_record(header, payload[:len(payload) - payload_cut])


def _spec_messages() -> tuple[list[Any], list[dict[str, Any]]]:
    spec = ThreadSpec(owner="owner-m", thread="thread-m", turns=(("user", 3), ("assistant", 6)))
    messages = list(thread_messages(spec, IDENTITY, ProducerClock()))
    return messages, [r for k, _, r in messages if k == "observations"]


@pytest.mark.parametrize(("forge", "reason", "detail"), [
    ({"corrupt": 3}, "expert_id_out_of_range", "token 3 of 7"),
    ({"payload_cut": 6}, "chunk_malformed", "the payload holds"),
])
def test_a_malformed_chunk_is_quarantined_whole(forge: dict[str, Any], reason: str,
                                                detail: str) -> None:
    messages, records = _spec_messages()
    key = messages[0][1]
    encoded = [(k, key, encode_message(k, r)[0]) for k, _, r in messages if k != "observations"]
    pipeline = _pipeline_windows([encoded[0], ("observations", key, _forged(records, **forge)),
                                  encoded[1]])
    (q,) = [q for q in pipeline.quarantined if q["stage"] == "validate"]
    assert q["reason"] == reason and detail in q["detail"]
    assert q["schema"] == chunks.CHUNK_V1
    # none of its tokens was applied: the thread has no routes, so no window is cut
    assert pipeline.windows == []


def test_a_chunk_that_repeats_an_ordinal_is_refused_whole_and_redelivery_is_idempotent(
) -> None:
    messages, records = _spec_messages()
    key = messages[0][1]
    sc = Scenario(LocalPipeline(ProcessorConfig()), identity=IDENTITY)
    sc.publish_identity()
    first = encode_chunk(_run(records[:5]), counter=records[4]["counter"])
    sc.send("observations", key, value=first)
    part, offset = next((p, o - 1) for (k, p), o in sc.feeder.offsets.items()
                        if k == "observations")
    # the same message again at the same offset (a redelivery): nothing changes
    sc.pipeline.feed("observations", part, offset, key, first)
    assert sc.pipeline.quarantined == []
    assert sc.pipeline.counters.get("assemble", "redelivered") == 1
    # ordinals 10..13 overlap the first chunk's 8..12 at a new offset: refused whole
    overlap = encode_chunk(_run(records[2:6]), counter=records[-1]["counter"] + 1)
    sc.send("observations", key, value=overlap)
    (q,) = sc.pipeline.quarantined
    assert q["reason"] == "duplicate_ordinal" and "token 0 of 4 of a chunk" in q["detail"]
    # the thread completes once the rest arrives in a chunk that continues the first
    rest = encode_chunk(_run(records[5:]), counter=records[-1]["counter"] + 2)
    sc.send("observations", key, value=rest)
    for kind, k, record in messages:
        if kind == "transcripts":
            sc.send(kind, k, record)
    sc.pipeline.flush()
    assert len(sc.pipeline.quarantined) == 1 and len(sc.pipeline.windows) >= 1


def test_a_clean_chunk_is_stored_as_one_run_and_mixes_with_single_tokens() -> None:
    messages, records = _spec_messages()
    key = messages[0][1]
    per_token = [(k, key, encode_message(k, copy.deepcopy(r))[0]) for k, _, r in messages]
    turns = [m for m in per_token if m[0] != "observations"]
    singles = [m for m in per_token if m[0] == "observations"][:3]
    run = ("observations", key, encode_chunk(_run(records[3:]), counter=records[-1]["counter"]))
    sc = Scenario(LocalPipeline(ProcessorConfig()), identity=IDENTITY)
    sc.publish_identity()
    for kind, k, value in [turns[0], *singles, run]:
        sc.send(kind, k, value=value)
    store = sc.pipeline.capture.store
    runs = [k for k in store if k.startswith("o\x1f") and "\x1fr" in k]
    singles_stored = [k for k in store if k.startswith("o\x1f") and "\x1fr" not in k]
    (header,) = [v for k, v in store.items() if k.startswith("h\x1f")]
    # a generation without route payloads holds its run in its header, the others a key
    held = list(header.get("run_values") or {})
    assert len(runs) + len(held) == 1 and bool(held) == (not header["routes_kept"])
    assert len(singles_stored) == 3  # 3 tokens, then one run of the rest
    assert header["runs"] == [[records[3]["token_ordinal"], len(records) - 3]]
    sc.send(turns[1][0], turns[1][1], value=turns[1][2])
    sc.pipeline.flush()
    mixed, reference = sc.pipeline, _pipeline_windows(per_token)
    assert mixed.quarantined == [] and reference.quarantined == []
    assert mixed.windows and mixed.windows == reference.windows
    # the finished thread's content is gone: no single token nor run is left behind
    assert not [k for k in store if k.startswith(("o\x1f", "t\x1f"))]
