"""Validate stage: every quarantine reason with a crafted record; the worker never crashes."""

from __future__ import annotations

import copy
import hashlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.processors import assemble as asm
from hebrus_flywheel.streams.processors.assemble import AssembleConfig
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from hebrus_flywheel.streams.processors.validate import (
    NOT_PRODUCED_AFTER_DECODE,
    REASONS,
    WINDOW_ID_LIMIT,
    Rejection,
    ValidateConfig,
    check_observation,
    decode_capture,
)
from hebrus_flywheel.streams.routes import pack_routes, route_arrays, to_v1
from tests.support.sealing import owner_pseudonym, thread_key
from tests.support.streams_synthetic import (
    Scenario,
    ThreadSpec,
    encode_message,
    make_identity,
)

KEY = thread_key("owner-a", "thread-a")


def scenario(**config: Any) -> Scenario:
    sc = Scenario(LocalPipeline(ProcessorConfig(**config)))
    sc.publish_identity()
    return sc


def spec(**kw: Any) -> ThreadSpec:
    base: dict[str, Any] = {"owner": "owner-a", "thread": "thread-a"}
    base.update(kw)
    return ThreadSpec(**base)


def reasons(sc: Scenario) -> list[str]:
    return [q["reason"] for q in sc.pipeline.quarantined]


def first(sc: Scenario, kind: str, s: ThreadSpec | None = None) -> dict[str, Any]:
    return copy.deepcopy(next(r for k, _, r in sc.messages(s or spec()) if k == kind))


def refused(sc: Scenario, kind: str, record: dict[str, Any], key: bytes = KEY) -> list[str]:
    sc.send(kind, key, record)
    return reasons(sc)


def test_clean_thread_passes() -> None:
    sc = scenario()
    sc.send_thread(spec())
    assert reasons(sc) == []
    assert len(sc.pipeline.windows) == 1


def test_unknown_fingerprint() -> None:
    sc = scenario()
    value, _ = encode_message("observations", first(sc, "observations"))
    forged = value[:2] + b"\x01" * 8 + value[10:]
    sc.send("observations", KEY, value=forged)
    assert reasons(sc) == ["unknown_fingerprint"]
    q = sc.pipeline.quarantined[0]
    # not decoded, so not known to be sealed: where it is and its digest, no bytes
    assert q["value"] == b"" and q["reference_only"] and q["source_offset"] == 0
    assert q["value_sha256"] == hashlib.sha256(forged).hexdigest()


@pytest.mark.parametrize("value", [b"garbage", b"\xc3\x01"])
def test_undecodable(value: bytes) -> None:
    sc = scenario()
    sc.send("transcripts", KEY, value=value)
    assert reasons(sc) == ["undecodable"]


def test_truncated_body_is_undecodable() -> None:
    sc = scenario()
    value, _ = encode_message("observations", first(sc, "observations"))
    sc.send("observations", KEY, value=value[:-7])
    assert reasons(sc) == ["undecodable"]


def test_header_mismatch() -> None:
    sc = scenario()
    value, _ = encode_message("observations", first(sc, "observations"))
    part, offset = sc.feeder.place("observations", KEY)
    headers = codec.kafka_headers("TranscriptTurn")
    sc.pipeline.feed("observations", part, offset, KEY, value, headers=headers)
    assert reasons(sc) == ["header_mismatch"]


def test_unexpected_schema() -> None:
    sc = scenario()
    value, _ = encode_message("transcripts", first(sc, "transcripts"))
    sc.send("observations", KEY, value=value)
    assert reasons(sc) == ["unexpected_schema"]


def test_oversized() -> None:
    sc = scenario(validate=ValidateConfig(max_record_bytes=200, max_quarantine_value_bytes=50))
    record = first(sc, "observations")
    sc.send("observations", KEY, record)
    assert reasons(sc)[-1] == "oversized"  # (the identity record is oversized here too)
    q = sc.pipeline.quarantined[-1]
    assert q["reference_only"] and q["value"] == b"" and q["value_size"] > 200


