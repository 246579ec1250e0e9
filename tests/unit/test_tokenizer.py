"""The offline byte-level BPE tokenizer, its chat template and identity digests."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.exceptions import TokenizerError
from hebrus_flywheel.replay.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TokenizerBuildConfig,
    build_tokenizer,
    chat_template_digest,
    ensure_tokenizer,
    load_hf_tokenizer,
    load_tokenizer,
    tokenizer_digest,
)

MIXED_TEXT = (
    "def f(x):\n    return x * 2  # ok\n"
    "Grüße aus Köln! ¿Qué tal? 日本語のテキストと中文文本。\n\n  \t trailing  \n"
    "SELECT * FROM t WHERE a >= 10; 🚀 \u00e9\u0301"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_files_vocab_and_specials(tok_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tok_dir / name).is_file()
    loaded = load_tokenizer(tok_dir)
    assert loaded.tokenizer.get_vocab_size() == 4096
    assert [loaded.token_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert loaded.eos_id == 2 and loaded.pad_id == 0
    for token in SPECIAL_TOKENS:
        encoding = loaded.tokenizer.encode(f"a{token}b", add_special_tokens=False)
        assert encoding.tokens[1] == token and len(encoding.ids) == 3


def test_roundtrip_is_exact(tok_dir: Path) -> None:
    tokenizer = load_tokenizer(tok_dir).tokenizer
    ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == MIXED_TEXT


def test_build_is_byte_identical_across_processes(tok_dir: Path, tmp_path: Path) -> None:
    script = (
        "import sys; from replay.tokenizer import build_tokenizer; build_tokenizer(sys.argv[1])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "TOKENIZERS_PARALLELISM": "true"}
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=env,
                   cwd=Path(__file__).resolve().parents[2], timeout=120)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes()
    assert tokenizer_digest(tmp_path) == tokenizer_digest(tok_dir)


def test_rebuild_in_place_is_identical(tok_dir: Path, tmp_path: Path) -> None:
    copy = build_tokenizer(tmp_path / "again")
    assert tokenizer_digest(copy) == tokenizer_digest(tok_dir)
    assert ensure_tokenizer(copy) == copy


def test_vocab_size_is_configurable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # only the tokenizer's own records: a background thread of an earlier test in this
    # process (a Kafka client retrying) may log into caplog too
    def own() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "hebrus_flywheel.replay.tokenizer"]
    loaded = load_tokenizer(build_tokenizer(tmp_path / "small", vocab_size=1024))
    assert loaded.tokenizer.get_vocab_size() == 1024
    assert not own()
    capped = load_tokenizer(build_tokenizer(tmp_path / "big", vocab_size=60_000))
    assert capped.tokenizer.get_vocab_size() < 60_000
    assert any("fewer than the requested 60000" in m for m in own())


def test_digests(tok_dir: Path) -> None:
    expected = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert tokenizer_digest(tok_dir) == expected
    template_digest = hashlib.sha256(CHAT_TEMPLATE.encode("utf-8")).hexdigest()
    assert chat_template_digest(tok_dir) == template_digest
    loaded = load_tokenizer(tok_dir)
    assert (loaded.tokenizer_digest, loaded.chat_template_digest) == (expected, template_digest)


def test_template_file_takes_precedence(tok_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}", encoding="utf-8")
    assert load_tokenizer(tmp_path).chat_template == "{{ messages }}"
    assert chat_template_digest(tmp_path) != chat_template_digest(tok_dir)


def test_transformers_loads_offline_with_chatml(tok_dir: Path) -> None:
    hf = load_hf_tokenizer(tok_dir)
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "function": {"name": "run_shell",
                                              "arguments": {"command": "ls é"}}}]},
        {"role": "tool", "content": "a.txt"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "x", "arguments": '{"a": 1}'}},
            {"type": "function", "function": {"name": "y", "arguments": {}}}]},
    ]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nList files.<|im_end|>\n"
        "<|im_start|>assistant\nLet me check.\n<tool_call>\n"
        '{"name": "run_shell", "arguments": {"command": "ls é"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\na.txt<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "x", "arguments": {"a": 1}}\n'
        '</tool_call>\n<tool_call>\n{"name": "y", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    fast = load_tokenizer(tok_dir).tokenizer
    assert hf.encode(text, add_special_tokens=False) == fast.encode(
        text, add_special_tokens=False).ids


def test_missing_directory_or_files(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="build_tokenizer"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        tokenizer_digest(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    with pytest.raises(TokenizerError, match="chat_template"):
        chat_template_digest(tmp_path)


def test_corrupt_or_foreign_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot be parsed"):
        load_tokenizer(tmp_path)
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(TokenizerError, match="--chat-template FILE"):
        load_tokenizer(tmp_path)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    with pytest.raises(TokenizerError, match=re.escape("'</s>'")):
        load_tokenizer(tmp_path, chat_template_file=template)
    with pytest.raises(TokenizerError, match="cannot read the chat template"):
        load_tokenizer(tmp_path, chat_template_file=tmp_path / "absent.jinja")


@pytest.mark.parametrize(
    "kwargs", [{"vocab_size": 100}, {"min_frequency": 0}, {"synthetic_threads": -1},
               {"model_max_length": True}],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        TokenizerBuildConfig(**kwargs)
