"""Message and role boundaries derived from a checkpoint's own chat template.

The template is a black box rendered with transformers' Jinja environment (the same
renderer as ``apply_chat_template``); boundaries come from comparing renderings:

- turn ``i``'s text is ``render(messages[:i+1])`` minus ``render(messages[:i])`` (what
  ``render([])`` prints, e.g. a BOS or a default system prompt, opens turn 0);
- an assistant turn's header is what ``add_generation_prompt=True`` adds to
  ``render(messages[:i])``: the runtime feeds it, the model generates the rest;
- content is located in the turn text; each tool call is the text one more call adds
  (rendering the message with calls ``[:j]``); the footer after content and calls is
  generated up to and including the end-of-turn token text (``eos_token``), and the rest
  of the footer (e.g. ChatML's trailing newline) is the next prompt's, never generated.

A template whose renderings are not prefixes of each other (one that rewrites earlier
turns when a later one is added, e.g. by dropping earlier reasoning) has no stable token
boundaries for the whole thread: :func:`template_pieces` raises
:class:`~replay.exceptions.NotPrefixStableError` naming the turn and the rewritten text,
and :func:`replay.render.render_episodes` renders the thread per assistant turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hebrus_flywheel.replay.exceptions import NotPrefixStableError, RenderError


@dataclass(frozen=True)
class Piece:
    """Text of one turn piece: ``kind`` (a segment kind) and whether it is generated."""

    turn: int
    kind: str
    generated: bool
    text: str


class TemplateRenderer:
    """Renders message lists with one chat template and the tokenizer's special tokens."""

    def __init__(self, template: str, special_tokens: Mapping[str, str | None]) -> None:
        self.template = template
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.end_of_turn = self.special_tokens.get("eos_token") or ""

    def render(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool = False
               ) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        render: Any = render_jinja_template
        try:
            rendered, _ = render(
                conversations=[[dict(m) for m in messages]], chat_template=self.template,
                add_generation_prompt=generation_prompt, **self.special_tokens,
            )
        except Exception as exc:  # jinja raises TemplateError, raise_exception anything
            if not messages:
                return ""
            raise RenderError(
                f"the chat template cannot render these messages ({type(exc).__name__}: "
                f"{exc}); fix the thread or pass a template that accepts it (--chat-template)"
            ) from exc
        return str(rendered[0])


def _after(longer: str, prefix: str, what: str) -> str:
    if not longer.startswith(prefix):
        at = next((i for i, (a, b) in enumerate(zip(longer, prefix, strict=False)) if a != b),
                  min(len(longer), len(prefix)))
        raise NotPrefixStableError(
            f"the chat template is not prefix-stable at {what}: rendering one more message "
            f"rewrites earlier text (at character {at}: {prefix[at:at + 40]!r} becomes "
            f"{longer[at:at + 40]!r}), so token boundaries are not stable; capture renders "
            "such threads per assistant turn (replay.render.render_episodes), or pass a "
            "template that renders each message independently (--chat-template FILE)"
        )
    return longer[len(prefix):]


class ContentNotLocatedError(RenderError):
    """The template transforms a message's content (e.g. splits a ``<think>`` block out
    of it), so where the content lies in the rendering cannot be found."""


SENTINEL = "\u2063FLYWHEEL-CONTENT\u2063"
"""Stands in for a message's content to find where the template puts it."""


def _split_at_content(renderer: TemplateRenderer, before: list[dict[str, Any]],
                      message: dict[str, Any], opened: str, text: str, turn: int,
                      empty_at: int) -> tuple[str, str, str]:
    """``(before_content, content, after_content)`` of the turn ``text``; empty content
    is placed at ``empty_at`` (a stand-in could change what the template prints)."""
    content = message.get("content") or ""
    if not content:
        return text[:empty_at], "", text[empty_at:]
    probe = _after(renderer.render([*before, {**message, "content": SENTINEL}]), opened,
                   f"message {turn}")
    head, found, tail = probe.partition(SENTINEL)
    if found and text.startswith(head) and text.endswith(tail) \
            and len(head) + len(tail) <= len(text):
        return head, text[len(head):len(text) - len(tail)], tail  # as the template printed it
    raise ContentNotLocatedError(
        f"the chat template renders message {turn}'s content in a way its surroundings "
        "depend on, so its tokens cannot be located; pass a template that prints the "
        "content in one place (--chat-template FILE)"
    )


