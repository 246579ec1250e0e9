"""A tokenizer with its own (non-ChatML) chat template renders with that template.

The tokenizer is the project's BPE with Llama-3-style special tokens added and a
Llama-3-style template (BOS, role headers, ``<|eot_id|>`` ends a turn, content trimmed).
The rendering must equal ``apply_chat_template``'s, the template digest must be that
template's, and the assistant targets must be what follows the generation prompt up to
and including ``<|eot_id|>``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from hebrus_flywheel.replay.conversations import Message, Thread, to_chat_messages
from hebrus_flywheel.replay.exceptions import RenderError, TokenizerError
from hebrus_flywheel.replay.render import prompt_and_targets, render_thread
from hebrus_flywheel.replay.synthetic import generate_threads
from hebrus_flywheel.replay.tokenizer import (
    CHAT_TEMPLATE_ENV,
    LoadedTokenizer,
    build_tokenizer,
    chat_template_digest,
    load_hf_tokenizer,
    load_tokenizer,
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = build_tokenizer(tmp_path_factory.mktemp("llama3"), vocab_size=1024)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|eot_id|>",
                  chat_template=LLAMA3_TEMPLATE, extra_special_tokens=SPECIALS[1:3])
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").unlink()
    return directory


@pytest.fixture(scope="module")
def loaded(llama_dir: Path) -> LoadedTokenizer:
    return load_tokenizer(llama_dir)


def _threads() -> list[Thread]:
    plain = [t for t in generate_threads(60, seed=11)
             if all(m.role != "tool" and not m.tool_calls for m in t.messages)]
    padded = Thread(owner="o", thread_id="pad", messages=(
        Message("system", "  be brief  "), Message("user", "\nhi\n"),
        Message("assistant", " hello "), Message("user", "again"), Message("assistant", "")))
    return [padded, *plain[:20]]


def test_rendering_equals_apply_chat_template(loaded: LoadedTokenizer, llama_dir: Path) -> None:
    hf = load_hf_tokenizer(llama_dir)
    for thread in _threads():
        rendered = render_thread(thread, loaded)
        text = hf.apply_chat_template(to_chat_messages(thread), tokenize=False)
        assert rendered.text == text
        assert list(rendered.token_ids) == hf.encode(text, add_special_tokens=False)
        assert rendered.token_ids[0] == loaded.token_id("<|begin_of_text|>")


def test_assistant_targets_follow_the_generation_prompt(
    loaded: LoadedTokenizer, llama_dir: Path
) -> None:
    hf = load_hf_tokenizer(llama_dir)
    eot = loaded.token_id("<|eot_id|>")
    assert loaded.eos_id == eot
    for thread in _threads():
        rendered = render_thread(thread, loaded)
        messages = to_chat_messages(thread)
        for index in rendered.assistant_turns():
            if not rendered.turns[index].generated_ids:
                continue
            prefix, targets = prompt_and_targets(rendered, index)
            prompt = hf.apply_chat_template(messages[:index], tokenize=False,
                                            add_generation_prompt=True)
            assert prefix == hf.encode(prompt, add_special_tokens=False)
            assert targets[-1] == eot and eot not in targets[:-1]
            turn = rendered.turns[index]
            assert next(s.kind for s in turn.segments) == "header"


def test_the_identity_digest_is_the_template_in_use(llama_dir: Path, tmp_path: Path) -> None:
    expected = hashlib.sha256(LLAMA3_TEMPLATE.encode()).hexdigest()
    assert chat_template_digest(llama_dir) == expected
    other = tmp_path / "other.jinja"
    other.write_text(LLAMA3_TEMPLATE.replace("| trim", ""))
    assert load_tokenizer(llama_dir, chat_template_file=other).chat_template_digest != expected
    assert chat_template_digest(llama_dir, other) != expected


def test_reserved_text_of_this_tokenizer_is_refused(loaded: LoadedTokenizer) -> None:
    thread = Thread(owner="o", thread_id="x", messages=(
        Message("user", "a <|eot_id|> b"), Message("assistant", "ok")))
    with pytest.raises(RenderError, match="reserved token"):
        render_thread(thread, loaded)


def test_the_environment_template_replaces_a_missing_one(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((llama_dir / "tokenizer.json").read_bytes())
    config = json.loads((llama_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="--chat-template FILE"):
        load_tokenizer(bare)
    template = tmp_path / "t.jinja"
    template.write_text(LLAMA3_TEMPLATE)
    monkeypatch.setenv(CHAT_TEMPLATE_ENV, str(template))
    assert load_tokenizer(bare).chat_template == LLAMA3_TEMPLATE