@pytest.mark.parametrize("headers", [[("h", b"x" * 900_000)],
                                     [(f"h{i}", b"") for i in range(1000)]])
def test_too_many_or_too_large_headers(headers: list[tuple[str, bytes]]) -> None:
    sc = scenario()
    value, schema_headers = encode_message("observations", first(sc, "observations"))
    refused_ = decode_capture(value, [*schema_headers, *headers], kind="observations",
                              config=ValidateConfig())
    assert getattr(refused_, "reason", None) == "headers_too_large"
    fine = decode_capture(value, list(schema_headers), kind="observations",
                          config=ValidateConfig())
    assert getattr(fine, "reason", None) is None


def test_missing_field() -> None:
    sc = scenario()
    record = first(sc, "observations")
    record["producer_id"] = ""
    assert refused(sc, "observations", record) == ["missing_field"]


def test_key_mismatch() -> None:
    sc = scenario()
    assert refused(sc, "transcripts", first(sc, "transcripts"), key=b"other/key") == ["invalid_key"]


def test_unknown_identity() -> None:
    sc = Scenario(LocalPipeline())
    assert refused(sc, "transcripts", first(sc, "transcripts")) == ["unknown_identity"]


def test_identity_with_bad_digest_and_records_using_it() -> None:
    sc = scenario()
    bad = dict(make_identity(layers=4, experts=64, top_k=4, name="other"))
    bad["identity_id"] = "f" * 64
    sc.send("identities", bad["identity_id"].encode(), bad)
    record = first(sc, "transcripts")
    record["identity_id"] = bad["identity_id"]
    sc.send("transcripts", KEY, record)
    assert reasons(sc) == ["identity_digest_mismatch", "unknown_identity"]


def test_record_identity_differs_from_thread_identity() -> None:
    sc = scenario()
    other = make_identity(layers=4, experts=64, top_k=4, name="other-runtime")
    sc.publish_identity(other)
    messages = sc.messages(spec())
    sc.send(*messages[0])
    record = copy.deepcopy(messages[1][2])
    record["identity_id"] = other["identity_id"]
    # teachers sharing topics: a record of another identity belongs to that teacher's own
    # generation of the thread (common.instance_id), never to this teacher's one
    assert refused(sc, messages[1][0], record) == []
    assert len([k for k in sc.pipeline.capture_store if k.startswith("h")]) == 2
    # a header of older state (keyed without the identity) still refuses it
    header = asm.new_header(messages[0][2], 0)
    problem = asm._check_common(header, record)
    assert problem is not None and problem.reason == "identity_mismatch"


def _layer_mutation(sc: Scenario, mutate: Any) -> list[str]:
    """The validate stage's verdict on a RouteObservation.v1 record whose ``layers`` were
    mutated (checked directly: workers quarantine every v1 record as unsealed_capture)."""
    record = to_v1(first(sc, "observations"))
    mutate(record["layers"])
    verdict = check_observation(record, sc.pipeline.identities[sc.identity["identity_id"]])
    return [verdict.reason] if isinstance(verdict, Rejection) else []


def _row_mutation(sc: Scenario, mutate: Any) -> list[str]:
    """Refusals of a RouteObservation.v2 record whose unpacked rows were mutated."""
    record = first(sc, "observations")
    arrays = route_arrays(record)
    rows = {
        "layers": list(record["layers"]),
        "stages": list(record["stages"]),
        "top_k": record["top_k"],
        "ids": arrays.expert_ids.astype(np.int64),
        "weights": arrays.weights.astype(np.float64),
    }
    mutate(rows)
    record.update(
        layers=rows["layers"],
        stages=rows["stages"],
        top_k=rows["top_k"],
        expert_ids=rows["ids"].astype("<u2").tobytes(),
        weights=rows["weights"].astype("<f4").tobytes(),
    )
    return refused(sc, "observations", record)


