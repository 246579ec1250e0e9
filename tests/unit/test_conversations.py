"""Thread dataclasses and the JSONL reader/writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hebrus_flywheel.core.errors import FlywheelError
from hebrus_flywheel.replay.conversations import (
    Message,
    Thread,
    ToolCall,
    read_threads,
    thread_from_dict,
    thread_to_dict,
    to_chat_messages,
    write_threads,
)
from hebrus_flywheel.replay.exceptions import ConversationFormatError, ReplayError


def _thread(owner: str = "owner-0001", thread_id: str = "thread-00001") -> Thread:
    call = ToolCall("run_shell", {"command": "ls -la", "n": 3}, id="call_0")
    return Thread(
        owner=owner,
        thread_id=thread_id,
        messages=(
            Message("system", "Be brief."),
            Message("user", "List the files, per favore. 日本語も"),
            Message("assistant", "Let me check.", tool_calls=(call,)),
            Message("tool", "a.txt\nb.txt", name="run_shell", tool_call_id="call_0"),
            Message("assistant", "Two files."),
        ),
        domain_tags=("tool_calls", "multilingual"),
        created_at_ms=1_767_225_600_000,
        generation=2,
    )


def _record(**overrides: object) -> dict:
    record = thread_to_dict(_thread())
    record.update(overrides)
    return record


def _write_lines(path: Path, records: list[object]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_key_and_hierarchy() -> None:
    thread = _thread()
    assert thread.key == "owner-0001/thread-00001"
    assert issubclass(ConversationFormatError, ReplayError)
    assert issubclass(ReplayError, FlywheelError)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_roundtrip_is_lossless_and_byte_stable(tmp_path: Path, suffix: str) -> None:
    threads = [_thread(), _thread("owner-0002", "thread-00002")]
    first, second = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    assert write_threads(first, threads) == 2
    write_threads(second, read_threads(first))
    assert list(read_threads(second)) == threads
    assert first.read_bytes() == second.read_bytes()


def test_openai_style_variants_are_accepted(tmp_path: Path) -> None:
    record = _record()
    record["messages"][2]["content"] = None
    record["messages"][2]["tool_calls"][0]["function"]["arguments"] = {"command": "ls"}
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    record["messages"][1]["content"] = parts
    record.pop("generation")
    record.pop("domain_tags")
    thread = next(read_threads(_write_lines(tmp_path / "t.jsonl", ["", record, "  "])))
    assert thread.messages[2].content == ""
    assert thread.messages[2].tool_calls[0].arguments == {"command": "ls"}
    assert thread.messages[1].content == "ab"
    assert thread.generation == 0 and thread.domain_tags == ()


def test_string_arguments_are_decoded() -> None:
    record = _record()
    record["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"q": [1, 2]}'
    assert thread_from_dict(record).messages[2].tool_calls[0].arguments == {"q": [1, 2]}


@pytest.mark.parametrize("field", ["owner", "thread_id", "created_at_ms", "messages"])
def test_missing_field_names_file_line_and_field(tmp_path: Path, field: str) -> None:
    bad = _record()
    bad.pop(field)
    path = _write_lines(tmp_path / "t.jsonl", [_record(), bad])
    with pytest.raises(ConversationFormatError) as info:
        list(read_threads(path))
    assert info.value.line == 2
    assert info.value.path == str(path)
    assert f"'{field}'" in str(info.value)
    assert f"{path}:2:" in str(info.value)


def test_reader_streams_before_an_error(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "t.jsonl", [_record(), "{not json"])
    reader = read_threads(path)
    assert next(reader).key == "owner-0001/thread-00001"
    with pytest.raises(ConversationFormatError, match="not valid JSON") as info:
        next(reader)
    assert info.value.line == 2


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda r: r["messages"][1].update(role="robot"), "unknown role 'robot'"),
        (lambda r: r.update(messages=[]), "no messages"),
        (lambda r: r.update(messages=[{"role": "user", "content": "hi"}]), "no assistant"),
        (lambda r: r["messages"][1].update(tool_calls=r["messages"][2]["tool_calls"]),
         "only assistant"),
        (lambda r: r["messages"][2]["tool_calls"][0]["function"].update(arguments="{oops"),
         "not valid JSON"),
        (lambda r: r["messages"][2]["tool_calls"][0]["function"].update(arguments="[1]"),
         "JSON object"),
        (lambda r: r["messages"][2]["tool_calls"][0]["function"].update(name=""),
         "function name"),
        (lambda r: r["messages"][1].pop("role"), "no 'role'"),
        (lambda r: r.update(owner="a/b"), "contains '/'"),
        (lambda r: r.update(owner=""), "'owner'"),
        (lambda r: r.update(created_at_ms=-1), "created_at_ms"),
        (lambda r: r["messages"][1].update(content=[{"type": "image"}]), "non-text part"),
        (lambda r: r.update(domain_tags="code"), "domain_tags"),
    ],
)
def test_invalid_records_are_rejected(tmp_path: Path, mutate, match: str) -> None:
    record = _record()
    mutate(record)
    path = _write_lines(tmp_path / "t.jsonl", [record])
    with pytest.raises(ConversationFormatError, match=match) as info:
        list(read_threads(path))
    assert info.value.line == 1


def test_non_object_line(tmp_path: Path) -> None:
    with pytest.raises(ConversationFormatError, match="JSON object"):
        list(read_threads(_write_lines(tmp_path / "t.jsonl", ["[1, 2]"])))


def test_missing_file_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(ConversationFormatError, match="not found"):
        next(read_threads(tmp_path / "nope.jsonl"))


def test_in_memory_validation_has_no_location() -> None:
    with pytest.raises(ConversationFormatError) as info:
        Thread(owner="o", thread_id="t", messages=(Message("user", "hi"),))
    assert info.value.path is None and info.value.line is None


def test_to_chat_messages_shape() -> None:
    messages = to_chat_messages(_thread())
    assert messages[2]["tool_calls"] == [
        {"type": "function", "function": {"name": "run_shell",
                                          "arguments": {"command": "ls -la", "n": 3}}}
    ]
    assert messages[3]["tool_call_id"] == "call_0"
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]


def test_threads_are_hashable() -> None:
    assert hash(_thread()) == hash(_thread())
