"""``flywheel streams inspect``: what the processors have produced so far, read from Kafka.

Reads every window topic (headers only: ``window_id`` and the message key), the
decisions topic (split and dedup outcome per thread generation) and the quarantine
topic (reason per ``quarantine_id``, ``poison`` included) and the crash ledger (crashes
per record not yet consumed past) up to their current end. Repeats produced by
at-least-once delivery are counted once, and separately as ``repeats``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

from confluent_kafka import Message

from hebrus_flywheel.core import kafka
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.exceptions import SchemaError
from hebrus_flywheel.streams.processors.exceptions import InspectError
from hebrus_flywheel.streams.processors.topology import DEFAULT_APP_ID, StreamTopics


def read_topic(bootstrap: kafka.KafkaTarget, topic: str, *,
               timeout_s: float = 30.0) -> Iterator[Message]:
    """Every message of ``topic`` up to its end at the time of the call (none if missing);
    InspectError when that end cannot be reached within ``timeout_s`` of the last progress."""
    try:
        yield from kafka.read_to_end(kafka.client_config(bootstrap), [topic], timeout_s=timeout_s,
                                     missing_ok=True, log_name="streams.librdkafka")
    except kafka.KafkaIOError as exc:
        raise InspectError(f"cannot read {topic}: {exc}") from exc


def _header(msg: Message, name: str) -> str | None:
    raw = msg.headers() or []
    headers = list(raw.items()) if isinstance(raw, dict) else list(raw)
    for key, value in headers:
        if key == name and value is not None:
            return value if isinstance(value, str) else bytes(value).decode()
    return None


def window_counts(bootstrap: str, topics: StreamTopics) -> dict[str, dict[str, int]]:
    out = {}
    for split, topic in topics.windows.items():
        ids: set[str] = set()
        threads: set[bytes] = set()
        messages = 0
        for msg in read_topic(bootstrap, topic):
            messages += 1
            ids.add(_header(msg, "window_id") or f"{msg.partition()}:{msg.offset()}")
            threads.add(msg.key() or b"")
        out[split] = {"threads": len(threads), "windows": len(ids), "repeats": messages - len(ids)}
    return out


def decision_counts(bootstrap: str, topics: StreamTopics) -> dict[str, Any]:
    decisions: dict[str, dict[str, Any]] = {}
    for msg in read_topic(bootstrap, topics.decisions):
        d = json.loads(msg.value() or b"null")
        decisions[d["iid"]] = d
    reasons = Counter(d["reason"] for d in decisions.values())
    kept = Counter(d["split"] for d in decisions.values() if d["keep"])
    dropped = Counter(d["split"] for d in decisions.values() if not d["keep"])
    # Workers before near_duplicate_of_evaluation kept such train threads as late conflicts.
    late = sum(len(d.get("late_conflicts", ())) for d in decisions.values())
    thresholds = {d["threshold"] for d in decisions.values() if d.get("threshold") is not None}
    return {
        "threshold": thresholds.pop() if len(thresholds) == 1 else None,
        "thread_generations": len(decisions),
        "by_reason": dict(sorted(reasons.items())),
        "kept_by_split": dict(sorted(kept.items())),
        "dropped_by_split": dict(sorted(dropped.items())),
        "late_eval_conflicts": late,
    }


def quarantine_counts(bootstrap: str, topics: StreamTopics) -> dict[str, int]:
    seen: dict[str, str] = {}
    for msg in read_topic(bootstrap, topics.quarantine):
        try:
            _, record = codec.decode(msg.value() or b"")
            seen[record["quarantine_id"]] = record["reason"]
        except (SchemaError, KeyError, TypeError):
            seen[f"{msg.partition()}:{msg.offset()}"] = _header(msg, "reason") or "unreadable"
    return dict(sorted(Counter(seen.values()).items()))


def crash_counts(bootstrap: str, topics: StreamTopics) -> dict[str, int]:
    """The crash ledger (``streams.processors.poison``): crashes per record still listed,
    ``topic[partition]@offset`` -> count (records consumed past are deleted on start)."""
    latest: dict[bytes, int | None] = {}
    for msg in read_topic(bootstrap, topics.crashes):
        value = msg.value()
        latest[msg.key() or b""] = int(json.loads(value)["crashes"]) if value else None
    out = {}
    for key, count in latest.items():
        topic, partition, offset = key.decode("utf-8", "replace").rsplit("|", 2)
        if count is not None:
            out[f"{topic}[{partition}]@{offset}"] = count
    return dict(sorted(out.items()))


def summarize_topics(
    bootstrap: str, *, prefix: str = "", app_id: str = DEFAULT_APP_ID
) -> dict[str, Any]:
    topics = StreamTopics.from_prefix(prefix, app_id)
    return {
        "splits": window_counts(bootstrap, topics),
        "dedup": decision_counts(bootstrap, topics),
        "quarantine": quarantine_counts(bootstrap, topics),
        "crashes": crash_counts(bootstrap, topics),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """A small human-readable table of :func:`summarize_topics`' result."""
    lines = [f"{'split':<18}{'threads':>9}{'windows':>9}{'repeats':>9}"]
    for split, c in summary["splits"].items():
        lines.append(f"{split:<18}{c['threads']:>9}{c['windows']:>9}{c['repeats']:>9}")
    dedup = summary["dedup"]
    lines.append(f"thread generations decided: {dedup['thread_generations']}")
    lines.append("dedup: " + (", ".join(f"{k}={v}" for k, v in dedup["by_reason"].items()) or "-"))
    lines.append(f"late eval conflicts: {dedup['late_eval_conflicts']}")
    quarantine = summary["quarantine"]
    lines.append("quarantine: " + (", ".join(f"{k}={v}" for k, v in quarantine.items()) or "none"))
    crashes = summary.get("crashes") or {}
    lines.append("crash ledger: " + (", ".join(f"{k} crashed {v}x" for k, v in crashes.items())
                                     or "none"))
    return "\n".join(lines)