def test_wrong_layer_count() -> None:
    assert _layer_mutation(scenario(), lambda layers: layers.pop()) == ["layer_count_mismatch"]

    def drop_row(rows: dict[str, Any]) -> None:
        rows["layers"].pop()
        rows["stages"].pop()
        rows["ids"], rows["weights"] = rows["ids"][:-1], rows["weights"][:-1]

    assert _row_mutation(scenario(), drop_row) == ["layer_count_mismatch"]


def test_layer_out_of_range_and_duplicate_layer() -> None:
    def out(layers: list[dict[str, Any]]) -> None:
        layers[0]["layer"] = 9

    def dup(layers: list[dict[str, Any]]) -> None:
        layers[0]["layer"] = 1

    assert _layer_mutation(scenario(), out) == ["layer_out_of_range"]
    assert _layer_mutation(scenario(), dup) == ["duplicate_layer"]

    def out_row(rows: dict[str, Any]) -> None:
        rows["layers"][0] = 9

    def dup_row(rows: dict[str, Any]) -> None:
        rows["layers"][0] = 1

    assert _row_mutation(scenario(), out_row) == ["layer_out_of_range"]
    assert _row_mutation(scenario(), dup_row) == ["duplicate_layer"]


def test_layers_out_of_order_are_accepted_and_packed_in_order() -> None:
    sc = scenario()
    messages = sc.messages(spec())
    v1 = to_v1(messages[1][2])
    v1["layers"].reverse()
    messages[1] = (messages[1][0], messages[1][1], v1)
    arrays = route_arrays(messages[2][2])
    order = [2, 0, 3, 1]
    messages[2][2].update(
        pack_routes(arrays.expert_ids[order], arrays.weights[order], layers=order)
    )
    for m in messages:
        sc.send(*m)
    assert reasons(sc) == []
    assert len(sc.pipeline.windows) == 1  # routes in layer order: see test_streams_window


def test_weights_ids_length_mismatch() -> None:
    def drop_weight(layers: list[dict[str, Any]]) -> None:
        layers[1]["weights"].pop()

    assert _layer_mutation(scenario(), drop_weight) == ["weights_ids_length_mismatch"]

    def drop_weight_column(rows: dict[str, Any]) -> None:
        rows["weights"] = rows["weights"][:, :-1]

    assert _row_mutation(scenario(), drop_weight_column) == ["weights_ids_length_mismatch"]


def test_rank_order_violation() -> None:
    def swap(layers: list[dict[str, Any]]) -> None:
        layers[1]["weights"].reverse()

    assert _layer_mutation(scenario(), swap) == ["rank_order_violation"]

    def swap_row(rows: dict[str, Any]) -> None:
        rows["weights"][1] = rows["weights"][1][::-1]

    assert _row_mutation(scenario(), swap_row) == ["rank_order_violation"]


def test_wrong_k() -> None:
    def drop_one(layers: list[dict[str, Any]]) -> None:
        layers[1]["expert_ids"].pop()
        layers[1]["weights"].pop()

    assert _layer_mutation(scenario(), drop_one) == ["wrong_k"]

    def drop_column(rows: dict[str, Any]) -> None:
        rows["ids"], rows["weights"] = rows["ids"][:, :-1], rows["weights"][:, :-1]

    def declare_k(rows: dict[str, Any]) -> None:
        rows["top_k"] = 3

    assert _row_mutation(scenario(), drop_column) == ["wrong_k"]
    assert _row_mutation(scenario(), declare_k) == ["wrong_k"]


@pytest.mark.parametrize("bad_id", [64, -1])
def test_expert_out_of_range(bad_id: int) -> None:
    def set_id(layers: list[dict[str, Any]]) -> None:
        layers[2]["expert_ids"][0] = bad_id

    def set_row_id(rows: dict[str, Any]) -> None:
        rows["ids"][2, 0] = bad_id  # -1 arrives as uint16 65535

    assert _layer_mutation(scenario(), set_id) == ["expert_id_out_of_range"]
    assert _row_mutation(scenario(), set_row_id) == ["expert_id_out_of_range"]


