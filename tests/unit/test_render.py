"""Canonical rendering of threads into turns and segments."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from hebrus_flywheel.replay.conversations import Message, Thread, ToolCall, to_chat_messages
from hebrus_flywheel.replay.exceptions import RenderError, TokenizerError
from hebrus_flywheel.replay.render import (
    SEGMENT_KINDS,
    RenderedThread,
    prompt_and_targets,
    render_text,
    render_thread,
)
from hebrus_flywheel.replay.synthetic import SyntheticConfig, generate_threads
from hebrus_flywheel.replay.tokenizer import (
    LoadedTokenizer,
    build_tokenizer,
    load_hf_tokenizer,
    load_tokenizer,
)

STRESS = SyntheticConfig(code_share=0.6, tool_share=0.6, multilingual_share=0.5,
                         long_reasoning_share=0.3, unusual_length_share=0.2)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedTokenizer:
    return load_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def hf(loaded: LoadedTokenizer):
    return load_hf_tokenizer(loaded.directory)


def _threads() -> list[Thread]:
    return list(generate_threads(120, seed=21)) + list(generate_threads(120, seed=22,
                                                                        config=STRESS))


def _thread(*messages: Message) -> Thread:
    return Thread(owner="o", thread_id="t", messages=messages, created_at_ms=1)


def test_concatenation_equals_chat_template_tokenization(loaded: LoadedTokenizer, hf) -> None:
    for thread in _threads():
        rendered = render_thread(thread, loaded)
        text = hf.apply_chat_template(to_chat_messages(thread), tokenize=False)
        assert rendered.text == text == render_text(thread)
        expected = hf.encode(text, add_special_tokens=False)
        assert list(rendered.token_ids) == expected
        assert rendered.num_tokens == len(expected)
        assert loaded.tokenizer.decode(expected, skip_special_tokens=False) == text


def test_turn_and_segment_structure(loaded: LoadedTokenizer) -> None:
    for thread in _threads():
        rendered = render_thread(thread, loaded)
        _check_structure(thread, rendered, loaded)


def _check_structure(thread: Thread, rendered: RenderedThread, loaded: LoadedTokenizer) -> None:
    im_start, im_end = loaded.token_id("<|im_start|>"), loaded.token_id("<|im_end|>")
    offset = 0
    assert len(rendered.turns) == len(thread.messages)
    for index, (turn, message) in enumerate(zip(rendered.turns, thread.messages, strict=True)):
        assert (turn.turn_index, turn.role, turn.token_offset) == (index, message.role, offset)
        offset = turn.end_offset
        segs = turn.segments
        assert segs[0].start == 0 and segs[-1].end == len(turn.token_ids)
        assert all(a.end == b.start for a, b in pairwise(segs))
        assert all(s.kind in SEGMENT_KINDS and s.end > s.start for s in segs)
        assert segs[0].kind == "header" and not segs[0].generated
        assert turn.token_ids[0] == im_start
        assert [s.kind for s in segs[-2:]] == ["footer", "footer"]
        assert turn.token_ids[segs[-2].start:segs[-2].end] == (im_end,)
        assert not segs[-1].generated
        is_assistant = message.role == "assistant"
        for seg in segs[1:-1]:
            assert seg.generated == is_assistant
        calls = [s for s in segs if s.kind == "tool_call"]
        assert len(calls) == len(message.tool_calls)
    assert offset == rendered.num_tokens
    assert len(rendered.generated_mask()) == rendered.num_tokens


def test_prompt_and_targets_match_generation_prompt(loaded: LoadedTokenizer, hf) -> None:
    im_end = loaded.token_id("<|im_end|>")
    for thread in _threads()[:80]:
        rendered = render_thread(thread, loaded)
        messages = to_chat_messages(thread)
        for index in rendered.assistant_turns():
            prefix, targets = prompt_and_targets(rendered, index)
            prompt = hf.apply_chat_template(messages[:index], tokenize=False,
                                            add_generation_prompt=True)
            assert prefix == hf.encode(prompt, add_special_tokens=False)
            assert targets[-1] == im_end
            assert list(rendered.token_ids[: len(prefix) + len(targets)]) == prefix + targets
            assert tuple(targets) == rendered.turns[index].generated_ids
            decoded = loaded.tokenizer.decode(targets, skip_special_tokens=False)
            full = hf.apply_chat_template(messages[: index + 1], tokenize=False)
            assert prompt + decoded + "\n" == full


def test_generated_mask_marks_assistant_targets(loaded: LoadedTokenizer) -> None:
    thread = next(generate_threads(1, seed=5, config=STRESS))
    rendered = render_thread(thread, loaded)
    mask = rendered.generated_mask()
    expected = [False] * rendered.num_tokens
    for index in rendered.assistant_turns():
        prefix, targets = prompt_and_targets(rendered, index)
        expected[len(prefix): len(prefix) + len(targets)] = [True] * len(targets)
    assert list(mask) == expected


def test_tool_call_segments_decode_to_blocks(loaded: LoadedTokenizer) -> None:
    call = ToolCall("run_shell", {"command": "ls -la", "flag": True})
    thread = _thread(Message("user", "hi"), Message("assistant", "Checking", tool_calls=(call,)),
                     Message("tool", "ok"), Message("assistant", "Done"))
    rendered = render_thread(thread, loaded)
    turn = rendered.turns[1]
    (seg,) = [s for s in turn.segments if s.kind == "tool_call"]
    text = loaded.tokenizer.decode(list(turn.token_ids[seg.start:seg.end]),
                                   skip_special_tokens=False)
    assert text == '\n<tool_call>\n{"name": "run_shell", "arguments": ' \
                   '{"command": "ls -la", "flag": true}}\n</tool_call>'
    assert seg.generated


def test_boundary_straddling_tokens_go_to_the_earlier_piece(loaded: LoadedTokenizer, hf) -> None:
    call = ToolCall("f", {})
    thread = _thread(Message("user", "\n\nstarts with newlines"),
                     Message("assistant", "ends with punctuation.", tool_calls=(call,)),
                     Message("tool", "r"), Message("assistant", "\nleading newline"))
    rendered = render_thread(thread, loaded)
    text = hf.apply_chat_template(to_chat_messages(thread), tokenize=False)
    assert list(rendered.token_ids) == hf.encode(text, add_special_tokens=False)
    _check_structure(thread, rendered, loaded)
    last = rendered.turns[3]
    header = loaded.tokenizer.decode(list(last.token_ids[: last.segments[0].end]),
                                     skip_special_tokens=False)
    assert header.startswith("<|im_start|>assistant\n")
    prefix, targets = prompt_and_targets(rendered, 3)
    assert len(prefix) + len(targets) + 1 == rendered.num_tokens


def test_reserved_token_text_is_rejected(loaded: LoadedTokenizer) -> None:
    thread = _thread(Message("user", "say <|im_end|> please"), Message("assistant", "no"))
    with pytest.raises(RenderError, match="reserved token"):
        render_thread(thread, loaded)
    call = ToolCall("f", {"x": "</tool_call>"})
    thread = _thread(Message("user", "hi"), Message("assistant", "", tool_calls=(call,)))
    with pytest.raises(RenderError, match="reserved token"):
        render_text(thread)


def test_prompt_and_targets_rejects_bad_turns(loaded: LoadedTokenizer) -> None:
    rendered = render_thread(_thread(Message("user", "hi"), Message("assistant", "yo")), loaded)
    with pytest.raises(RenderError, match="assistant turns"):
        prompt_and_targets(rendered, 0)
    with pytest.raises(RenderError, match="does not exist"):
        prompt_and_targets(rendered, 2)


def test_tokenizer_checks(loaded: LoadedTokenizer) -> None:
    thread = _thread(Message("user", "hi"), Message("assistant", "yo"))
    with pytest.raises(RenderError, match="chat template is not prefix-stable"):
        render_thread(thread, replace(loaded, chat_template="{{ messages }}"))
    with pytest.raises(TokenizerError, match="ChatML special tokens"):
        render_thread(thread, Tokenizer(models.BPE()))
    with pytest.raises(TokenizerError, match="load_tokenizer"):
        render_thread(thread, Path("somewhere"))  # type: ignore[arg-type]
    plain = render_thread(thread, loaded.tokenizer)
    assert plain == render_thread(thread, loaded)
