"""The retention policy per topic class, its config file and flags, and how an existing
topic's retention is judged (no broker needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hebrus_flywheel.core.durations import format_duration_ms, parse_duration_ms
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.topology import StreamTopics, internal_specs
from hebrus_flywheel.streams.retention import (
    DAY_MS,
    HOUR_MS,
    RETENTION_CONFIG_ENV,
    RetentionPolicy,
    load_policy,
    topic_class,
)
from hebrus_flywheel.streams.topics import (
    CONTROL_TOPIC,
    IDENTITIES_TOPIC,
    QUARANTINE_TOPIC,
    TRANSCRIPTS_TOPIC,
    TopicInfo,
    catalogue,
    spec_differences,
    spec_for,
    window_topic,
)


@pytest.mark.parametrize(("text", "ms"), [("7d", 7 * DAY_MS), ("36h", 36 * HOUR_MS),
                                          ("90m", 5_400_000), ("45s", 45_000), ("2w", 14 * DAY_MS),
                                          ("1500", 1500), (250, 250), ("forever", -1), ("-1", -1)])
def test_durations_parse(text: str | int, ms: int) -> None:
    assert parse_duration_ms(text, what="x", allow_forever=True) == ms


@pytest.mark.parametrize("text", ["0d", "7 days", "", "-5", "1.5h", True])
def test_bad_durations_name_the_setting(text: object) -> None:
    with pytest.raises(ConfigError, match="older-than"):
        parse_duration_ms(text, what="older-than")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="older-than"):
        parse_duration_ms("forever", what="older-than")


def test_durations_format() -> None:
    assert [format_duration_ms(v) for v in (7 * DAY_MS, 36 * HOUR_MS, -1, 1500)] == [
        "7d", "36h", "forever", "1500ms"]


def test_defaults() -> None:
    assert RetentionPolicy().describe() == {
        "capture": "7d", "windows": "7d", "quarantine": "1d", "internal": "7d",
        "control": "forever", "streams_runs": "forever"}


@pytest.mark.parametrize(("field", "value"), [("capture_ms", 0), ("windows_ms", 60_000),
                                              ("quarantine_ms", -2), ("internal_ms", True),
                                              ("control_ms", 1.5)])
def test_policy_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"RetentionPolicy.{field}"):
        RetentionPolicy(**{field: value})  # type: ignore[arg-type]


def test_policy_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        RetentionPolicy(1)  # type: ignore[misc]
    assert dataclasses.replace(RetentionPolicy(), capture_ms=-1).capture_ms == -1


def test_config_file_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "flywheel.toml"
    path.write_text('[retention]\ncapture = "3d"\nquarantine = "12h"\ncontrol = "30d"\n')
    policy = load_policy(path, ["windows=forever", "quarantine=6h"])
    assert policy.describe() == {"capture": "3d", "windows": "forever", "quarantine": "6h",
                                 "internal": "7d", "control": "30d", "streams_runs": "forever"}
    monkeypatch.setenv(RETENTION_CONFIG_ENV, str(path))
    assert load_policy().capture_ms == 3 * DAY_MS
    specs = {s.name: s for s in catalogue("t-x.")}
    assert specs["t-x." + TRANSCRIPTS_TOPIC].retention_ms == 3 * DAY_MS
    assert specs["t-x." + QUARANTINE_TOPIC].retention_ms == 12 * HOUR_MS
    assert specs["t-x." + IDENTITIES_TOPIC].cleanup_policy == "compact"
    internal = internal_specs(StreamTopics.from_prefix("t-x."), 4)
    assert [s.retention_ms for s in internal] == [7 * DAY_MS, 7 * DAY_MS, HOUR_MS, -1]


@pytest.mark.parametrize(("body", "match"), [
    ('[retention]\nforever = "1d"\n', "unknown retention class"),
    ('[retention]\ncapture = "10m"\n', "RetentionPolicy.capture_ms"),
    ('[retention]\nquarantine = "soon"\n', "retention of quarantine"),
    ("retention = 5\n", "must be a table"),
])
def test_bad_config_files_say_what_is_wrong(tmp_path: Path, body: str, match: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match):
        load_policy(path)


def test_bad_override_flags() -> None:
    with pytest.raises(ConfigError, match="CLASS=DURATION"):
        load_policy(None, ["identities=1d"])
    with pytest.raises(ConfigError, match="CLASS=DURATION"):
        load_policy(None, ["capture"])


@pytest.mark.parametrize(("name", "cls"), [
    (TRANSCRIPTS_TOPIC, "capture"), ("t-1." + IDENTITIES_TOPIC, "identities"),
    (window_topic("train"), "windows"), (QUARANTINE_TOPIC, "quarantine"),
    (CONTROL_TOPIC, "control"), ("flywheel.streams.runs.v1", "streams_runs"),
    ("flywheel.consent.grants.v1", "consent"), ("t-1.flywheel-streams-threads-v1", "internal"),
])
def test_topic_classes(name: str, cls: str) -> None:
    assert topic_class(name) == cls


def _info(name: str, partitions: int = 4, **configs: str) -> TopicInfo:
    return TopicInfo(name=name, partitions=partitions, configs=configs)


def test_operator_retention_is_accepted_and_reported() -> None:
    spec = spec_for(TRANSCRIPTS_TOPIC)
    problems, notes = spec_differences(spec, _info(spec.name, **{
        "cleanup.policy": "delete", "retention.ms": str(30 * DAY_MS)}))
    assert problems == []
    assert notes == [f"{spec.name}: effective retention.ms={30 * DAY_MS} (set on the broker; "
                     f"the policy default is {7 * DAY_MS})"]
    forever = spec_differences(spec, _info(spec.name, **{"cleanup.policy": "delete",
                                                         "retention.ms": "-1"}))
    assert forever[0] == [] and len(forever[1]) == 1
    quarantine = spec_for(QUARANTINE_TOPIC)
    short = spec_differences(quarantine, _info(quarantine.name, **{
        **quarantine.topic_configs(), "retention.ms": "60000"}))
    assert short[0] == []


def test_guarantee_breaking_differences_are_refused() -> None:
    window = spec_for(window_topic("train"))
    too_short = spec_differences(window, _info(window.name, **{
        "cleanup.policy": "delete", "retention.ms": "60000"}))[0]
    assert len(too_short) == 1 and "under the minimum" in too_short[0]
    identities = spec_for(IDENTITIES_TOPIC)
    became_delete = spec_differences(identities, _info(identities.name, 1, **{
        "cleanup.policy": "delete", "retention.ms": "-1"}))[0]
    assert became_delete == [f"{identities.name} has cleanup.policy=delete, catalogue wants "
                             "compact"]
    partitions = spec_differences(window, _info(window.name, 2, **window.topic_configs()))[0]
    assert "2 partitions" in partitions[0]
