"""The deterministic synthetic thread generator."""

from __future__ import annotations

import difflib
import re
from collections import Counter

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.synthetic import (
    DOMAIN_TAGS,
    SyntheticConfig,
    approx_tokens,
    corpus_texts,
    generate_labeled_threads,
    generate_threads,
)


def test_same_seed_same_output_and_different_seed_differs() -> None:
    first = list(generate_threads(60, seed=11))
    assert first == list(generate_threads(60, seed=11))
    assert first != list(generate_threads(60, seed=12))


def test_messages_do_not_depend_on_n() -> None:
    short = list(generate_threads(10, seed=3))
    long = list(generate_threads(40, seed=3))[:10]
    assert [t.messages for t in short] == [t.messages for t in long]
    assert [t.key for t in short] == [t.key for t in long]


def test_keys_owners_and_time_spread() -> None:
    config = SyntheticConfig(n_owners=5, start_ms=1_000, period_ms=10_000_000)
    threads = list(generate_threads(100, seed=5, config=config))
    assert all(re.fullmatch(r"owner-\d{4}/thread-\d{5}", t.key) for t in threads)
    assert len({t.key for t in threads}) == 100
    per_owner = Counter(t.owner for t in threads)
    assert len(per_owner) == 5 and min(per_owner.values()) >= 5
    times = [t.created_at_ms for t in threads]
    assert times == sorted(times) and len(set(times)) == 100
    assert times[0] >= 1_000 and times[-1] < 1_000 + 10_000_000


def test_owners_argument_overrides_config() -> None:
    threads = list(generate_threads(50, seed=1, owners=2))
    assert {t.owner for t in threads} == {"owner-0000", "owner-0001"}


def test_domain_tags_cover_every_kind() -> None:
    threads = list(generate_threads(300, seed=9))
    tags = Counter(tag for t in threads for tag in t.domain_tags)
    assert set(tags) == set(DOMAIN_TAGS)
    for thread in threads:
        assert set(thread.domain_tags) <= set(DOMAIN_TAGS)
        assert ("chat" in thread.domain_tags) == (thread.domain_tags == ("chat",))


def test_tool_threads_have_call_result_reply() -> None:
    config = SyntheticConfig(tool_share=1.0)
    for thread in generate_threads(40, seed=2, config=config):
        assert "tool_calls" in thread.domain_tags
        msgs = thread.messages
        calling = [i for i, m in enumerate(msgs) if m.tool_calls]
        assert calling
        for i in calling:
            ids = [c.id for c in msgs[i].tool_calls]
            results = msgs[i + 1 : i + 1 + len(ids)]
            assert [m.role for m in results] == ["tool"] * len(ids)
            assert [m.tool_call_id for m in results] == ids
            assert msgs[i + 1 + len(ids)].role == "assistant"
        assert msgs[-1].role == "assistant" and not msgs[-1].tool_calls


def test_multilingual_threads_use_other_scripts() -> None:
    config = SyntheticConfig(multilingual_share=1.0)
    threads = list(generate_threads(60, seed=4, config=config))
    text = "".join(m.content for t in threads for m in t.messages)
    assert re.search(r"[\u3040-\u30ff]", text)  # Japanese kana
    assert re.search(r"[\u4e00-\u9fff]", text)  # CJK ideographs
    assert re.search(r"[äöüß]", text) and re.search(r"[àèéìòù]", text)


def test_unusual_length_threads_are_short_or_long() -> None:
    config = SyntheticConfig(unusual_length_share=1.0)
    lengths = [sum(len(m.content) for m in t.messages if m.role == "user")
               for t in generate_threads(40, seed=6, config=config)]
    assert min(lengths) < 40 and max(lengths) > 2000


def test_long_reasoning_and_code() -> None:
    config = SyntheticConfig(long_reasoning_share=1.0, code_share=1.0)
    threads = list(generate_threads(20, seed=8, config=config))
    assert all("<think>" in "".join(m.content for m in t.messages) for t in threads)
    assert any("```" in m.content for t in threads for m in t.messages)


def test_duplicates_have_ground_truth() -> None:
    config = SyntheticConfig(near_duplicate_share=0.2, exact_duplicate_share=0.1)
    items = list(generate_labeled_threads(200, seed=13, config=config))
    by_key = {item.thread.key: item for item in items}
    kinds = Counter(item.duplicate_kind for item in items)
    assert kinds["near"] > 10 and kinds["exact"] > 5
    for item in items:
        if item.duplicate_kind is None:
            continue
        source = by_key[item.duplicate_of]
        assert source.duplicate_kind is None
        assert source.thread.thread_id < item.thread.thread_id
        assert source.thread.domain_tags == item.thread.domain_tags
        if item.duplicate_kind == "exact":
            assert source.thread.messages == item.thread.messages
        else:
            assert source.thread.messages != item.thread.messages
            assert _changed_words(source.thread, item.thread) <= 8


def _changed_words(a, b) -> int:
    words_a = " ".join(m.content for m in a.messages).split()
    words_b = " ".join(m.content for m in b.messages).split()
    matcher = difflib.SequenceMatcher(a=words_a, b=words_b, autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes()
               if tag != "equal")


def test_default_assistant_replies_are_moderate() -> None:
    config = SyntheticConfig(long_reasoning_share=0.0, code_share=0.0)
    for thread in generate_threads(50, seed=1, config=config):
        if "unusual_length" in thread.domain_tags:
            continue
        for m in thread.messages:
            if m.role == "assistant" and not m.tool_calls:
                assert 20 <= approx_tokens(m.content) <= 120


def test_corpus_is_shipped_and_small() -> None:
    texts = corpus_texts()
    total = sum(len(text.encode("utf-8")) for _, text in texts)
    assert len(texts) >= 13 and 20_000 < total < 200_000


@pytest.mark.parametrize(
    "kwargs",
    [{"n_owners": 0}, {"min_turns": 3, "max_turns": 2}, {"tool_share": 1.5},
     {"assistant_tokens": (0, 5)}, {"near_duplicate_share": 0.7, "exact_duplicate_share": 0.4},
     {"start_ms": -1}],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        SyntheticConfig(**kwargs)


def test_negative_n_rejected() -> None:
    with pytest.raises(ConfigError, match="n must be"):
        list(generate_threads(-1, seed=0))
