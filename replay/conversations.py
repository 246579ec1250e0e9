"""Agent-thread conversations and their JSONL format.

A :class:`Thread` is one conversation of one owner: a non-empty sequence of
:class:`Message` objects with roles ``system``, ``user``, ``assistant`` and ``tool``.
Assistant messages may carry :class:`ToolCall` objects; a ``tool`` message carries the
result of one call.

On disk a thread is one JSON object per line, in the common chat-messages format::

    {"owner": "owner-0007", "thread_id": "thread-00042", "domain_tags": ["tool_calls"],
     "created_at_ms": 1767225600000, "generation": 0,
     "messages": [
       {"role": "user", "content": "..."},
       {"role": "assistant", "content": "...", "tool_calls": [{"id": "call_0",
         "type": "function", "function": {"name": "run_shell",
         "arguments": "{\\"command\\": \\"ls\\"}"}}]},
       {"role": "tool", "tool_call_id": "call_0", "content": "..."}]}

``arguments`` may be a JSON object or, OpenAI style, a string holding one. ``content``
may be ``null`` (read as ``""``) or a list of ``{"type": "text", "text": ...}`` parts
(joined). :func:`read_threads` streams a file one line at a time and raises
:class:`~replay.exceptions.ConversationFormatError` naming the file, line and field.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hebrus_flywheel.core.files import create_file
from hebrus_flywheel.replay.exceptions import ConversationFormatError

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCall:
    """One function call requested by an assistant message.

    ``arguments`` is the decoded JSON object; ``id`` is the optional call id that a
    later ``tool`` message refers to through ``tool_call_id``.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict, hash=False)
    id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConversationFormatError(
                "tool call has no function name; give every tool call a non-empty "
                "'function.name'"
            )
        if not isinstance(self.arguments, dict):
            raise ConversationFormatError(
                f"tool call {self.name!r} has arguments of type "
                f"{type(self.arguments).__name__}; arguments must be a JSON object"
            )


