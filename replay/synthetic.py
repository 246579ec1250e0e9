"""Deterministic synthetic agent threads built from the offline corpus in ``replay/data``.

:func:`generate_threads` yields agent-shaped :class:`~replay.conversations.Thread`
objects: optional system prompt, user turns, assistant replies, tool calls followed by
``tool`` results and a final assistant reply, code, long reasoning, six non-English
languages, and very short or very long threads. Thread ``i`` is drawn from its own
``random.Random`` seeded with ``(seed, i)``: the output depends only on the arguments
(no global state), and thread ``i``'s messages do not depend on ``n``.
``created_at_ms`` increases with ``i`` across ``config.period_ms``, so a temporal cut
splits the stream into older and newer threads.

A small share of threads duplicate an earlier original: exact copies (same messages,
new owner, thread id and time) or near copies with a few words changed. The ground
truth is available from :func:`generate_labeled_threads`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.conversations import Message, Thread, ToolCall

LANGUAGES: tuple[str, ...] = ("it", "de", "fr", "es", "ja", "zh")
DOMAIN_TAGS: tuple[str, ...] = (
    "code", "tool_calls", "long_reasoning", "multilingual", "unusual_length", "chat",
)
CORPUS_FILES: tuple[str, ...] = (
    "prose_en.txt", "prompts_en.txt", "reasoning_en.txt", "prose_it.txt", "prose_de.txt",
    "prose_fr.txt", "prose_es.txt", "prose_ja.txt", "prose_zh.txt", "code_python.txt",
    "code_rust.txt", "code_sql.txt", "shell_output.txt",
)
_SNIPPET_SEPARATOR = "\n%%\n"
_DAY_MS = 86_400_000
_SYSTEM_PROMPTS = (
    "You are a careful coding assistant. Answer briefly and show commands when useful.",
    "You are an agent with shell, file and SQL tools. Use a tool when it helps.",
    "You are a helpful assistant. Be concise and say when you are unsure.",
)
_SHORT_USER = ("ok?", "thanks", "why?", "continue", "and now?", "ls", "?", "done?")
_SHORT_ASSISTANT = ("Yes.", "Done.", "No.", "Sure.", "It depends.", "Fixed.", "OK.")
_SUBSTITUTES = (
    "quickly", "carefully", "server", "yesterday", "cluster", "library", "window",
    "record", "morning", "version", "nightly", "harbour", "teacher", "planner",
)
_CJK_LANGUAGES = frozenset({"ja", "zh"})


@dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """Shape of the synthetic stream. Shares are independent per-thread probabilities.

    Fields:
        n_owners: number of owners (``owner-0000`` ...); threads are spread uniformly.
        min_turns, max_turns: user/assistant exchanges per thread (inclusive range).
        code_share: threads tagged ``code`` (code in prompts and answers).
        tool_share: threads tagged ``tool_calls`` (assistant tool calls + tool results).
        long_reasoning_share: threads tagged ``long_reasoning`` (one long reply).
        multilingual_share: threads tagged ``multilingual`` (one non-English language).
        unusual_length_share: threads tagged ``unusual_length`` (half made of very short
            exchanges, half opening with a very long user prompt).
        near_duplicate_share: threads that copy an earlier original with a few words
            changed. exact_duplicate_share: threads that copy one exactly.
        system_prompt_share: threads starting with a system message.
        assistant_tokens: approximate (min, max) tokens of an ordinary assistant reply.
        long_reasoning_tokens: approximate (min, max) tokens of a long-reasoning reply.
        long_prompt_tokens: approximate (min, max) tokens of a very long user prompt.
        start_ms: ``created_at_ms`` of the first thread (ms since the Unix epoch).
        period_ms: span over which ``created_at_ms`` is spread.
    """

    n_owners: int = 12
    min_turns: int = 1
    max_turns: int = 3
    code_share: float = 0.25
    tool_share: float = 0.25
    long_reasoning_share: float = 0.1
    multilingual_share: float = 0.2
    unusual_length_share: float = 0.1
    near_duplicate_share: float = 0.05
    exact_duplicate_share: float = 0.02
    system_prompt_share: float = 0.5
    assistant_tokens: tuple[int, int] = (20, 120)
    long_reasoning_tokens: tuple[int, int] = (150, 400)
    long_prompt_tokens: tuple[int, int] = (600, 1500)
    start_ms: int = 1_767_225_600_000
    period_ms: int = 90 * _DAY_MS

    def __post_init__(self) -> None:
        _positive(self, "n_owners", "min_turns", "period_ms")
        if self.max_turns < self.min_turns:
            raise ConfigError("max_turns must be >= min_turns")
        if self.start_ms < 0:
            raise ConfigError("start_ms must be >= 0 (milliseconds since the epoch)")
        for name in ("code_share", "tool_share", "long_reasoning_share", "multilingual_share",
                     "unusual_length_share", "near_duplicate_share",
                     "exact_duplicate_share", "system_prompt_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be within [0, 1]")
        if self.near_duplicate_share + self.exact_duplicate_share > 1.0:
            raise ConfigError("near_duplicate_share + exact_duplicate_share must be <= 1")
        for name in ("assistant_tokens", "long_reasoning_tokens", "long_prompt_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ConfigError(f"{name} must be a (min, max) pair with 1 <= min <= max")


def _positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class SyntheticThread:
    """A generated thread with its duplicate ground truth.

    ``duplicate_of`` is the key of the original thread and ``duplicate_kind`` is
    ``"exact"`` or ``"near"`` for duplicates; both are ``None`` for originals.
    """

    thread: Thread
    duplicate_of: str | None = None
    duplicate_kind: str | None = None


# --- corpus ---------------------------------------------------------------------------


@cache
def _corpus_file(name: str) -> str:
    data = resources.files("hebrus_flywheel.replay").joinpath("data", name)
    return data.read_text(encoding="utf-8")


def corpus_texts() -> list[tuple[str, str]]:
    """``(file name, text)`` of every shipped corpus file, in a fixed order."""
    return [(name, _corpus_file(name)) for name in CORPUS_FILES]


@cache
def _lines(name: str) -> tuple[str, ...]:
    return tuple(line for line in _corpus_file(name).splitlines() if line.strip())


@cache
def _snippets(name: str) -> tuple[str, ...]:
    parts = _corpus_file(name).strip("\n").split(_SNIPPET_SEPARATOR)
    return tuple(p.strip("\n") for p in parts if p.strip())


def approx_tokens(text: str) -> int:
    """A cheap token estimate: ~4 ASCII characters or one other character per token."""
    ascii_chars = sum(1 for ch in text if ord(ch) < 128)
    return ascii_chars // 4 + (len(text) - ascii_chars) + 1


def _fill(rng: random.Random, pool: tuple[str, ...], low: int, high: int, joiner: str) -> str:
    """Distinct random sentences of ``pool`` until about ``randint(low, high)`` tokens."""
    target = rng.randint(low, high)
    order = rng.sample(range(len(pool)), len(pool))
    parts = [pool[order[0]]]
    while approx_tokens(joiner.join(parts)) < target:
        parts.append(pool[order[len(parts) % len(order)]])
    while len(parts) > 1 and approx_tokens(joiner.join(parts)) > high:
        parts.pop()
    return joiner.join(parts)


# --- one thread -----------------------------------------------------------------------


@dataclass
class _Plan:
    """What one thread is about; drawn first so the tags are known up front."""

    code: bool
    tools: bool
    reasoning: bool
    language: str
    length: str  # "normal", "short" or "long"
    tags: tuple[str, ...] = field(default=())


def _draw_plan(rng: random.Random, cfg: SyntheticConfig) -> _Plan:
    code = rng.random() < cfg.code_share
    tools = rng.random() < cfg.tool_share
    reasoning = rng.random() < cfg.long_reasoning_share
    language = rng.choice(LANGUAGES) if rng.random() < cfg.multilingual_share else "en"
    unusual = rng.random() < cfg.unusual_length_share
    length = rng.choice(("short", "long")) if unusual else "normal"
    flags = (code, tools, reasoning, language != "en", unusual)
    tags = tuple(tag for tag, on in zip(DOMAIN_TAGS[:5], flags, strict=True) if on) or ("chat",)
    return _Plan(code, tools, reasoning, language, length, tags)


def _prose_pool(language: str) -> tuple[str, ...]:
    return _lines("prose_en.txt" if language == "en" else f"prose_{language}.txt")


def _joiner(language: str) -> str:
    return "" if language in _CJK_LANGUAGES else " "


def _code_block(rng: random.Random) -> str:
    lang, name = rng.choice((("python", "code_python.txt"), ("rust", "code_rust.txt"),
                             ("sql", "code_sql.txt")))
    return f"```{lang}\n{rng.choice(_snippets(name))}\n```"


def _user_text(rng: random.Random, plan: _Plan, cfg: SyntheticConfig, turn: int) -> str:
    if plan.length == "short":
        return rng.choice(_SHORT_USER)
    if plan.language == "en":
        text = rng.choice(_lines("prompts_en.txt"))
    else:
        text = _fill(rng, _prose_pool(plan.language), 10, 40, _joiner(plan.language))
    if plan.length == "long" and turn == 0:
        low, high = cfg.long_prompt_tokens
        pool = _prose_pool(plan.language) + _snippets("shell_output.txt")
        text += "\n\n" + _fill(rng, pool, low, high, "\n")
    if plan.code and rng.random() < 0.6:
        text += "\n\n" + _code_block(rng)
    return text


def _assistant_text(rng: random.Random, plan: _Plan, cfg: SyntheticConfig,
                    long_reply: bool) -> str:
    if plan.length == "short":
        return rng.choice(_SHORT_ASSISTANT)
    low, high = cfg.assistant_tokens
    text = _fill(rng, _prose_pool(plan.language), low, high, _joiner(plan.language))
    if long_reply:
        rlow, rhigh = cfg.long_reasoning_tokens
        thinking = _fill(rng, _lines("reasoning_en.txt"), rlow, rhigh, " ")
        text = f"<think>\n{thinking}\n</think>\n\n{text}"
    if plan.code and rng.random() < 0.5:
        text += "\n\n" + _code_block(rng)
    return text


def _tool_call(rng: random.Random, call_id: str) -> tuple[ToolCall, str]:
    """One tool call and the tool's textual result."""
    kind = rng.randrange(3)
    if kind == 0:
        out = rng.choice(_snippets("shell_output.txt"))
        first, _, rest = out.partition("\n")
        if first.startswith("$ ") and rest:
            return ToolCall("run_shell", {"command": first[2:]}, call_id), rest
        command = rng.choice(("python run.py", "make test", "cat report.json"))
        return ToolCall("run_shell", {"command": command}, call_id), out
    if kind == 1:
        name, suffix = rng.choice((("code_python.txt", "py"), ("code_rust.txt", "rs")))
        path = f"src/{rng.choice(('ingest', 'core', 'cache', 'window'))}.{suffix}"
        return ToolCall("read_file", {"path": path}, call_id), rng.choice(_snippets(name))
    query = rng.choice(_snippets("code_sql.txt"))
    rows = rng.randint(0, 40)
    result = json.dumps({"rows": rows, "elapsed_ms": rng.randint(1, 900)})
    return ToolCall("sql_query", {"query": query, "limit": 100}, call_id), result


