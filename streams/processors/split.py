"""Split stage: one split per thread, decided before any windowing.

Rules, in order (the first that fires wins):

1. ``runtime_holdout``: a thread whose every generated token has a captured decode
   route (a real decode capture) is reserved with probability
   ``runtime_holdout_fraction``; its windows carry the captured routes and are never
   replayed for training. The draw depends on owner and thread alone
   (:func:`may_hold_out_runtime`), so the capture stage knows while it assembles a
   thread whether its routes can ever be windowed: only those threads keep their
   route payloads (``routes_kept`` in the summary; a thread that did not keep them is
   never a runtime holdout).
2. ``temporal_holdout``: a thread that starts at or after ``temporal_cut_ms``.
3. ``stress_holdout``: a thread with a configured stress tag (``code``, ``tool_calls``,
   ``long_reasoning``, ``multilingual``, ``unusual_length`` by default), with
   probability ``stress_rate``.
4. otherwise the owner's sticky split: ``validation`` for a salted-hash fraction
   ``validation_fraction`` of owners, ``train`` for the rest. An owner therefore never
   spans train and validation.

Every draw is a salted SHA-256 of owner and thread (not of the generation), so all
generations of a thread land in the same split, whichever worker decides. The
holdouts are thread-level by definition, so an owner of ``train`` may also own
holdout threads; the dedup stage keeps their content apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.streams.processors.common import unit_interval
from hebrus_flywheel.streams.topics import SPLITS

EVALUATION_SPLITS: tuple[str, ...] = tuple(s for s in SPLITS if s != "train")
STRESS_TAGS: tuple[str, ...] = (
    "code",
    "tool_calls",
    "long_reasoning",
    "multilingual",
    "unusual_length",
)


@dataclass(frozen=True, kw_only=True)
class SplitConfig:
    """How threads are assigned to splits.

    Fields:
        salt: secret-ish salt of every hash draw; changing it reshuffles all splits.
        validation_fraction: share of owners whose threads go to ``validation``.
        temporal_cut_ms: epoch's temporal cut (Unix ms); threads starting at or after
            it go to ``temporal_holdout``. None disables the rule.
        stress_tags: tags that make a thread a stress candidate.
        stress_rate: share of stress candidates moved to ``stress_holdout``.
        short_thread_tokens: threads with fewer tokens are tagged ``unusual_length``.
        long_thread_tokens: threads with more tokens are tagged ``unusual_length``.
        runtime_holdout_fraction: share of real decode captures reserved as
            ``runtime_holdout``.
    """

    salt: str = "hebrus-flywheel-split-v1"
    validation_fraction: float = 0.1
    temporal_cut_ms: int | None = None
    stress_tags: tuple[str, ...] = STRESS_TAGS
    stress_rate: float = 0.5
    short_thread_tokens: int = 16
    long_thread_tokens: int = 16_384
    runtime_holdout_fraction: float = 0.05

    def __post_init__(self) -> None:
        if not isinstance(self.salt, str) or not self.salt:
            raise ConfigError("SplitConfig.salt must be a non-empty string")
        for name in ("validation_fraction", "stress_rate", "runtime_holdout_fraction"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"SplitConfig.{name} must be within [0, 1], got {value!r}")
        if self.temporal_cut_ms is not None and not isinstance(self.temporal_cut_ms, int):
            raise ConfigError("SplitConfig.temporal_cut_ms must be Unix milliseconds or None")
        if not isinstance(self.stress_tags, tuple) or not all(
            isinstance(t, str) and t for t in self.stress_tags
        ):
            raise ConfigError("SplitConfig.stress_tags must be a tuple of non-empty strings")
        if not 0 <= self.short_thread_tokens < self.long_thread_tokens:
            raise ConfigError(
                "SplitConfig.short_thread_tokens must be >= 0 and below long_thread_tokens"
            )


@dataclass(frozen=True, kw_only=True)
class SplitDecision:
    """The split of one thread and the rule that chose it."""

    split: str
    rule: str
    tags: tuple[str, ...]


def thread_tags(summary: Mapping[str, Any], config: SplitConfig) -> tuple[str, ...]:
    """Domain tags of the thread plus the tags derived from its shape."""
    tags = set(summary.get("tags", ()))
    if summary.get("tool_turns", 0) > 0 or summary.get("tool_call_segments", 0) > 0:
        tags.add("tool_calls")
    n = int(summary.get("token_count", 0))
    if n < config.short_thread_tokens or n > config.long_thread_tokens:
        tags.add("unusual_length")
    return tuple(sorted(tags))


def owner_split(owner: str, config: SplitConfig) -> str:
    """The sticky train/validation split of an owner."""
    draw = unit_interval(config.salt, "owner", owner)
    return "validation" if draw < config.validation_fraction else "train"


def may_hold_out_runtime(owner: str, thread: str, config: SplitConfig) -> bool:
    """Whether the thread's runtime draw reserves it as ``runtime_holdout`` (if it turns
    out to be a real decode capture): the one split whose windows carry captured routes."""
    return unit_interval(config.salt, "runtime", owner, thread) < config.runtime_holdout_fraction


def assign_split(summary: Mapping[str, Any], config: SplitConfig) -> SplitDecision:
    """Apply the rules of this module to a completed thread's summary."""
    owner, thread = summary["owner"], summary["thread"]
    tags = thread_tags(summary, config)
    real_capture = (summary.get("routes_complete") and summary.get("routes_kept", True)
                    and summary.get("generated_count", 0) > 0)
    if real_capture and may_hold_out_runtime(owner, thread, config):
        return SplitDecision(split="runtime_holdout", rule="runtime_capture", tags=tags)
    start = summary.get("start_ms")
    if config.temporal_cut_ms is not None and start is not None and start >= config.temporal_cut_ms:
        return SplitDecision(split="temporal_holdout", rule="temporal_cut", tags=tags)
    stress = sorted(set(tags) & set(config.stress_tags))
    if stress and unit_interval(config.salt, "stress", owner, thread) < config.stress_rate:
        return SplitDecision(split="stress_holdout", rule="stress:" + ",".join(stress), tags=tags)
    return SplitDecision(split=owner_split(owner, config), rule="owner", tags=tags)


def draw_splits(ids: Sequence[tuple[str, str]], config: SplitConfig) -> Counter[str]:
    """Threads per split from the runtime and owner draws alone, for (owner, thread)
    pseudonyms of real decode captures. The temporal and stress rules need a thread's
    timing and tags; they can only move threads out of train and validation."""
    return Counter("runtime_holdout" if may_hold_out_runtime(owner, thread, config)
                   else owner_split(owner, config) for owner, thread in ids)


def search_salt(ids: Sequence[tuple[str, str]], config: SplitConfig, *,
                minimum: Mapping[str, int], attempts: int = 1000) -> str | None:
    """The first of ``config.salt``, ``config.salt-1``, ... under which every split of
    ``minimum`` draws at least that many of ``ids``' threads (None: none of
    ``attempts``). Splits hash owner pseudonyms, which depend on the owner key store,
    so a small synthetic run needs a salt chosen for this key store; a deterministic
    search keeps the choice reproducible."""
    for attempt in range(attempts):
        salt = config.salt if attempt == 0 else f"{config.salt}-{attempt}"
        counts = draw_splits(ids, replace(config, salt=salt))
        if all(counts[split] >= n for split, n in minimum.items()):
            return salt
    return None
