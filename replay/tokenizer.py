"""The flywheel's offline tokenizer: byte-level BPE plus a ChatML (Qwen-style) template.

:func:`build_tokenizer` trains a Hugging Face ``tokenizers`` byte-level BPE on the corpus
shipped in ``replay/data`` plus message text from the synthetic generator (fixed seed),
single-threaded and in a fixed input order, and writes a directory that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads offline:

- ``tokenizer.json``: the tokenizer (byte-identical across builds with the same config);
- ``tokenizer_config.json``: class, special tokens and :data:`CHAT_TEMPLATE`;
- ``special_tokens_map.json``.

Special tokens are ``<|endoftext|>`` (pad, id 0), ``<|im_start|>``, ``<|im_end|>`` (eos),
``<tool_call>`` and ``</tool_call>``; all are atomic added tokens. There is no
normalizer, so ``decode(encode(text)) == text`` for any text.

:func:`tokenizer_digest` and :func:`chat_template_digest` are the identity digests that
records carry; :func:`load_tokenizer` returns a :class:`LoadedTokenizer`.

Loading works for ANY checkpoint's ``tokenizer.json``: the chat template is the
directory's own (``chat_template.jinja``, else ``tokenizer_config.json``'s, a named
list's ``default`` included), replaced by ``flywheel --chat-template FILE``
(``$FLYWHEEL_CHAT_TEMPLATE``); a tokenizer without one is refused with that fix named.
The special tokens (``eos_token`` ends an assistant turn) come from the tokenizer config;
the ChatML tokens above are required only by the project's own ChatML helpers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write_text, make_dirs
from hebrus_flywheel.replay.exceptions import TokenizerError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END)
_LOG = logging.getLogger(__name__)
EOS_TOKEN = IM_END
PAD_TOKEN = ENDOFTEXT

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"  # read if present (transformers gives it precedence)
CHAT_TEMPLATE_ENV = "FLYWHEEL_CHAT_TEMPLATE"
"""A Jinja chat-template file used instead of the tokenizer's own (``flywheel
--chat-template FILE`` sets it, so every process of a run renders alike)."""

# The Qwen2 pre-tokenization split: contractions, words with one leading non-letter,
# single digits, punctuation runs, newline runs, other whitespace.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML. Every message renders as "<|im_start|>{role}\n{content}<|im_end|>\n"; an
# assistant's tool calls follow its content, each as "<tool_call>\n{json}\n</tool_call>",
# preceded by "\n" unless it is the first call and the content is empty.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}"
    "{%- endif %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + tool_call['name'] | tojson + ', \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True, kw_only=True)
class TokenizerBuildConfig:
    """How the default tokenizer is trained. Same config, same ``tokenizer.json`` bytes.

    Fields:
        vocab_size: maximum vocabulary size including the special tokens (>= 512);
            reached exactly up to about 7,500 with the default corpus.
        min_frequency: a pair must occur this often to be merged.
        synthetic_threads: synthetic threads whose text is added to the corpus.
        synthetic_seed: seed of those synthetic threads.
        model_max_length: ``model_max_length`` written to ``tokenizer_config.json``.
    """

    vocab_size: int = 4096
    min_frequency: int = 2
    synthetic_threads: int = 600
    synthetic_seed: int = 20260831
    model_max_length: int = 32768

    def __post_init__(self) -> None:
        for name in ("vocab_size", "min_frequency", "model_max_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.vocab_size < 512:
            raise ConfigError(
                f"vocab_size must be >= 512 (256 byte symbols + specials + merges), "
                f"got {self.vocab_size}"
            )
        if self.synthetic_threads < 0:
            raise ConfigError("synthetic_threads must be >= 0")


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer directory, loaded: the ``tokenizers.Tokenizer``, its chat template (the
    checkpoint's own, or the ``--chat-template`` file that replaces a missing one) and
    its special tokens (``eos_token``, ``bos_token``, ``pad_token`` ... as text)."""

    tokenizer: Tokenizer
    chat_template: str
    directory: Path
    tokenizer_digest: str
    chat_template_digest: str
    special_tokens: Mapping[str, str | None] = field(default_factory=dict)

    def token_id(self, token: str) -> int:
        """The id of a special token; TokenizerError if the vocabulary lacks it."""
        return special_token_id(self.tokenizer, token)

    @property
    def eos_id(self) -> int:
        return self.token_id(self.special_tokens.get("eos_token") or EOS_TOKEN)

    @property
    def pad_id(self) -> int:
        pad = self.special_tokens.get("pad_token") or self.special_tokens.get("eos_token")
        return self.token_id(pad or PAD_TOKEN)

    def reserved_texts(self) -> tuple[str, ...]:
        """Text of every special added token (message text must not contain them)."""
        added = self.tokenizer.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special and t.content}))


