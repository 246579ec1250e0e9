"""The secrets and tool-output policy: which windows are dropped before replay.

Redacting a window would change its tokens and break route parity, so a window whose
text holds a secret, or a turn the policy excludes, is dropped whole: never replayed,
never written into a shard and never copied into the quarantine. Only the reason is
counted (``secret:<plugin>``, ``pattern:<name>``, ``tool_output``).

The text is the teacher's tokenizer decoding the window's tokens. It is scanned with
detect-secrets' plugins, called in-process (``analyze_string``: no baseline,
no filters, no network verification), plus configurable regular expressions (e-mail
addresses and phone numbers by default). detect-secrets' high-entropy plugins only look
inside quotes; chat text leaves secrets unquoted, so every run of their alphabet of at
least ``min_entropy_length`` characters holding a digit is measured as well.

What this does not catch: secrets split across windows, encoded or obfuscated secrets
(rot13, spaced out, in another script), low-entropy passwords without a known prefix,
personal data other than the configured patterns (names, addresses), and tool outputs
whose turn is not marked with the excluded role.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.configfile import read_toml
from hebrus_flywheel.core.errors import ConfigError

# detect-secrets plugins (class names) that are cheap and precise on free text. Left
# out by default: KeywordDetector (flags every `password = f()`), IPPublicDetector (an
# address is not a secret), the Cloudant, IBM and SoftLayer keyword detectors (noisy).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "AWSKeyDetector", "ArtifactoryDetector", "AzureStorageKeyDetector", "BasicAuthDetector",
    "DiscordBotTokenDetector", "GitHubTokenDetector", "GitLabTokenDetector",
    "JwtTokenDetector", "MailchimpDetector", "NpmDetector", "OpenAIDetector",
    "PrivateKeyDetector", "PypiTokenDetector", "SendGridDetector", "SlackDetector",
    "SquareOAuthDetector", "StripeDetector", "TelegramBotTokenDetector", "TwilioKeyDetector",
    "Base64HighEntropyString", "HexHighEntropyString",
)
ENTROPY_PLUGINS = {"Base64HighEntropyString": "base64_limit",
                   "HexHighEntropyString": "hex_limit"}
DEFAULT_PATTERNS: Mapping[str, str] = {
    "email": r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b",
    "phone": r"(?<![\w.])\+?\(?\d{1,3}\)?[ .-]\(?\d{2,4}\)?[ .-]\d{3,4}[ .-]\d{3,4}(?![\w.])",
}
TOOL_OUTPUT = "tool_output"
# Links are left out of the unquoted entropy runs: commit hashes and slugs in URLs are
# high-entropy but public. A run without a digit is never a secret (alphabets, words).
_URL = re.compile(r"https?://\S+")
_DIGIT = re.compile(r"\d")


@dataclass(frozen=True, kw_only=True)
class ContentPolicyConfig:
    """What the replay worker drops before replay (settable from the ``[content_policy]``
    table of a TOML file, see :func:`policy_from_mapping`).

    Fields:
        enabled: False turns the whole policy off (every window is replayed).
        plugins: detect-secrets plugin class names to run (see ``DEFAULT_PLUGINS``).
        base64_limit: Shannon entropy (bits per character) above which a base64-alphabet
            string is a secret (detect-secrets' default 4.5).
        hex_limit: the same for hex strings (default 3.0).
        min_entropy_length: shortest unquoted run measured by the entropy plugins.
        patterns: name -> regular expression; a match drops the window as
            ``pattern:<name>``. Defaults: e-mail addresses and phone numbers.
        excluded_roles: turn roles whose content is a tool output the policy excludes
            (e.g. ``("tool",)``); a window overlapping such a turn is dropped as
            ``tool_output``. Default: none.
    """

    enabled: bool = True
    plugins: tuple[str, ...] = DEFAULT_PLUGINS
    base64_limit: float = 4.5
    hex_limit: float = 3.0
    min_entropy_length: int = 20
    patterns: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_PATTERNS))
    excluded_roles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "plugins", tuple(self.plugins))
        object.__setattr__(self, "excluded_roles", tuple(self.excluded_roles))
        object.__setattr__(self, "patterns", dict(self.patterns))
        known = _plugin_classes()
        unknown = [p for p in self.plugins if p not in known]
        if unknown:
            raise ConfigError(f"ContentPolicyConfig.plugins: unknown detect-secrets plugins "
                              f"{unknown}; choose from {sorted(known)}")
        for name in ("base64_limit", "hex_limit"):
            if not 0.0 <= float(getattr(self, name)) <= 8.0:
                raise ConfigError(f"ContentPolicyConfig.{name} must be between 0 and 8 bits")
        if isinstance(self.min_entropy_length, bool) or not isinstance(
                self.min_entropy_length, int) or self.min_entropy_length < 8:
            raise ConfigError("ContentPolicyConfig.min_entropy_length must be an integer >= 8")
        for name, pattern in self.patterns.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"ContentPolicyConfig.patterns[{name!r}]: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; recorded in the dataset's determinism record (and manifests)."""
        return {"enabled": self.enabled, "plugins": list(self.plugins),
                "base64_limit": self.base64_limit, "hex_limit": self.hex_limit,
                "min_entropy_length": self.min_entropy_length,
                "patterns": dict(sorted(self.patterns.items())),
                "excluded_roles": list(self.excluded_roles)}


def policy_from_mapping(data: Mapping[str, Any], where: str = "content_policy"
                        ) -> ContentPolicyConfig:
    """A config from a mapping (a TOML table or a recorded ``to_dict()``)."""
    allowed = set(ContentPolicyConfig.__dataclass_fields__)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    values = dict(data)
    for name in ("plugins", "excluded_roles"):
        if name in values:
            values[name] = tuple(values[name])
    return ContentPolicyConfig(**values)


def policy_from_file(path: Path) -> ContentPolicyConfig:
    """The ``[content_policy]`` table of a TOML file (missing table: the defaults)."""
    table = read_toml(path).get("content_policy", {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"{path}: [content_policy] must be a table")
    return policy_from_mapping(table, f"{path} [content_policy]")


@functools.cache
def _plugin_classes() -> dict[str, type]:
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

    classes: list[type] = list(get_mapping_from_secret_type_to_class().values())
    return {cls.__name__: cls for cls in classes}


@dataclass(frozen=True, kw_only=True)
class Finding:
    """Why a text is refused: the reason code, and what matched (never the value)."""

    reason: str
    detail: str


class SecretScanner:
    """Scans text for secrets and configured patterns; returns reasons, never values."""

    def __init__(self, config: ContentPolicyConfig) -> None:
        classes = _plugin_classes()
        self._plugins: list[tuple[str, Any]] = []
        self._entropy: list[tuple[str, Any, re.Pattern[str]]] = []
        for name in config.plugins:
            cls = classes[name]
            if name in ENTROPY_PLUGINS:
                plugin = cls(limit=float(getattr(config, ENTROPY_PLUGINS[name])))
                run = re.compile(f"[{re.escape(plugin.charset)}]{{{config.min_entropy_length},}}")
                self._entropy.append((name, plugin, run))
            else:
                self._plugins.append((name, cls()))
        self._patterns = [(n, re.compile(p)) for n, p in sorted(config.patterns.items())]

    def _entropy_hit(self, plugin: Any, run: re.Pattern[str], text: str) -> bool:
        candidates = list(plugin.analyze_string(text))  # quoted strings, as detect-secrets
        candidates += run.findall(_URL.sub(" ", text))  # unquoted runs outside links
        return any(_DIGIT.search(c) and plugin.calculate_shannon_entropy(c) > plugin.entropy_limit
                   for c in candidates)

    def scan(self, text: str) -> Finding | None:
        """The first finding in ``text`` (patterns, then plugins, then entropy).

        The plugins run on the whole text at once: none of their expressions crosses a
        line end (``^``/``$`` only stand beside whitespace), so this finds what a
        line-by-line scan finds, at a fraction of the calls."""
        for name, pattern in self._patterns:
            if pattern.search(text):
                return Finding(reason=f"pattern:{name}", detail=f"matches pattern {name!r}")
        for name, plugin in self._plugins:
            if next(iter(plugin.analyze_string(text)), None) is not None:
                return Finding(reason=f"secret:{name}", detail=plugin.secret_type)
        for name, plugin, run in self._entropy:
            if self._entropy_hit(plugin, run, text):
                return Finding(reason=f"secret:{name}", detail=plugin.secret_type)
        return None


Decoder = Callable[[Sequence[int]], str]


class ContentPolicy:
    """``screen(window) -> Finding | None``: the one check run before replay."""

    def __init__(self, config: ContentPolicyConfig, decode: Decoder) -> None:
        self.config = config
        self._decode = decode
        self._scanner = SecretScanner(config)
        self._roles = frozenset(config.excluded_roles)

    def screen(self, window: Mapping[str, Any]) -> Finding | None:
        if not self.config.enabled:
            return None
        roles = {str(t.get("role")) for t in _turns(window.get("turns"))}
        excluded = sorted(roles & self._roles)
        if excluded:
            return Finding(reason=TOOL_OUTPUT, detail=f"overlaps a turn of role {excluded}")
        return self._scanner.scan(self._decode(window.get("token_ids") or ()))


def _turns(turns: Iterable[Any] | None) -> Iterable[Mapping[str, Any]]:
    return [t for t in turns or () if isinstance(t, Mapping)]


def tokenizer_decoder(tokenizer_dir: Any) -> Decoder:
    """Decode with the teacher's tokenizer (``tokenizer.json`` in ``tokenizer_dir``)."""
    from hebrus_flywheel.replay.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir).tokenizer

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))

    return decode
