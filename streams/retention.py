"""How long each class of topic keeps its records: the operator's retention policy.

Topic classes (:func:`topic_class` tells which one a name belongs to):

``capture``
    ``flywheel.capture.transcripts|observations`` — token ids and text of live traffic.
    Default 7 days, at least :data:`MIN_DATA_RETENTION_MS`.
``windows``
    ``flywheel.windows.<split>.v1`` — the input of replay and of ``flywheel rebuild``.
    Default 7 days, at least :data:`MIN_DATA_RETENTION_MS`. A snapshot can only be
    rebuilt while the records it was made from are still on its window (and, for
    ``--from-capture``, capture) topics: rebuild checks the low watermarks and refuses.
``quarantine``
    ``flywheel.quarantine.*`` — refused records with a reason code. Default 24 hours. Its
    record bodies are bounded already (``streams.quarantine`` cuts them to the metadata
    and a capped excerpt); the short retention bounds how long even that stays.
``internal``
    The streams workers' own delete-policy topics (``<app>-threads-v1``,
    ``<app>-decisions-v1``). Default 7 days. Compacted internal topics (faust changelogs,
    the crash ledger) and the 1-hour ticks topic keep their own policy.
``control`` / ``streams_runs``
    Seal control records (manifests, boundaries) and streams-run configurations: no user
    content, and seal, ``--from-capture`` rebuild and audits read them from the beginning,
    so both are kept forever by default (the operator may set a limit).
``identities`` / ``consent``
    Compacted, keyed by identity / owner: the latest record per key is kept, never
    deleted by time. Not configurable here.

The policy is a TOML ``[retention]`` section (durations like ``7d``, ``36h``, ``forever``)
read from ``flywheel topics create --config FILE`` or ``$FLYWHEEL_RETENTION_CONFIG``,
and ``--retention CLASS=DURATION`` flags override it. It is applied when topics are
created; an existing topic keeps whatever the operator configured on the broker and is
accepted (and reported) as long as it respects the class's minimum.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from hebrus_flywheel.core.configfile import read_toml
from hebrus_flywheel.core.durations import FOREVER, format_duration_ms, parse_duration_ms
from hebrus_flywheel.core.errors import ConfigError

RETAIN_FOREVER = FOREVER
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
MIN_DATA_RETENTION_MS = HOUR_MS
"""Shortest retention accepted for capture and window topics: below it, records can be
deleted before a briefly stopped streams or replay worker has read them."""
RETENTION_CONFIG_ENV = "FLYWHEEL_RETENTION_CONFIG"
RETENTION_SECTION = "retention"

TopicClass = Literal["capture", "windows", "quarantine", "internal", "control",
                     "streams_runs", "identities", "consent"]
CONFIGURABLE: tuple[str, ...] = ("capture", "windows", "quarantine", "internal", "control",
                                 "streams_runs")
_STAGE_RE = re.compile(
    r"(?:^|\.)flywheel\.(?P<stage>[a-z][a-z0-9_]*)\.(?P<name>[a-z][a-z0-9_]*)\.v[1-9][0-9]*$")
_STAGE_CLASS: dict[str, TopicClass] = {
    "windows": "windows", "quarantine": "quarantine", "control": "control",
    "streams": "streams_runs", "consent": "consent",
    # candidate work items are control records that happen to be partitioned
    "candidates": "control",
}


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """``retention.ms`` per topic class; -1 (:data:`RETAIN_FOREVER`) keeps records forever.

    Fields:
        capture_ms: capture topics (transcripts, observations); default 7 days, at least
            :data:`MIN_DATA_RETENTION_MS` or forever.
        windows_ms: window topics; default 7 days, at least :data:`MIN_DATA_RETENTION_MS`
            or forever. Rebuilds work only within this window.
        quarantine_ms: the quarantine topic; default 24 hours.
        internal_ms: the streams workers' delete-policy internal topics; default 7 days.
        control_ms: the seal control topic; default forever (no user content).
        streams_runs_ms: the streams-runs topic; default forever (no user content).
    """

    capture_ms: int = 7 * DAY_MS
    windows_ms: int = 7 * DAY_MS
    quarantine_ms: int = DAY_MS
    internal_ms: int = 7 * DAY_MS
    control_ms: int = RETAIN_FOREVER
    streams_runs_ms: int = RETAIN_FOREVER

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or (
                    value != RETAIN_FOREVER and value <= 0):
                raise ConfigError(f"RetentionPolicy.{f.name} must be -1 (forever) or a "
                                  f"positive number of milliseconds, got {value!r}")
        for name in ("capture_ms", "windows_ms"):
            value = getattr(self, name)
            if value != RETAIN_FOREVER and value < MIN_DATA_RETENTION_MS:
                raise ConfigError(
                    f"RetentionPolicy.{name} must be at least "
                    f"{format_duration_ms(MIN_DATA_RETENTION_MS)} (or forever), got "
                    f"{format_duration_ms(value)}: shorter, records may vanish before the "
                    "workers read them")

    def retention_ms(self, cls: str) -> int:
        """The retention of topic class ``cls`` (one of :data:`CONFIGURABLE`)."""
        if cls not in CONFIGURABLE:
            raise ConfigError(f"retention class {cls!r} is not configurable; use one of "
                              f"{', '.join(CONFIGURABLE)}")
        return int(getattr(self, f"{cls}_ms"))

    def describe(self) -> dict[str, str]:
        """Class -> human duration, e.g. ``{"capture": "7d", ..., "control": "forever"}``."""
        return {c: format_duration_ms(self.retention_ms(c)) for c in CONFIGURABLE}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> RetentionPolicy:
        """A policy from ``{class: duration}`` (a TOML ``[retention]`` table); ``source``
        names where the values came from in errors."""
        unknown = sorted(set(values) - set(CONFIGURABLE))
        if unknown:
            raise ConfigError(f"{source}: unknown retention class(es) {unknown}; use "
                              f"{', '.join(CONFIGURABLE)}")
        parsed = {f"{c}_ms": parse_duration_ms(v, what=f"{source}: retention of {c}",
                                               allow_forever=True)
                  for c, v in values.items()}
        return cls(**parsed)

    def with_overrides(self, pairs: Iterable[str]) -> RetentionPolicy:
        """This policy with ``CLASS=DURATION`` pairs (``--retention`` flags) applied."""
        changes: dict[str, int] = {}
        for pair in pairs:
            cls, sep, raw = pair.partition("=")
            if not sep or cls.strip() not in CONFIGURABLE:
                raise ConfigError(f"--retention must be CLASS=DURATION with CLASS one of "
                                  f"{', '.join(CONFIGURABLE)}, got {pair!r}")
            changes[f"{cls.strip()}_ms"] = parse_duration_ms(
                raw, what=f"--retention {cls.strip()}", allow_forever=True)
        return replace(self, **changes)


DEFAULT_POLICY = RetentionPolicy()


def load_policy(path: Path | str | None = None, overrides: Iterable[str] = ()) -> RetentionPolicy:
    """The ``[retention]`` section of ``path`` (else of ``$FLYWHEEL_RETENTION_CONFIG``, else
    the defaults), with ``CLASS=DURATION`` overrides applied."""
    path = path or os.environ.get(RETENTION_CONFIG_ENV) or None
    policy = DEFAULT_POLICY
    if path is not None:
        section = read_toml(Path(path)).get(RETENTION_SECTION, {})
        if not isinstance(section, Mapping):
            raise ConfigError(f"{path}: [{RETENTION_SECTION}] must be a table of "
                              "class = \"duration\" lines")
        policy = RetentionPolicy.from_mapping(section, f"{path} [{RETENTION_SECTION}]")
    return policy.with_overrides(overrides)


def topic_class(name: str) -> TopicClass:
    """The class of topic ``name`` (test prefixes allowed); non-catalogue names are
    the streams workers' ``internal`` topics."""
    match = _STAGE_RE.search(name)
    if match is None:
        return "internal"
    stage = match["stage"]
    if stage == "capture":
        return "identities" if match["name"] == "identities" else "capture"
    return _STAGE_CLASS.get(stage, "internal")


def min_retention_ms(cls: str) -> int:
    """The shortest retention accepted on the broker for class ``cls`` (0: any)."""
    return MIN_DATA_RETENTION_MS if cls in ("capture", "windows") else 0