def special_token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of ``token``; TokenizerError if it is missing from the vocabulary."""
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise TokenizerError(
            f"the tokenizer has no {token!r} token; check the tokenizer's special tokens "
            "(the project's own render needs the ChatML special tokens of "
            "replay.tokenizer.build_tokenizer)"
        )
    return token_id


# --- building ---------------------------------------------------------------------------


def _new_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def training_texts(config: TokenizerBuildConfig) -> Iterator[str]:
    """The training input in its fixed order: corpus files, then synthetic messages."""
    from hebrus_flywheel.replay.synthetic import corpus_texts, generate_threads

    for _name, text in corpus_texts():
        yield text
    for thread in generate_threads(config.synthetic_threads, seed=config.synthetic_seed):
        for message in thread.messages:
            yield f"{message.role}\n{message.content}"
            for call in message.tool_calls:
                payload = {"name": call.name, "arguments": call.arguments}
                yield "\n" + json.dumps(payload, ensure_ascii=False) + "\n"


@contextmanager
def _single_threaded() -> Iterator[None]:
    """Disable the tokenizers thread pool while training (restores the old setting)."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def train_tokenizer(config: TokenizerBuildConfig) -> Tokenizer:
    """Train the byte-level BPE in memory (deterministic for a given config)."""
    tokenizer = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _single_threaded():
        tokenizer.train_from_iterator(training_texts(config), trainer=trainer)
    for token in SPECIAL_TOKENS:
        special_token_id(tokenizer, token)
    return tokenizer


def _tokenizer_config(config: TokenizerBuildConfig) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "extra_special_tokens": [IM_START, TOOL_CALL_START, TOOL_CALL_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "extra_special_tokens": [IM_START, TOOL_CALL_START, TOOL_CALL_END],
    }


def _dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def build_tokenizer(
    out_dir: str | Path, *, vocab_size: int | None = None,
    config: TokenizerBuildConfig | None = None,
) -> Path:
    """Train the tokenizer and write it to ``out_dir``; return ``out_dir``.

    ``vocab_size`` overrides ``config.vocab_size``; the result has at most that many
    entries (the shipped corpus supports about 7,500, so larger requests are capped, with
    a warning). Existing files are replaced atomically. Takes about a second on one core.
    """
    cfg = config or TokenizerBuildConfig()
    if vocab_size is not None:
        cfg = replace(cfg, vocab_size=vocab_size)
    target = Path(out_dir)
    try:
        make_dirs(target)
    except OSError as exc:
        raise TokenizerError(f"cannot create tokenizer directory {target}: {exc}") from None
    tokenizer = train_tokenizer(cfg)
    if tokenizer.get_vocab_size() < cfg.vocab_size:
        _LOG.warning(
            "tokenizer vocabulary has %d entries, fewer than the requested %d: the offline "
            "corpus supports only that many merges; size the model's embedding from the "
            "tokenizer, not from the request",
            tokenizer.get_vocab_size(), cfg.vocab_size,
        )
    atomic_write_text(target / TOKENIZER_FILE, tokenizer.to_str(pretty=True) + "\n")
    atomic_write_text(target / CONFIG_FILE, _dump(_tokenizer_config(cfg)))
    atomic_write_text(target / SPECIAL_TOKENS_MAP_FILE, _dump(_special_tokens_map()))
    return target


def ensure_tokenizer(out_dir: str | Path, *, vocab_size: int | None = None) -> Path:
    """Build the tokenizer into ``out_dir`` unless a loadable one is already there."""
    target = Path(out_dir)
    if not (target / TOKENIZER_FILE).is_file():
        return build_tokenizer(target, vocab_size=vocab_size)
    load_tokenizer(target)
    return target


# --- loading and identity ----------------------------------------------------------------


def _require_file(directory: Path, name: str) -> Path:
    path = directory / name
    if not path.is_file():
        raise TokenizerError(
            f"{path} is missing; point at a tokenizer directory or build one with "
            "replay.tokenizer.build_tokenizer(out_dir)"
        )
    return path


