"""The topic catalogue: naming convention, contents and specs (no broker needed)."""

from __future__ import annotations

import dataclasses

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.exceptions import StreamsError, TopicError
from hebrus_flywheel.streams.topics import (
    CANDIDATE_BLOCKS_TOPIC,
    CANDIDATE_CONTROL_TOPIC,
    CATALOGUE,
    CONSENT_TOPIC,
    CONTROL_TOPIC,
    IDENTITIES_TOPIC,
    OBSERVATIONS_TOPIC,
    QUARANTINE_TOPIC,
    SPLITS,
    STREAMS_RUNS_TOPIC,
    TOPIC_NAME_RE,
    TRANSCRIPTS_TOPIC,
    TopicSpec,
    catalogue,
    spec_for,
    validate_topic_name,
    window_topic,
)


@pytest.mark.parametrize(
    "name",
    ["flywheel.capture.transcripts.v1", "flywheel.windows.temporal_holdout.v12", "flywheel.a.b.v1"],
)
def test_valid_names(name: str) -> None:
    assert validate_topic_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "flywheel.capture.transcripts",  # no version
        "flywheel.capture.transcripts.v0",  # versions start at 1
        "flywheel.Capture.transcripts.v1",  # lower case only
        "flywheel.capture.v1",  # missing name
        "hebrus.capture.transcripts.v1",  # wrong root
        "flywheel.capture.trans-cripts.v1",  # dash not allowed in a part
        "flywheel.capture.transcripts.v1.extra",
    ],
)
def test_invalid_names_are_refused_with_the_convention(name: str) -> None:
    with pytest.raises(TopicError, match=r"flywheel\.<stage>\.<name>\.v<N>"):
        validate_topic_name(name)


def test_prefixed_names_validate_with_their_prefix() -> None:
    name = "t-1234.flywheel.capture.transcripts.v1"
    assert validate_topic_name(name, prefix="t-1234.") == name
    with pytest.raises(TopicError):
        validate_topic_name(name)
    with pytest.raises(TopicError, match="prefix"):
        validate_topic_name("flywheel.capture.transcripts.v1", prefix="t-1234.")


def test_catalogue_contents() -> None:
    names = [s.name for s in CATALOGUE]
    assert len(names) == len(set(names))
    assert set(names) == {
        IDENTITIES_TOPIC,
        TRANSCRIPTS_TOPIC,
        OBSERVATIONS_TOPIC,
        QUARANTINE_TOPIC,
        CONTROL_TOPIC,
        STREAMS_RUNS_TOPIC,
        CONSENT_TOPIC,
        CANDIDATE_BLOCKS_TOPIC,
        CANDIDATE_CONTROL_TOPIC,
        *(window_topic(split) for split in SPLITS),
    }
    assert spec_for(STREAMS_RUNS_TOPIC).partitions == 1
    assert all(TOPIC_NAME_RE.match(n) for n in names)
    assert SPLITS == (
        "train",
        "validation",
        "temporal_holdout",
        "stress_holdout",
        "runtime_holdout",
    )


def test_identities_topic_is_compacted_single_partition() -> None:
    spec = spec_for(IDENTITIES_TOPIC)
    assert spec.cleanup_policy == "compact"
    assert spec.partitions == 1
    assert spec.topic_configs()["cleanup.policy"] == "compact"
    assert spec.key == "identity id"


def test_consent_ledger_is_compacted_and_never_expires_by_time() -> None:
    spec = spec_for(CONSENT_TOPIC)
    assert spec.topic_configs()["cleanup.policy"] == "compact"
    assert spec.topic_configs()["retention.ms"] == "-1"
    assert spec.partitions == 1
    assert spec.key == "owner pseudonym"


def test_data_topics_follow_the_default_retention_policy() -> None:
    week, day = str(7 * 86_400_000), str(86_400_000)
    want = {TRANSCRIPTS_TOPIC: week, OBSERVATIONS_TOPIC: week, QUARANTINE_TOPIC: day,
            CONTROL_TOPIC: "-1", STREAMS_RUNS_TOPIC: "-1",
            # candidate work items and their control log are control records
            CANDIDATE_BLOCKS_TOPIC: "-1", CANDIDATE_CONTROL_TOPIC: "-1",
            **{window_topic(s): week for s in SPLITS}}
    for spec in CATALOGUE:
        if spec.name in (IDENTITIES_TOPIC, CONSENT_TOPIC):
            continue
        assert spec.cleanup_policy == "delete", spec.name
        assert spec.topic_configs()["retention.ms"] == want[spec.name], spec.name
    for name in (TRANSCRIPTS_TOPIC, OBSERVATIONS_TOPIC, QUARANTINE_TOPIC):
        assert spec_for(name).partitions == 4
        assert spec_for(name).key == "owner/thread"
    assert all(spec_for(window_topic(s)).partitions == 4 for s in SPLITS)
    assert spec_for(CONTROL_TOPIC).partitions == 1


def test_window_topic_names() -> None:
    assert window_topic("train") == "flywheel.windows.train.v1"
    assert window_topic("runtime_holdout") == "flywheel.windows.runtime_holdout.v1"
    with pytest.raises(TopicError, match="temporal_holdout"):
        window_topic("test")


def test_prefixed_catalogue_keeps_specs() -> None:
    prefixed = catalogue("t-abc.")
    assert [s.name for s in prefixed] == [f"t-abc.{s.name}" for s in CATALOGUE]
    for original, copy in zip(CATALOGUE, prefixed, strict=True):
        assert copy.topic_configs() == original.topic_configs()
        assert copy.partitions == original.partitions
        validate_topic_name(copy.name, prefix="t-abc.")
    assert catalogue() == CATALOGUE
    with pytest.raises(TopicError):
        catalogue("bad prefix/")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("partitions", 0),
        ("partitions", True),
        ("retention_ms", 0),
        ("cleanup_policy", "forever"),
        ("doc", "  "),
        ("name", "has space"),
        ("configs", {"retention.ms": "5"}),
    ],
)
def test_spec_validation_names_the_field(field: str, value: object) -> None:
    base = {"name": "flywheel.test.spec.v1", "partitions": 1, "doc": "x"}
    with pytest.raises(ConfigError, match=f"TopicSpec.{field}"):
        TopicSpec(**{**base, field: value})  # type: ignore[arg-type]


def test_spec_is_immutable_and_hashable() -> None:
    spec = TopicSpec(name="flywheel.test.spec.v1", partitions=1, doc="x", configs={"a": "1"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.partitions = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.configs["a"] = "2"  # type: ignore[index]
    assert hash(spec) == hash(dataclasses.replace(spec))
    # a spec outside the catalogue keeps its own retention (forever unless set)
    assert spec.topic_configs() == {"cleanup.policy": "delete", "retention.ms": "-1", "a": "1"}


def test_errors_derive_from_the_root() -> None:
    assert issubclass(TopicError, StreamsError)
    with pytest.raises(TopicError, match="not in the topic catalogue"):
        spec_for("flywheel.nope.nope.v1")
