"""Canonical rendering of a thread into token ids with turn and segment boundaries.

The canonical token sequence of a thread is the tokenization of the text that the
TOKENIZER'S OWN chat template renders for its messages (no generation prompt); a
tokenizer without one takes ``flywheel --chat-template FILE``. The turn and segment
boundaries are derived from renderings of message prefixes, not from hand-written
markup (:mod:`replay.chat_template`). The project's tiny tokenizer carries
:data:`replay.tokenizer.CHAT_TEMPLATE` (ChatML) as its real chat template;
:func:`render_text` still builds that ChatML text without Jinja, and a bare
``tokenizers.Tokenizer`` is rendered with it.

Each message is one turn, cut into pieces of text (ChatML shown)::

    header     "<|im_start|>{role}\\n"                 never generated
    content    the message content                      generated if assistant
    tool_call  ["\\n"]"<tool_call>\\n{json}\\n</tool_call>"  generated (assistant only)
    footer     "<|im_end|>"                             generated if assistant
    footer     "\\n"                                     never generated

In general: an assistant turn's header is what the template's generation prompt adds;
content and each tool call are located by rendering variants of the message; the footer
is generated up to and including the tokenizer's ``eos_token`` text, the rest of it is
the next prompt's. The text the template prints before the first message (a BOS, a
default system prompt) opens the first turn's header. Concatenating every turn's
``token_ids`` gives the whole sequence.

**Boundary rule.** The whole text is tokenized once; each token belongs to the piece
holding its first character. Special tokens are atomic, so turn boundaries and the
edges of special tokens are always token boundaries. Only where two plain-text pieces
touch can one token span both; that token goes to the earlier piece. Segments that end
up with no tokens are omitted. Message text containing a special token's text is
refused (it would tokenize as a control token).

Segment ``start``/``end`` are token indices relative to the turn (end exclusive);
``RenderedTurn.token_offset`` is the ordinal of the turn's first token in the thread.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from hebrus_flywheel.replay.chat_template import (
    Piece,
    TemplateRenderer,
    last_turn_pieces,
    template_pieces,
)
from hebrus_flywheel.replay.conversations import Message, Thread, to_chat_messages
from hebrus_flywheel.replay.exceptions import NotPrefixStableError, RenderError, TokenizerError
from hebrus_flywheel.replay.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    LoadedTokenizer,
    special_token_id,
)

SEGMENT_KINDS: tuple[str, ...] = ("header", "content", "tool_call", "footer")


@dataclass(frozen=True)
class Segment:
    """A run of a turn's tokens: ``kind``, token range ``[start, end)`` within the turn,
    and whether the runtime decodes those tokens (``generated``)."""

    kind: str
    start: int
    end: int
    generated: bool


@dataclass(frozen=True)
class RenderedTurn:
    """One message's tokens. ``turn_index`` is the message index in the thread."""

    role: str
    turn_index: int
    token_offset: int
    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def end_offset(self) -> int:
        """Ordinal just past the turn's last token."""
        return self.token_offset + len(self.token_ids)

    @property
    def generated_ids(self) -> tuple[int, ...]:
        """The tokens the runtime decodes in this turn (empty unless assistant)."""
        return tuple(t for s in self.segments if s.generated for t in self.token_ids[s.start:s.end])


@dataclass(frozen=True)
class RenderedThread:
    """The canonical token sequence of a thread, as turns."""

    key: str
    text: str
    turns: tuple[RenderedTurn, ...]

    @property
    def token_ids(self) -> tuple[int, ...]:
        """All tokens of the thread (the concatenation of every turn's ``token_ids``)."""
        return tuple(t for turn in self.turns for t in turn.token_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(turn.token_ids) for turn in self.turns)

    def generated_mask(self) -> tuple[bool, ...]:
        """Per token of :attr:`token_ids`: True where the runtime decoded it."""
        mask: list[bool] = []
        for turn in self.turns:
            flags = [False] * len(turn.token_ids)
            for seg in turn.segments:
                flags[seg.start:seg.end] = [seg.generated] * (seg.end - seg.start)
            mask.extend(flags)
        return tuple(mask)

    def assistant_turns(self) -> tuple[int, ...]:
        """Turn indices of the assistant turns."""
        return tuple(t.turn_index for t in self.turns if t.role == "assistant")


_Piece = Piece