def _tool_exchange(rng: random.Random, turn: int) -> list[Message]:
    """Assistant message with tool calls, then one tool message per call."""
    calls = [_tool_call(rng, f"call_{turn}_{k}") for k in range(rng.choice((1, 1, 2)))]
    preamble = "" if rng.random() < 0.3 else rng.choice(
        ("Let me check.", "I will run that now.", "Let me look at the file first.",
         "I'll query the table.")
    )
    out = [Message("assistant", preamble, tool_calls=tuple(c for c, _ in calls))]
    out += [Message("tool", result, name=c.name, tool_call_id=c.id) for c, result in calls]
    return out


def _messages(rng: random.Random, plan: _Plan, cfg: SyntheticConfig) -> list[Message]:
    messages: list[Message] = []
    if rng.random() < cfg.system_prompt_share:
        messages.append(Message("system", rng.choice(_SYSTEM_PROMPTS)))
    turns = rng.randint(cfg.min_turns, cfg.max_turns)
    tool_turn = rng.randrange(turns)
    reasoning_turn = rng.randrange(turns)
    for turn in range(turns):
        messages.append(Message("user", _user_text(rng, plan, cfg, turn)))
        if plan.tools and (turn == tool_turn or rng.random() < 0.3):
            messages += _tool_exchange(rng, turn)
        long_reply = plan.reasoning and turn == reasoning_turn
        messages.append(Message("assistant", _assistant_text(rng, plan, cfg, long_reply)))
    return messages