def test_duplicate_expert() -> None:
    def dup(layers: list[dict[str, Any]]) -> None:
        layers[0]["expert_ids"][1] = layers[0]["expert_ids"][0]

    def dup_row(rows: dict[str, Any]) -> None:
        rows["ids"][0, 1] = rows["ids"][0, 0]

    assert _layer_mutation(scenario(), dup) == ["duplicate_expert_id"]
    assert _row_mutation(scenario(), dup_row) == ["duplicate_expert_id"]


@pytest.mark.parametrize(
    ("weight", "reason"),
    [
        (float("nan"), "non_finite_weight"),
        (float("inf"), "non_finite_weight"),
        (-0.25, "negative_weight"),
    ],
)
def test_bad_weight(weight: float, reason: str) -> None:
    def set_weight(layers: list[dict[str, Any]]) -> None:
        layers[3]["weights"][-1] = weight

    def set_row_weight(rows: dict[str, Any]) -> None:
        rows["weights"][3, -1] = weight

    assert _layer_mutation(scenario(), set_weight) == [reason]
    assert _row_mutation(scenario(), set_row_weight) == [reason]


def test_ids_a_window_cannot_carry_are_refused() -> None:
    """Window.v1 stores captured ids as int16: a wider expert id is refused, not wrapped."""
    wide = make_identity(layers=2, experts=WINDOW_ID_LIMIT + 100, top_k=2, name="wide")
    sc = Scenario(LocalPipeline(), identity=wide)
    sc.publish_identity()
    record = first(sc, "observations")
    record.update(pack_routes(np.array([[5, WINDOW_ID_LIMIT + 1], [1, 2]]),
                              np.array([[0.6, 0.4], [0.7, 0.3]])))
    assert refused(sc, "observations", record) == ["expert_id_out_of_range"]
    assert "int16" in sc.pipeline.quarantined[0]["detail"]
    record = to_v1(first(sc, "observations"))
    record["layers"][0]["expert_ids"] = [WINDOW_ID_LIMIT, 3]
    record["counter"] += 1000
    assert refused(sc, "observations", record)[-1] == "expert_id_out_of_range"


def test_bad_segments() -> None:
    sc = scenario()
    record = first(sc, "transcripts")
    record["segments"][1]["start"] = 1
    assert refused(sc, "transcripts", record) == ["segment_overlap"]
    record = first(sc, "transcripts")
    record["segments"][2]["end"] = 999
    assert refused(sc, "transcripts", record)[-1] == "segment_out_of_bounds"


def test_generated_tokens_of_a_user_turn() -> None:
    sc = scenario()
    record = first(sc, "transcripts")
    record["segments"][1]["generated"] = True
    assert refused(sc, "transcripts", record) == ["generated_non_assistant"]


def test_token_id_and_value_out_of_range() -> None:
    sc = scenario()
    record = first(sc, "transcripts")
    record["token_ids"][3] = -5
    assert refused(sc, "transcripts", record) == ["token_id_out_of_range"]
    record = first(sc, "transcripts")
    record["sampling"]["top_p"] = 1.5
    assert refused(sc, "transcripts", record)[-1] == "value_out_of_range"


def test_counter_regression_within_partition() -> None:
    sc = scenario()
    messages = [m for m in sc.messages(spec()) if m[0] == "observations"]
    sc.send(*messages[1])
    sc.send(*messages[0])
    assert reasons(sc) == ["counter_regression"]


def test_ordinal_regression_within_sequence() -> None:
    sc = scenario()
    messages = [m for m in sc.messages(spec()) if m[0] == "observations"]
    early, late = copy.deepcopy(messages[0][2]), copy.deepcopy(messages[3][2])
    late["counter"], early["counter"] = early["counter"], late["counter"]
    sc.send("observations", KEY, late)
    assert refused(sc, "observations", early) == ["ordinal_not_increasing"]


def test_duplicate_ordinal_and_duplicate_turn() -> None:
    sc = scenario()
    messages = sc.messages(spec())
    sc.send(*messages[0])
    obs = copy.deepcopy(messages[1][2])
    sc.send("observations", KEY, obs)
    obs["counter"] += 1000
    assert refused(sc, "observations", obs) == ["duplicate_ordinal"]
    turn = copy.deepcopy(messages[0][2])
    turn["counter"] += 1000
    assert refused(sc, "transcripts", turn) == ["duplicate_ordinal", "duplicate_ordinal"]