def tool_call_json(name: str, arguments: dict) -> str:
    """The JSON line of a tool call, exactly as the chat template renders it."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def _message_pieces(turn: int, message: Message) -> list[_Piece]:
    gen = message.role == "assistant"
    pieces = [
        _Piece(turn, "header", False, f"{IM_START}{message.role}\n"),
        _Piece(turn, "content", gen, message.content),
    ]
    for k, call in enumerate(message.tool_calls):
        lead = "\n" if (k > 0 or message.content) else ""
        body = f"{TOOL_CALL_START}\n{tool_call_json(call.name, call.arguments)}\n{TOOL_CALL_END}"
        pieces.append(_Piece(turn, "tool_call", gen, lead + body))
    pieces.append(_Piece(turn, "footer", gen, IM_END))
    pieces.append(_Piece(turn, "footer", False, "\n"))
    return pieces


def _check_no_special_text(turn: int, pieces: list[_Piece]) -> None:
    for piece in pieces:
        if piece.kind not in ("content", "tool_call"):
            continue
        text = piece.text
        if piece.kind == "tool_call":
            text = text.removeprefix("\n").removeprefix(TOOL_CALL_START)
            text = text.removesuffix(TOOL_CALL_END)
        for token in SPECIAL_TOKENS:
            if token in text:
                raise RenderError(
                    f"message {turn} ({piece.kind}) contains the reserved token text "
                    f"{token!r}, which would tokenize as a control token and corrupt the "
                    "turn boundaries; quarantine the thread or escape that text"
                )


def _pieces(thread: Thread) -> list[_Piece]:
    pieces: list[_Piece] = []
    for turn, message in enumerate(thread.messages):
        own = _message_pieces(turn, message)
        _check_no_special_text(turn, own)
        pieces.extend(own)
    return pieces


def render_text(thread: Thread) -> str:
    """The ChatML text of ``thread`` (equal to ``apply_chat_template(messages)``)."""
    return "".join(p.text for p in _pieces(thread))


def _renderer(tokenizer: Tokenizer | LoadedTokenizer) -> tuple[Tokenizer, TemplateRenderer,
                                                                 tuple[str, ...]]:
    """The tokenizer, the renderer of its chat template and the reserved token texts.

    A :class:`LoadedTokenizer` renders with its own template; a bare ``tokenizers``
    tokenizer is taken to be the project's (ChatML specials and :data:`CHAT_TEMPLATE`)."""
    if isinstance(tokenizer, LoadedTokenizer):
        renderer = TemplateRenderer(tokenizer.chat_template, tokenizer.special_tokens)
        return tokenizer.tokenizer, renderer, tokenizer.reserved_texts()
    if not isinstance(tokenizer, Tokenizer):
        raise TokenizerError(
            f"render_thread needs a tokenizers.Tokenizer or LoadedTokenizer, got "
            f"{type(tokenizer).__name__}; load one with replay.tokenizer.load_tokenizer"
        )
    for token in SPECIAL_TOKENS:
        special_token_id(tokenizer, token)
    return tokenizer, TemplateRenderer(CHAT_TEMPLATE, {"eos_token": IM_END}), SPECIAL_TOKENS


def _check_reserved(thread: Thread, reserved: tuple[str, ...]) -> None:
    for turn, message in enumerate(thread.messages):
        texts = [("content", message.content)] + [
            ("tool_call", tool_call_json(c.name, c.arguments)) for c in message.tool_calls]
        for kind, text in texts:
            for token in reserved:
                if token in text:
                    raise RenderError(
                        f"message {turn} ({kind}) contains the reserved token text "
                        f"{token!r}, which would tokenize as a control token and corrupt the "
                        "turn boundaries; quarantine the thread or escape that text"
                    )


def _piece_of_tokens(pieces: Sequence[Piece], offsets: list[tuple[int, int]]) -> list[int]:
    """For every token, the index of the piece holding its first character."""
    kept: list[int] = []
    starts: list[int] = []
    pos = 0
    for i, piece in enumerate(pieces):
        if piece.text:
            kept.append(i)
            starts.append(pos)
        pos += len(piece.text)
    return [kept[bisect_right(starts, start) - 1] for start, _ in offsets]


def _build_turns(
    pieces: Sequence[Piece], owner: list[int], ids: list[int], thread: Thread
) -> tuple[RenderedTurn, ...]:
    turns: list[RenderedTurn] = []
    cursor = 0
    for turn_index, message in enumerate(thread.messages):
        first = cursor
        segments: list[Segment] = []
        while cursor < len(ids) and pieces[owner[cursor]].turn == turn_index:
            piece_index, seg_start = owner[cursor], cursor
            while cursor < len(ids) and owner[cursor] == piece_index:
                cursor += 1
            piece = pieces[piece_index]
            segments.append(Segment(piece.kind, seg_start - first, cursor - first,
                                    piece.generated))
        turns.append(RenderedTurn(message.role, turn_index, first,
                                  tuple(ids[first:cursor]), tuple(segments)))
    if cursor != len(ids):
        raise RenderError(
            f"internal error rendering {thread.key}: {len(ids) - cursor} tokens were not "
            "assigned to a turn; report this with the thread"
        )
    return tuple(turns)