@dataclass(frozen=True)
class Message:
    """One message of a thread: role, text content, and (assistant only) tool calls."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConversationFormatError(
                f"unknown role {self.role!r}; use one of {', '.join(ROLES)}"
            )
        if not isinstance(self.content, str):
            raise ConversationFormatError(
                f"{self.role} message content is {type(self.content).__name__}, "
                "expected a string"
            )
        if self.tool_calls and self.role != "assistant":
            raise ConversationFormatError(
                f"a {self.role} message carries tool_calls; only assistant messages may"
            )
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))


@dataclass(frozen=True)
class Thread:
    """One conversation of one owner.

    ``key`` (``"{owner}/{thread_id}"``) is the Kafka message key and the split unit.
    ``created_at_ms`` is milliseconds since the Unix epoch (used for temporal cuts);
    ``generation`` is the owner-side generation counter of the capture (0 if unknown).
    """

    owner: str
    thread_id: str
    messages: tuple[Message, ...]
    domain_tags: tuple[str, ...] = ()
    created_at_ms: int = 0
    generation: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        object.__setattr__(self, "domain_tags", tuple(self.domain_tags))
        validate_thread(self)

    @property
    def key(self) -> str:
        """The owner/thread key used for Kafka partitioning and splitting."""
        return f"{self.owner}/{self.thread_id}"


def validate_thread(thread: Thread) -> None:
    """Check the cross-field rules of a thread; raise ConversationFormatError if broken."""
    for name in ("owner", "thread_id"):
        value = getattr(thread, name)
        if not isinstance(value, str) or not value.strip():
            raise ConversationFormatError(
                f"thread has an empty or non-string '{name}'; set '{name}' to a stable "
                "non-empty identifier"
            )
    if "/" in thread.owner:
        raise ConversationFormatError(
            f"owner {thread.owner!r} contains '/', which would make the key "
            "'owner/thread_id' ambiguous; remove the slash from the owner id"
        )
    for name in ("created_at_ms", "generation"):
        value = getattr(thread, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConversationFormatError(
                f"'{name}' must be a non-negative integer, got {value!r}"
            )
    if not thread.messages:
        raise ConversationFormatError(
            f"thread {thread.key} has no messages; a thread needs at least one user "
            "message and one assistant message"
        )
    if not any(m.role == "assistant" for m in thread.messages):
        raise ConversationFormatError(
            f"thread {thread.key} has no assistant message; there is nothing to replay, "
            "drop the thread or add the assistant reply"
        )
    if any(not isinstance(t, str) or not t for t in thread.domain_tags):
        raise ConversationFormatError("domain_tags must be non-empty strings")


# --- dict conversion ----------------------------------------------------------------


def thread_to_dict(thread: Thread) -> dict[str, Any]:
    """The JSON-ready dict of ``thread`` (OpenAI-style tool calls, arguments as string)."""
    return {
        "owner": thread.owner,
        "thread_id": thread.thread_id,
        "domain_tags": list(thread.domain_tags),
        "created_at_ms": thread.created_at_ms,
        "generation": thread.generation,
        "messages": [_message_to_dict(m) for m in thread.messages],
    }


def _message_to_dict(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [_tool_call_to_dict(c) for c in message.tool_calls]
    return out


def _tool_call_to_dict(call: ToolCall) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if call.id is not None:
        out["id"] = call.id
    out["type"] = "function"
    out["function"] = {
        "name": call.name,
        "arguments": json.dumps(call.arguments, ensure_ascii=False),
    }
    return out


def thread_from_dict(record: Mapping[str, Any]) -> Thread:
    """Build a Thread from one decoded JSON record; raise ConversationFormatError."""
    if not isinstance(record, Mapping):
        raise ConversationFormatError(
            f"a thread record must be a JSON object, got {type(record).__name__}"
        )
    for name in ("owner", "thread_id", "created_at_ms", "messages"):
        if name not in record:
            raise ConversationFormatError(_missing_field_hint(name))
    messages = record["messages"]
    if not isinstance(messages, list):
        raise ConversationFormatError("'messages' must be a JSON array of message objects")
    tags = record.get("domain_tags", [])
    if not isinstance(tags, list):
        raise ConversationFormatError("'domain_tags' must be a JSON array of strings")
    return Thread(
        owner=record["owner"],
        thread_id=record["thread_id"],
        messages=tuple(_message_from_dict(m, i) for i, m in enumerate(messages)),
        domain_tags=tuple(tags),
        created_at_ms=record["created_at_ms"],
        generation=record.get("generation", 0),
    )


def _missing_field_hint(name: str) -> str:
    hints = {
        "owner": "add the account/user id that owns the thread (it decides the split)",
        "thread_id": "add a stable id of the conversation, unique within its owner",
        "created_at_ms": "add the thread's creation time in milliseconds since the epoch",
        "messages": "add the list of chat messages",
    }
    return f"missing required field '{name}'; {hints[name]}"


def _message_from_dict(raw: Any, index: int) -> Message:
    if not isinstance(raw, Mapping):
        raise ConversationFormatError(f"messages[{index}] is not a JSON object")
    if "role" not in raw:
        raise ConversationFormatError(
            f"messages[{index}] has no 'role'; use one of {', '.join(ROLES)}"
        )
    try:
        return Message(
            role=raw["role"],
            content=_content_text(raw.get("content"), index),
            tool_calls=tuple(_tool_call_from_dict(c, index) for c in raw.get("tool_calls") or ()),
            name=raw.get("name"),
            tool_call_id=raw.get("tool_call_id"),
        )
    except ConversationFormatError as exc:
        raise ConversationFormatError(f"messages[{index}]: {exc.reason}") from None


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise ConversationFormatError(
                    f"messages[{index}].content has a non-text part; only "
                    "{'type': 'text', 'text': ...} parts are supported"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ConversationFormatError(
        f"messages[{index}].content must be a string, null or a list of text parts"
    )


def _tool_call_from_dict(raw: Any, index: int) -> ToolCall:
    if not isinstance(raw, Mapping):
        raise ConversationFormatError(f"messages[{index}].tool_calls has a non-object entry")
    function = raw.get("function", raw)
    if not isinstance(function, Mapping):
        raise ConversationFormatError(f"messages[{index}] tool call 'function' is not an object")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConversationFormatError(
                f"messages[{index}] tool call {function.get('name')!r} has arguments that "
                f"are not valid JSON ({exc.msg}); store them as a JSON object or string"
            ) from None
    return ToolCall(name=function.get("name", ""), arguments=arguments, id=raw.get("id"))


# --- JSONL files ----------------------------------------------------------------------


def _open_text(path: Path, mode: str) -> IO[str]:
    if path.suffix != ".gz":
        if mode == "w":
            return io.TextIOWrapper(create_file(path), encoding="utf-8", newline="\n")
        return path.open(mode, encoding="utf-8")
    if mode == "r":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return _GzipTextWriter(path)


class _GzipTextWriter(io.TextIOWrapper):
    """Text writer over gzip with mtime 0 and no embedded name (byte-identical output)."""

    def __init__(self, path: Path) -> None:
        self._file = create_file(path)
        gz = gzip.GzipFile(filename="", mode="wb", fileobj=self._file, mtime=0)
        super().__init__(gz, encoding="utf-8", newline="\n")

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._file.close()


def read_threads(path: str | Path) -> Iterator[Thread]:
    """Stream the threads of a JSONL file (``.gz`` allowed), one per non-blank line.

    Raises ConversationFormatError with the file and 1-based line number of the first
    malformed record; threads before it have already been yielded.
    """
    source = Path(path)
    if not source.is_file():
        raise ConversationFormatError(
            "conversation file not found; check the path", path=source
        )
    with _open_text(source, "r") as handle:
        yield from _iter_lines(handle, source)


def _iter_lines(handle: Iterable[str], source: Path) -> Iterator[Thread]:
    for line_no, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConversationFormatError(
                f"line is not valid JSON ({exc.msg} at column {exc.colno}); write one "
                "thread object per line",
                path=source,
                line=line_no,
            ) from None
        try:
            yield thread_from_dict(record)
        except ConversationFormatError as exc:
            raise ConversationFormatError(exc.reason, path=source, line=line_no) from None


def write_threads(path: str | Path, threads: Iterable[Thread]) -> int:
    """Write ``threads`` as JSONL (``.gz`` compresses); return the number written.

    The output is deterministic: same threads, same bytes.
    """
    target = Path(path)
    count = 0
    with _open_text(target, "w") as handle:
        for thread in threads:
            handle.write(json.dumps(thread_to_dict(thread), ensure_ascii=False))
            handle.write("\n")
            count += 1
    return count


def to_chat_messages(thread: Thread) -> list[dict[str, Any]]:
    """The thread as ``apply_chat_template`` messages (tool arguments as objects)."""
    out: list[dict[str, Any]] = []
    for message in thread.messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in message.tool_calls
            ]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out
