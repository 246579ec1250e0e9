"""Quarantine records always fit: every copied field is cut (size and SHA-256 kept), the
encoded record is size-checked, and a record that would not fit becomes a reference.
Only sealed content is copied at all: an undecodable or unsealed record is metadata-only."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from hebrus_flywheel.consumers.intake import Verdict
from hebrus_flywheel.consumers.intake import quarantine_record as replay_quarantine_record
from hebrus_flywheel.consumers.labels import SourceRef as ReplaySource
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams import limits, quarantine
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from hebrus_flywheel.streams.processors.validate import (
    Rejection,
    SourceRef,
    ValidateConfig,
    quarantine_record,
)
from hebrus_flywheel.streams.topics import QUARANTINE_TOPIC, catalogue
from tests.support.streams_synthetic import Scenario, ThreadSpec

BIG = 900_000


def hostile(**fields: Any) -> dict[str, Any]:
    return quarantine_record(
        source=SourceRef("flywheel.capture.observations.v1", 2, 17),
        rejection=Rejection("field_too_long", "d" * 10_000),
        value=b"v" * 2_000_000,
        key=b"k" * BIG,
        headers=[(f"h{i}", b"x" * 5000) for i in range(40)],
        record={"owner": "o" * BIG, "thread": "t" * BIG, "generation": 3,
                "producer_id": "p" * BIG, **fields},
        schema="hebrus.flywheel.v1.RouteObservation.v3",
        config=ValidateConfig(),
    )


def cut(rec: dict[str, Any], field: str) -> dict[str, Any]:
    return next(c for c in rec["cuts"] if c["field"] == field)


def test_every_copied_field_is_cut_with_size_and_sha256_kept() -> None:
    rec = hostile()
    assert len(rec["owner"]) == len(rec["thread"]) == len(rec["producer_id"]) == 256
    assert cut(rec, "owner") == {"field": "owner", "size": BIG,
                                 "sha256": hashlib.sha256(b"o" * BIG).hexdigest()}
    assert len(rec["source_key"]) == limits.QUARANTINE_KEY_MAX_BYTES
    assert cut(rec, "source_key")["size"] == BIG
    assert len(rec["detail"]) == limits.QUARANTINE_TEXT_MAX_BYTES
    assert cut(rec, "detail")["size"] == 10_000
    assert len(rec["source_headers"]) == limits.QUARANTINE_MAX_HEADERS
    assert cut(rec, "source_headers")["size"] == 40
    assert all(len(h["value"]) == limits.QUARANTINE_HEADER_MAX_BYTES
               for h in rec["source_headers"])
    assert cut(rec, "source_headers[0].value")["size"] == 5000
    assert len(rec["value"]) == limits.QUARANTINE_VALUE_MAX_BYTES and rec["value_truncated"]
    assert rec["value_size"] == 2_000_000
    assert rec["value_sha256"] == hashlib.sha256(b"v" * 2_000_000).hexdigest()
    assert not rec["reference_only"]


def test_multibyte_strings_are_cut_on_a_character_boundary() -> None:
    rec = hostile(owner="é" * 1000)
    assert rec["owner"] == "é" * 128 and cut(rec, "owner")["size"] == 2000


def test_cut_record_fits_the_topic_and_decodes() -> None:
    out = quarantine.encode(hostile())
    assert not out.record["reference_only"]
    assert len(out.value) + len(out.key) < limits.QUARANTINE_MAX_MESSAGE_BYTES
    _, decoded = codec.decode_message(out.value, out.headers)
    assert decoded["value_size"] == 2_000_000 and len(decoded["cuts"]) > 30
    assert dict(out.headers)["reason"] == b"field_too_long"


def test_record_that_would_not_fit_becomes_a_reference() -> None:
    rec = hostile()
    out = quarantine.encode(rec, max_message_bytes=50_000)
    ref = out.record
    assert ref["reference_only"] and ref["value"] == b"" and ref["source_key"] is None
    assert (ref["source_topic"], ref["source_partition"], ref["source_offset"]) == (
        "flywheel.capture.observations.v1", 2, 17)
    assert ref["value_size"] == 2_000_000 and ref["value_sha256"] == rec["value_sha256"]
    assert ref["reason"] == "field_too_long" and ref["quarantine_id"] == rec["quarantine_id"]
    assert "reference only" in ref["detail"]
    assert len(out.value) < 50_000 - limits.QUARANTINE_ENVELOPE_BYTES
    _, decoded = codec.decode_message(out.value, out.headers)
    assert decoded["reference_only"]


def test_stage_quarantines_the_two_hostile_records_within_bounds() -> None:
    sc = Scenario(LocalPipeline(ProcessorConfig()))
    sc.publish_identity()
    obs = copy.deepcopy(next(r for k, _, r in sc.messages(ThreadSpec(owner="o", thread="t"))
                             if k == "observations"))
    sc.send("observations", b"x/t", {**obs, "owner": "x" * BIG})  # 900 KB owner
    sc.send("observations", b"k" * BIG, obs)  # 900 KB key
    got = sc.pipeline.quarantined
    assert [q["reason"] for q in got] == ["field_too_long", "invalid_key"]
    for q in got:
        out = quarantine.encode(q)
        size = len(out.value) + len(out.key)
        assert size < limits.QUARANTINE_MAX_MESSAGE_BYTES - limits.QUARANTINE_ENVELOPE_BYTES
        assert not out.record["reference_only"] and len(out.key) <= 513
        assert len(q["source_key"] or b"") <= limits.QUARANTINE_KEY_MAX_BYTES
    assert got[0]["owner"] == "x" * 256 and cut(got[0], "owner")["size"] == BIG
    assert cut(got[1], "source_key")["size"] == BIG


def test_replay_intake_quarantine_is_cut_too() -> None:
    verdict = Verdict(window={"owner": "o" * BIG, "thread": "t", "generation": 1},
                      reason="token_id_out_of_range", detail="x" * 9000,
                      schema="hebrus.flywheel.v1.Window.v2")
    rec = replay_quarantine_record(verdict, ReplaySource(topic="w", partition=0, offset=5),
                                   value=b"v" * 1_200_000, key=b"k" * BIG, headers=None,
                                   max_value_bytes=1 << 20)
    assert len(rec["owner"]) == 256 and len(rec["source_key"]) == 1024
    assert len(rec["value"]) == limits.QUARANTINE_VALUE_MAX_BYTES and rec["value_truncated"]
    assert len(quarantine.encode(rec).value) < limits.QUARANTINE_MAX_MESSAGE_BYTES


def test_catalogue_sets_the_quarantine_topic_size_explicitly() -> None:
    spec = next(s for s in catalogue() if s.name == QUARANTINE_TOPIC)
    assert spec.topic_configs()["max.message.bytes"] == str(limits.QUARANTINE_MAX_MESSAGE_BYTES)


def test_small_sealed_value_is_copied_whole() -> None:
    rec = quarantine_record(source=SourceRef("t", 0, 0), rejection=Rejection("oversized", "x"),
                            value=b"abc", schema="hebrus.flywheel.v1.TranscriptTurn.v2",
                            config=ValidateConfig())
    assert rec["value"] == b"abc" and rec["cuts"] == [] and not rec["value_truncated"]


def test_undecodable_value_is_kept_as_a_reference_only() -> None:
    plaintext = b"owner-alice/thread-7 token ids 1234 5678"
    rec = quarantine_record(source=SourceRef("t", 1, 9), rejection=Rejection("undecodable", "x"),
                            value=plaintext, key=b"owner-alice/thread-7",
                            headers=[("h", b"owner-alice")], config=ValidateConfig())
    assert rec["reference_only"] and rec["value"] == b"" and rec["source_key"] is None
    assert rec["source_headers"] == [] and rec["owner"] is None
    assert rec["value_size"] == len(plaintext)
    assert rec["value_sha256"] == hashlib.sha256(plaintext).hexdigest()
    assert quarantine.NOT_SEALED_WHY in rec["detail"] and rec["reason"] == "undecodable"
    out = quarantine.encode(rec)
    assert b"alice" not in out.value + out.key + b"".join(v for _, v in out.headers)


def test_unsealed_schema_is_metadata_only_whatever_the_reason() -> None:
    for schema in ("hebrus.flywheel.v1.RouteObservation.v2", "hebrus.flywheel.v1.Window.v1",
                   "TranscriptTurn.v1"):
        rec = quarantine_record(
            source=SourceRef("t", 0, 3), rejection=Rejection("field_too_long", "x"),
            value=b"plain", record={"owner": "owner-bob", "thread": "t1"}, schema=schema,
            config=ValidateConfig())
        assert rec["reference_only"] and rec["value"] == b"" and rec["owner"] is None, schema
    assert quarantine.keeps_content("hebrus.flywheel.v1.RuntimeIdentity.v3")
    assert not quarantine.keeps_content(None)