def render_thread(thread: Thread, tokenizer: Tokenizer | LoadedTokenizer) -> RenderedThread:
    """Render ``thread`` with the tokenizer's chat template into its canonical tokens,
    cut into turns and segments (boundaries derived as in :mod:`replay.chat_template`)."""
    tok, renderer, reserved = _renderer(tokenizer)
    _check_reserved(thread, reserved)
    pieces = template_pieces(renderer, to_chat_messages(thread))
    text = "".join(p.text for p in pieces)
    encoding = tok.encode(text, add_special_tokens=False)
    owner = _piece_of_tokens(pieces, encoding.offsets)
    turns = _build_turns(pieces, owner, list(encoding.ids), thread)
    return RenderedThread(key=thread.key, text=text, turns=turns)


EPISODE_MARK = "~t"
"""Episode thread ids are ``<thread_id>~t<assistant message index>``."""


def render_episodes(thread: Thread, tokenizer: Tokenizer | LoadedTokenizer
                    ) -> list[tuple[Thread, RenderedThread]]:
    """``thread`` as token streams the runtime actually decoded on.

    With a prefix-stable template that is the thread itself, one stream. A template that
    rewrites earlier text when a message is added (Qwen3-style templates drop the
    ``<think>`` block of earlier assistant turns and merge consecutive tool results) has
    no single stream: at each assistant turn the runtime rendered the conversation so
    far afresh and decoded after it. Each assistant message ``a`` then becomes an
    *episode* thread ``<thread_id>~t<a>`` of two turns: the context, i.e.
    ``render(messages[:a])`` (never generated; its role is ``tool`` when it holds a tool
    result, so a content policy that excludes tool output still applies, else ``user``),
    and the assistant turn, cut after the context exactly as the generation prompt and
    the template print it. NotPrefixStableError (naming the turn) if even that last step
    is not a prefix extension, i.e. the template rewrites the context when the reply is
    added."""
    try:
        return [(thread, render_thread(thread, tokenizer))]
    except NotPrefixStableError:
        pass
    tok, renderer, reserved = _renderer(tokenizer)
    _check_reserved(thread, reserved)
    messages = to_chat_messages(thread)
    return [_episode(thread, index, tok, renderer, messages)
            for index, message in enumerate(thread.messages) if message.role == "assistant"]


def _episode(thread: Thread, index: int, tok: Tokenizer, renderer: TemplateRenderer,
             messages: list[dict[str, Any]]) -> tuple[Thread, RenderedThread]:
    history = renderer.render(messages[:index])
    own = last_turn_pieces(renderer, messages[: index + 1], history)
    context_role = "tool" if any(m.role == "tool" for m in thread.messages[:index]) else "user"
    kept = (Message(context_role, ""),) if history else ()
    turn = len(kept)
    pieces = [Piece(0, "header", False, history)] * bool(history) + [
        Piece(turn, p.kind, p.generated, p.text) for p in own]
    episode = Thread(owner=thread.owner, thread_id=f"{thread.thread_id}{EPISODE_MARK}{index}",
                     messages=(*kept, thread.messages[index]), domain_tags=thread.domain_tags,
                     created_at_ms=thread.created_at_ms, generation=thread.generation)
    text = "".join(p.text for p in pieces)
    encoding = tok.encode(text, add_special_tokens=False)
    owner = _piece_of_tokens(pieces, encoding.offsets)
    turns = _build_turns(pieces, owner, list(encoding.ids), episode)
    return episode, RenderedThread(key=episode.key, text=text, turns=turns)


def prompt_and_targets(
    rendered: RenderedThread, turn_index: int
) -> tuple[list[int], list[int]]:
    """For an assistant turn: (all tokens before its first generated token, its
    generated tokens). ``prefix + targets`` is a prefix of ``rendered.token_ids``."""
    if not 0 <= turn_index < len(rendered.turns):
        raise RenderError(
            f"turn {turn_index} does not exist in {rendered.key} "
            f"({len(rendered.turns)} turns)"
        )
    turn = rendered.turns[turn_index]
    generated = [s for s in turn.segments if s.generated]
    if turn.role != "assistant" or not generated:
        raise RenderError(
            f"turn {turn_index} of {rendered.key} is a {turn.role} turn with no decoded "
            f"tokens; pick one of the assistant turns {list(rendered.assistant_turns())}"
        )
    first, last = generated[0].start, generated[-1].end
    if sum(s.end - s.start for s in generated) != last - first:
        raise RenderError(
            f"turn {turn_index} of {rendered.key} has non-contiguous generated tokens"
        )
    prefix = list(rendered.token_ids[: turn.token_offset + first])
    return prefix, list(turn.token_ids[first:last])