def _call_texts(renderer: TemplateRenderer, before: list[dict[str, Any]],
                message: dict[str, Any], tail: str) -> list[str] | None:
    """Text of each tool call in ``tail`` (what one more call adds); None if the template
    does not render calls as consecutive blocks right after the content."""
    calls = message.get("tool_calls") or []
    lengths = [len(renderer.render([*before, {**message, "tool_calls": calls[:j]}]))
               for j in range(len(calls) + 1)]
    texts, cursor = [], 0
    for j in range(len(calls)):
        size = lengths[j + 1] - lengths[j]
        if size <= 0:
            return None
        texts.append(tail[cursor:cursor + size])
        cursor += size
    footer = tail[cursor:]
    without = renderer.render([*before, {**message, "tool_calls": []}])
    return texts if without.endswith(footer) else None


def _footer_pieces(turn: int, footer: str, generated: bool, end_of_turn: str) -> list[Piece]:
    """The footer, generated (assistant) up to and including the end-of-turn text."""
    if end_of_turn and end_of_turn in footer:
        cut = footer.index(end_of_turn) + len(end_of_turn)
    else:
        cut = len(footer.rstrip())
    return [Piece(turn, "footer", generated, footer[:cut]),
            Piece(turn, "footer", False, footer[cut:])]


def _assistant_pieces(renderer: TemplateRenderer, messages: list[dict[str, Any]], turn: int,
                      opened: str, text: str) -> list[Piece]:
    prompt = renderer.render(messages[:turn], generation_prompt=True)
    header = _after(prompt, opened, f"the generation prompt before message {turn}")
    _after(text, header, f"message {turn} (the generation prompt is not its start)")
    message = messages[turn]
    try:
        head, content, tail = _split_at_content(
            renderer, messages[:turn], message, opened, text, turn, len(header))
    except ContentNotLocatedError:  # the reply is still all generated: one content piece
        rest, end_text = text[len(header):], renderer.end_of_turn
        cut = rest.find(end_text) if end_text and end_text in rest else len(rest.rstrip())
        return [Piece(turn, "header", False, header), Piece(turn, "content", True, rest[:cut]),
                *_footer_pieces(turn, rest[cut:], True, end_text)]
    if not head.startswith(header):
        raise RenderError(f"message {turn}'s content starts inside the generation prompt; "
                          "the template's assistant header is not a prompt prefix")
    pieces = [Piece(turn, "header", False, header),
              Piece(turn, "content", True, head[len(header):]),  # e.g. an empty think block
              Piece(turn, "content", True, content)]
    if message.get("tool_calls"):
        texts = _call_texts(renderer, messages[:turn], message, tail)
        if texts is None:  # not separable: everything before the end-of-turn text
            eot = tail.find(renderer.end_of_turn) if renderer.end_of_turn else -1
            texts = [tail[:eot] if eot > 0 else tail]
        pieces.extend(Piece(turn, "tool_call", True, t) for t in texts)
        tail = tail[len("".join(texts)):]
    return pieces + _footer_pieces(turn, tail, True, renderer.end_of_turn)


def _other_pieces(renderer: TemplateRenderer, messages: list[dict[str, Any]], turn: int,
                  opened: str, text: str) -> list[Piece]:
    eot = text.find(renderer.end_of_turn) if renderer.end_of_turn else -1
    head, content, tail = _split_at_content(
        renderer, messages[:turn], messages[turn], opened, text, turn,
        eot if eot >= 0 else len(text))
    return [Piece(turn, "header", False, head), Piece(turn, "content", False, content),
            *_footer_pieces(turn, tail, False, renderer.end_of_turn)]


def template_pieces(renderer: TemplateRenderer, messages: list[dict[str, Any]]) -> list[Piece]:
    """Every message's non-empty pieces; their concatenation is ``render(messages)``.

    What ``render([])`` prints (a BOS, a default system prompt) is prepended to the first
    message's header."""
    pieces: list[Piece] = []
    done = preamble = renderer.render([])
    for turn, message in enumerate(messages):
        upto = renderer.render(messages[: turn + 1])
        text = _after(upto, done, f"message {turn}")
        build = _assistant_pieces if message.get("role") == "assistant" else _other_pieces
        own = build(renderer, messages, turn, done, text)
        if turn == 0 and preamble:
            own[0] = Piece(0, own[0].kind, False, preamble + own[0].text)
        pieces.extend(p for p in own if p.text)
        done = upto
    if "".join(p.text for p in pieces) != renderer.render(messages):
        raise RenderError("internal error: the template pieces do not add up to its rendering")
    return pieces


def last_turn_pieces(renderer: TemplateRenderer, messages: list[dict[str, Any]],
                     history: str) -> list[Piece]:
    """The non-empty pieces of the last message of ``messages``, rendered after
    ``history`` (what the template printed for the other messages at that point)."""
    turn = len(messages) - 1
    text = _after(renderer.render(messages), history, f"message {turn}")
    build = _assistant_pieces if messages[-1].get("role") == "assistant" else _other_pieces
    return [p for p in build(renderer, messages, turn, history, text) if p.text]