def _template_text(value: object) -> str | None:
    """A config's ``chat_template``: a string, or the ``default`` of a list of named ones."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) and default else None
    return None


def _read_config(base: Path) -> dict[str, Any]:
    config_path = _require_file(base, CONFIG_FILE)
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{config_path} is not valid JSON ({exc.msg}); rebuild it") from None
    return data if isinstance(data, dict) else {}


def read_chat_template(directory: str | Path, chat_template_file: str | Path | None = None) -> str:
    """The chat template text: ``chat_template_file`` if given (else ``$FLYWHEEL_CHAT_TEMPLATE``),
    else the directory's ``chat_template.jinja``, else ``tokenizer_config.json``'s."""
    base = Path(directory)
    chat_template_file = chat_template_file or os.environ.get(CHAT_TEMPLATE_ENV) or None
    if chat_template_file is not None:
        try:
            text = Path(chat_template_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise TokenizerError(f"cannot read the chat template {chat_template_file}: "
                                 f"{exc.strerror or exc}; pass an existing Jinja file") from None
        if not text.strip():
            raise TokenizerError(f"the chat template {chat_template_file} is empty")
        return text
    if (base / TEMPLATE_FILE).is_file():
        return (base / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = _template_text(_read_config(base).get("chat_template"))
    if template is None:
        raise TokenizerError(
            f"the tokenizer in {base} has no chat template (no {TEMPLATE_FILE} and no "
            f"'chat_template' in {CONFIG_FILE}); pass the model's template with "
            "`flywheel --chat-template FILE ...` (or set $FLYWHEEL_CHAT_TEMPLATE)"
        )
    return template


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def read_special_tokens(directory: str | Path) -> dict[str, str | None]:
    """``bos_token``, ``eos_token``, ``pad_token``, ``unk_token`` as text (None if unset):
    ``tokenizer_config.json`` first, then ``special_tokens_map.json``."""
    base = Path(directory)
    found: dict[str, str | None] = {}
    sources = [_read_config(base)]
    if (base / SPECIAL_TOKENS_MAP_FILE).is_file():
        with suppress(json.JSONDecodeError):
            sources.append(json.loads((base / SPECIAL_TOKENS_MAP_FILE).read_text("utf-8")))
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        found[name] = next((t for src in sources if (t := _token_text(src.get(name)))), None)
    return found


def tokenizer_digest(directory: str | Path) -> str:
    """SHA-256 (hex) of the directory's ``tokenizer.json`` bytes."""
    path = _require_file(Path(directory), TOKENIZER_FILE)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def chat_template_digest(directory: str | Path, chat_template_file: str | Path | None = None
                         ) -> str:
    """SHA-256 (hex) of the chat template text in use (UTF-8)."""
    text = read_chat_template(directory, chat_template_file)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_tokenizer(directory: str | Path, *, chat_template_file: str | Path | None = None
                   ) -> LoadedTokenizer:
    """Load ``tokenizer.json``, the chat template (``chat_template_file`` replaces the
    directory's) and the special tokens; TokenizerError if anything is off."""
    base = Path(directory)
    path = _require_file(base, TOKENIZER_FILE)
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise TokenizerError(
            f"{path} cannot be parsed as a tokenizers file ({exc}); rebuild the tokenizer"
        ) from None
    template = read_chat_template(base, chat_template_file)
    specials = read_special_tokens(base)
    for name in ("eos_token",):
        if specials.get(name) is None:
            raise TokenizerError(f"{base / CONFIG_FILE} names no {name}; the end of an "
                                 "assistant turn cannot be found without it")
        special_token_id(tokenizer, str(specials[name]))
    return LoadedTokenizer(
        tokenizer=tokenizer,
        chat_template=template,
        directory=base,
        tokenizer_digest=tokenizer_digest(base),
        chat_template_digest=hashlib.sha256(template.encode("utf-8")).hexdigest(),
        special_tokens=specials,
    )


def load_hf_tokenizer(directory: str | Path) -> Any:
    """The directory as a ``transformers`` fast tokenizer, loaded strictly offline."""
    base = Path(directory)
    _require_file(base, TOKENIZER_FILE)
    _require_file(base, CONFIG_FILE)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerError(
            f"transformers cannot load the tokenizer in {base} ({exc}); rebuild it"
        ) from None