# --- duplicates -----------------------------------------------------------------------


def _duplicate_kind(seed: int, index: int, cfg: SyntheticConfig) -> str | None:
    if index == 0:
        return None
    u = random.Random(f"hebrus-synthetic:{seed}:{index}:dup").random()
    if u < cfg.exact_duplicate_share:
        return "exact"
    if u < cfg.exact_duplicate_share + cfg.near_duplicate_share:
        return "near"
    return None


def _duplicate_source(seed: int, index: int, cfg: SyntheticConfig) -> int:
    """An earlier thread index that is itself an original (thread 0 always is)."""
    rng = random.Random(f"hebrus-synthetic:{seed}:{index}:source")
    for _ in range(32):
        candidate = rng.randrange(index)
        if _duplicate_kind(seed, candidate, cfg) is None:
            return candidate
    return 0


def _mutate(rng: random.Random, messages: list[Message]) -> list[Message]:
    """Change a few words (1-3 in one or two user/assistant messages)."""
    word = re.compile(r"\b[A-Za-z]{4,}\b")
    candidates = [i for i, m in enumerate(messages)
                  if m.role in ("user", "assistant") and word.search(m.content)]
    out = list(messages)
    if not candidates:
        first_user = next(i for i, m in enumerate(out) if m.role in ("user", "assistant"))
        out[first_user] = _with_content(out[first_user], out[first_user].content + " (2)")
        return out
    for i in rng.sample(candidates, min(len(candidates), rng.choice((1, 2)))):
        spans = [m.span() for m in word.finditer(out[i].content)]
        text = out[i].content
        for start, end in sorted(rng.sample(spans, min(len(spans), rng.randint(1, 3))),
                                 reverse=True):
            choices = [w for w in _SUBSTITUTES if w != text[start:end]]
            text = text[:start] + rng.choice(choices) + text[end:]
        out[i] = _with_content(out[i], text)
    return out


