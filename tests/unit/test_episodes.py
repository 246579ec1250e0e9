"""A real-world-style chat template that is NOT prefix-stable, rendered per assistant turn.

``tests/assets/qwen3_style_chat_template.jinja`` behaves like the Qwen3 family's
templates: the last assistant turn after the last user query gets a ``<think>`` block,
earlier ones lose theirs, and consecutive tool results are merged into one user turn. No
single token stream per thread exists, so the whole thread is refused naming the
rewritten text, and :func:`replay.render.render_episodes` renders each assistant turn as
the runtime saw it: ``apply_chat_template(messages[:a], add_generation_prompt=True)``
then the reply. Capture decodes and publishes each such episode as its own stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.replay.capture import CaptureConfig, CaptureSession
from hebrus_flywheel.replay.conversations import Message, Thread, ToolCall, to_chat_messages
from hebrus_flywheel.replay.decode import DecodeRuntime
from hebrus_flywheel.replay.exceptions import NotPrefixStableError
from hebrus_flywheel.replay.render import (
    EPISODE_MARK,
    prompt_and_targets,
    render_episodes,
    render_thread,
)
from hebrus_flywheel.replay.runtime_identity import build_runtime_identity
from hebrus_flywheel.replay.teacher import load_teacher
from hebrus_flywheel.replay.tokenizer import (
    LoadedTokenizer,
    build_tokenizer,
    load_hf_tokenizer,
    load_tokenizer,
)

ASSET = Path(__file__).resolve().parents[1] / "assets" / "qwen3_style_chat_template.jinja"
TEMPLATE = ASSET.read_text(encoding="utf-8")


def agent_thread() -> Thread:
    call = ToolCall("run_shell", {"command": "ls"}, id="c0")
    grep = ToolCall("run_shell", {"command": "grep -r seal"}, id="c1")
    return Thread(owner="owner-q", thread_id="agent-1", messages=(
        Message("system", "You are a careful coding agent."),
        Message("user", "Which files mention the seal?"),
        Message("assistant", "<think>\nList first, then grep.\n</think>\n\nLet me look.",
                tool_calls=(call, grep)),
        Message("tool", "README.md\nconsumers", tool_call_id="c0"),
        Message("tool", "consumers/seal.py: def seal", tool_call_id="c1"),
        Message("assistant", "consumers/seal.py defines it."),
        Message("user", "Thanks. And the verify command?"),
        Message("assistant", "<think>\nIt is in the CLI.\n</think>\n\nflywheel verify DIR."),
    ))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("qwen3-style"), vocab_size=1024)


@pytest.fixture(scope="module")
def loaded(tok_dir: Path) -> LoadedTokenizer:
    return load_tokenizer(tok_dir, chat_template_file=ASSET)


def test_the_whole_thread_is_refused_naming_the_rewritten_text(loaded: LoadedTokenizer) -> None:
    # message 4, the second tool result, is merged into message 3's user turn: the
    # <|im_end|> printed after message 3 is replaced by another <tool_response> block
    with pytest.raises(NotPrefixStableError, match="not prefix-stable at message 4") as info:
        render_thread(agent_thread(), loaded)
    assert "<tool_response>" in str(info.value) and "render_episodes" in str(info.value)


def test_each_assistant_turn_renders_as_the_runtime_saw_it(
    loaded: LoadedTokenizer, tok_dir: Path
) -> None:
    hf = load_hf_tokenizer(tok_dir)
    thread = agent_thread()
    messages = to_chat_messages(thread)
    episodes = render_episodes(thread, loaded)
    assistants = [i for i, m in enumerate(thread.messages) if m.role == "assistant"]
    assert [e.thread_id for e, _ in episodes] == [
        f"agent-1{EPISODE_MARK}{a}" for a in assistants]
    end = loaded.token_id("<|im_end|>")
    for (episode, rendered), a in zip(episodes, assistants, strict=True):
        assert episode.owner == thread.owner and episode.messages[-1] == thread.messages[a]
        prompt = hf.apply_chat_template(messages[:a], tokenize=False,
                                        add_generation_prompt=True, chat_template=TEMPLATE)
        whole = hf.apply_chat_template(messages[: a + 1], tokenize=False,
                                       chat_template=TEMPLATE)
        assert rendered.text == whole
        assert list(rendered.token_ids) == hf.encode(whole, add_special_tokens=False)
        prefix, targets = prompt_and_targets(rendered, len(rendered.turns) - 1)
        assert prefix == hf.encode(prompt, add_special_tokens=False)
        assert targets[-1] == end and end not in targets[:-1]
        reply = hf.decode(targets, skip_special_tokens=False)
        assert reply.startswith("<think>\n")  # the runtime generated the reasoning block
        roles = {m.role for m in thread.messages[:a]}
        assert episode.messages[0].role == ("tool" if "tool" in roles else "user")
    last_context = episodes[-1][1].turns[0]
    context_text = hf.decode(list(last_context.token_ids), skip_special_tokens=False)
    assert "List first" not in context_text  # earlier reasoning is gone, as at run time
    assert "<tool_response>\nREADME.md" in context_text


def test_a_prefix_stable_template_keeps_the_thread_whole(tok_dir: Path) -> None:
    chatml = load_tokenizer(tok_dir)
    thread = agent_thread()
    [(same, rendered)] = render_episodes(thread, chatml)
    assert same is thread and rendered == render_thread(thread, chatml)


def test_a_template_that_rewrites_the_context_for_the_reply_is_refused(
    tok_dir: Path, tmp_path: Path
) -> None:
    counting = tmp_path / "counting.jinja"
    counting.write_text("{{- messages | length }} messages\n" + TEMPLATE, encoding="utf-8")
    with pytest.raises(NotPrefixStableError, match="message 2"):
        render_episodes(agent_thread(), load_tokenizer(tok_dir, chat_template_file=counting))


class _Recorder:
    """Stands in for the Kafka publisher: keeps what capture publishes."""

    def __init__(self) -> None:
        self.turns: list[dict[str, Any]] = []
        self.observations: list[dict[str, Any]] = []

    def publish_identity(self, identity: Mapping[str, Any]) -> None:
        self.identity = dict(identity)

    def publish_turn(self, record: Mapping[str, Any]) -> None:
        self.turns.append(dict(record))

    def publish_observation(self, record: Mapping[str, Any]) -> None:
        self.observations.append(dict(record))

    def publish_run(self, base: Mapping[str, Any], *, first_ordinal: int,
                    token_ids: Any, **routes: Any) -> int:
        """A decoded run as the publisher sees it, kept one record per token."""
        for i, token in enumerate(token_ids):
            self.observations.append({**base, "token_ordinal": first_ordinal + i,
                                      "token_id": int(token)})
        return len(token_ids)


def test_capture_decodes_every_episode_as_its_own_stream(teacher_dir: Path) -> None:
    teacher = load_teacher(teacher_dir)
    tokenizer = load_tokenizer(teacher_dir, chat_template_file=ASSET)
    recorder = _Recorder()
    session = CaptureSession(runtime=DecodeRuntime(teacher), tokenizer=tokenizer,
                             identity=build_runtime_identity(teacher), publisher=recorder,
                             config=CaptureConfig(mode="forced"))  # type: ignore[arg-type]
    summary = session.run([agent_thread()])
    episodes = render_episodes(agent_thread(), tokenizer)
    assert summary.threads == 1 and summary.episodes == len(episodes) == 3
    for episode, rendered in episodes:
        turns = [t for t in recorder.turns if t["thread"] == episode.thread_id]
        assert [t["token_offset"] for t in turns] == [r.token_offset for r in rendered.turns]
        assert [i for t in turns for i in t["token_ids"]] == list(rendered.token_ids)
        assert turns[-1]["closes_thread"] and turns[-1]["role"] == "assistant"
        observed = [o for o in recorder.observations if o["thread"] == episode.thread_id]
        reply = rendered.turns[-1]
        assert [o["token_id"] for o in observed] == list(reply.generated_ids)
        assert observed[0]["token_ordinal"] == reply.token_offset + next(
            s.start for s in reply.segments if s.generated)
    assert summary.observations == len(recorder.observations)