def test_records_after_thread_closed() -> None:
    sc = scenario()
    messages = sc.messages(spec())
    for m in messages:
        sc.send(*m)
    assert len(sc.pipeline.windows) == 1
    late = copy.deepcopy(messages[0][2])
    late["turn_index"], late["token_offset"], late["counter"] = 2, 500, 10_000
    assert refused(sc, "transcripts", late) == ["thread_closed"]


def test_turn_after_end_marker_turn_index() -> None:
    sc = scenario(assemble=AssembleConfig(require_routes=True))
    messages = [m for m in sc.messages(spec()) if m[0] == "transcripts"]
    sc.send(*messages[1])
    stray = copy.deepcopy(messages[0][2])
    stray["turn_index"], stray["token_offset"], stray["counter"] = 5, 900, 10_000
    assert refused(sc, "transcripts", stray) == ["thread_closed"]


def test_token_mismatch_between_route_and_transcript() -> None:
    sc = scenario()
    messages = sc.messages(spec())
    obs = next(m for m in messages if m[0] == "observations")
    obs[2]["token_id"] += 1
    for m in messages:
        sc.send(*m)
    assert reasons(sc) == ["token_mismatch"]
    assert sc.pipeline.windows == []
    assert sc.pipeline.quarantined[0]["stage"] == "assemble"


def test_route_for_a_user_token_is_token_mismatch() -> None:
    sc = scenario()
    messages = sc.messages(spec())
    sc.send(*messages[0])
    obs = copy.deepcopy(messages[1][2])
    obs["token_ordinal"] = 3
    assert refused(sc, "observations", obs) == ["token_mismatch"]


def test_incomplete_thread_after_idle_timeout() -> None:
    sc = scenario(assemble=AssembleConfig(idle_timeout_ms=1000))
    messages = sc.messages(spec(turns=(("user", 4), ("assistant", 4), ("user", 3))))
    for m in messages:
        if not (m[0] == "transcripts" and m[2]["turn_index"] == 1):
            sc.send(*m, now_ms=0)
    sc.pipeline.tick(sc.feeder.place("transcripts", KEY)[0], now_ms=500)
    assert reasons(sc) == []
    sc.pipeline.tick(sc.feeder.place("transcripts", KEY)[0], now_ms=5000)
    assert reasons(sc) == ["incomplete_thread"]


@pytest.mark.parametrize("field", ["owner", "thread", "producer_id", "identity_id"])
def test_overlong_string_is_quarantined_as_field_too_long(field: str) -> None:
    sc = scenario()
    record = first(sc, "observations")
    record[field] = "x" * 900_000
    key = f"{record['owner']}/{record['thread']}".encode()
    assert refused(sc, "observations", record, key) == ["field_too_long"]
    q = sc.pipeline.quarantined[0]
    assert field in q["detail"] and "limit is 256" in q["detail"]


def test_unexpected_exception_becomes_processing_error() -> None:
    class Broken(dict):  # type: ignore[type-arg]
        def __setitem__(self, key: str, value: Any) -> None:
            raise RuntimeError("disk on fire")

    sc = scenario()
    stage = sc.pipeline.capture
    stage.store = Broken()
    value, _ = encode_message("transcripts", first(sc, "transcripts"))
    emits = stage.process_safely(
        topic=stage.topics["transcripts"], partition=0, offset=9, key=KEY, value=value
    )
    assert [e.value["reason"] for e in emits] == ["processing_error"]
    assert "disk on fire" in emits[0].value["detail"]