def _with_content(message: Message, content: str) -> Message:
    return Message(message.role, content, message.tool_calls, message.name,
                   message.tool_call_id)


# --- public API -----------------------------------------------------------------------


def _original(seed: int, index: int, cfg: SyntheticConfig) -> tuple[list[Message], _Plan]:
    rng = random.Random(f"hebrus-synthetic:{seed}:{index}:thread")
    plan = _draw_plan(rng, cfg)
    return _messages(rng, plan, cfg), plan


def _thread_at(seed: int, index: int, n: int, cfg: SyntheticConfig) -> SyntheticThread:
    rng = random.Random(f"hebrus-synthetic:{seed}:{index}:meta")
    owner = f"owner-{rng.randrange(cfg.n_owners):04d}"
    created = cfg.start_ms + int((index + rng.random()) * cfg.period_ms / n)
    kind = _duplicate_kind(seed, index, cfg)
    source = _duplicate_source(seed, index, cfg) if kind else index
    messages, plan = _original(seed, source, cfg)
    if kind == "near":
        messages = _mutate(rng, messages)
    thread = Thread(owner=owner, thread_id=f"thread-{index:05d}", messages=tuple(messages),
                    domain_tags=plan.tags, created_at_ms=created)
    if kind is None:
        return SyntheticThread(thread)
    source_meta = random.Random(f"hebrus-synthetic:{seed}:{source}:meta")
    source_key = f"owner-{source_meta.randrange(cfg.n_owners):04d}/thread-{source:05d}"
    return SyntheticThread(thread, duplicate_of=source_key, duplicate_kind=kind)


def generate_labeled_threads(
    n: int, *, seed: int, owners: int | None = None, config: SyntheticConfig | None = None
) -> Iterator[SyntheticThread]:
    """Yield ``n`` synthetic threads with their duplicate ground truth.

    ``owners`` overrides ``config.n_owners``. Same arguments, same output.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"n must be a non-negative integer, got {n!r}")
    cfg = config or SyntheticConfig()
    if owners is not None:
        cfg = replace(cfg, n_owners=owners)
    for index in range(n):
        yield _thread_at(seed, index, n, cfg)


def generate_threads(
    n: int, *, seed: int, owners: int | None = None, config: SyntheticConfig | None = None
) -> Iterator[Thread]:
    """Yield ``n`` deterministic synthetic agent threads (see the module docstring)."""
    for item in generate_labeled_threads(n, seed=seed, owners=owners, config=config):
        yield item.thread