def test_a_poison_record_is_quarantined_by_reference() -> None:
    from hebrus_flywheel.streams import quarantine
    from hebrus_flywheel.streams.processors.poison import poison_emit

    entry = {"crashes": 3, "error": "RuntimeError: boom"}
    emit = poison_emit(("cap", 2, 41), b"x" * 5000, entry, 3)
    again = poison_emit(("cap", 2, 41), b"x" * 5000, entry, 3)
    rec = emit.value
    assert rec["reason"] == "poison" and rec["reference_only"] is True
    assert (rec["source_topic"], rec["source_partition"], rec["source_offset"]) == ("cap", 2, 41)
    assert rec["value"] == b"" and rec["value_size"] == 5000
    assert "3 times" in rec["detail"] and "boom" in rec["detail"]
    assert rec["quarantine_id"] == again.value["quarantine_id"]  # a repeat is the same record
    assert quarantine.encode(rec).record["reason"] == "poison"


def test_replay_refuses_windows_beyond_the_teachers_limits() -> None:
    from hebrus_flywheel.consumers.engine import teacher_limits

    fits = {"token_ids": [1] * 8, "routes": None}
    assert teacher_limits(fits, context_length=8, layers=4) is None
    assert teacher_limits(fits, context_length=0, layers=4) is None  # unknown context
    long = teacher_limits({**fits, "token_ids": [1] * 9}, context_length=8, layers=4)
    assert long is not None and long[0] == "window_exceeds_context"
    routed = {**fits, "routes": {"layer_count": 5}}
    wrong = teacher_limits(routed, context_length=8, layers=4)
    assert wrong is not None and wrong[0] == "layer_count_mismatch" and "5 layers" in wrong[1]


def test_replay_keeps_a_window_of_an_erased_owner_as_a_reference_only() -> None:
    # classify() gives "owner_erased" for a Window.v2 whose key was destroyed
    # (tests/unit/test_window_seal.py); its quarantine record copies nothing of it
    from hebrus_flywheel.consumers.intake import Verdict, quarantine_record
    from hebrus_flywheel.consumers.labels import SourceRef

    verdict = Verdict(window=None, reason="owner_erased", detail="key destroyed")
    rec = quarantine_record(verdict, SourceRef(topic="w", partition=1, offset=9),
                            value=b"sealed bytes", key=b"o/t", headers=[("h", b"v")],
                            max_value_bytes=1 << 20)
    assert rec["reason"] == "owner_erased" and rec["reference_only"] is True
    assert rec["value"] == b"" and rec["source_key"] is None and rec["source_headers"] == []
    assert rec["value_size"] == len(b"sealed bytes")


def test_owner_without_capture_consent_is_quarantined_metadata_only() -> None:
    refused = owner_pseudonym("owner-a")
    sc = Scenario(LocalPipeline(ProcessorConfig(),
                                capture_consent=lambda owner, at_ms: owner != refused))
    sc.publish_identity()
    sc.send_thread(spec())
    assert set(reasons(sc)) == {"no_consent"}
    assert all(q["reference_only"] and not q["value"] for q in sc.pipeline.quarantined)
    assert not sc.pipeline.windows


def test_every_reason_is_documented_and_tested() -> None:
    source = Path(__file__).read_text(encoding="utf-8")
    tested = source.split("def test_every_reason")[0] + (
        Path(__file__).parent / "test_capture_sealing.py").read_text(encoding="utf-8") + (
        Path(__file__).parent / "test_chunks.py").read_text(encoding="utf-8")
    untested = [r for r in REASONS if f'"{r}"' not in tested and r not in NOT_PRODUCED_AFTER_DECODE]
    assert untested == []


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="max_record_bytes"):
        ValidateConfig(max_record_bytes=0)


def test_fuzzed_messages_never_crash_the_stage() -> None:
    sc = scenario()
    rng = random.Random(7)
    valid = [encode_message(k, r)[0] for k, _, r in sc.messages(spec())]
    for i in range(400):
        data = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if i % 5 == 0:
            data = data[: rng.randrange(len(data))]
        kind = rng.choice(["transcripts", "observations", "identities"])
        sc.send(kind, KEY, value=bytes(data))
    assert set(reasons(sc)) <= set(REASONS)
    assert sc.pipeline.counters.stage("quarantine")
