"""The secrets and tool-output policy (``consumers.content_policy``): planted secrets are
found with their reason, clean prose and code are not, excluded roles drop a window,
and the configuration refuses what it cannot run."""

from __future__ import annotations

import collections
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.consumers.content_policy import (
    ContentPolicy,
    ContentPolicyConfig,
    SecretScanner,
    policy_from_file,
    policy_from_mapping,
)
from hebrus_flywheel.core.errors import ConfigError

DATA_DIR = Path(__file__).resolve().parents[2] / "replay" / "data"

# Well-known example values (documentation keys), never live credentials.
PEM = ("-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM2f\n"
       "-----END RSA PRIVATE KEY-----")
PLANTED = {
    "secret:AWSKeyDetector": "deploy with AKIAIOSFODNN7EXAMPLE and go",
    "secret:GitHubTokenDetector": "export GH_TOKEN=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",
    "secret:PrivateKeyDetector": f"here is the key:\n{PEM}\nkeep it safe",
    "secret:Base64HighEntropyString": "the session secret is aZ3kQ9vL2mX8pR7tW1yB5nC6dF0gH4jK",
    "secret:HexHighEntropyString": 'api_key = "8f4e2a9c71b3d05e6a1f9c2b7d4e8a03"',
    "secret:SlackDetector": "hook: xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    "secret:JwtTokenDetector": (
        "Bearer eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
        "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"),
    "pattern:email": "mail jane.doe@example.org for access",
    "pattern:phone": "call +1 415 555 0132 after six",
}
CLEAN = [
    "The quick brown fox jumps over the lazy dog while the committee debates the budget.",
    "def calculate_shannon_entropy(data: str) -> float:\n    return sum(p for p in data)",
    "SELECT owner_id, COUNT(*) FROM windows GROUP BY owner_id ORDER BY 2 DESC LIMIT 20;",
    "see https://github.com/pallets/click/blob/0aec1168ac591e159baf6f61026d6ae322c53aaf/x.py",
    "drive_letters = set('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ')",
    "version 2.13.0 released on 2024-05-01, build 20240501123045",
]
STDLIB = ("json", "argparse", "textwrap", "dataclasses", "pathlib", "typing", "logging",
          "http", "csv", "difflib", "shutil", "tarfile", "unittest")


@pytest.fixture(scope="module")
def scanner() -> SecretScanner:
    return SecretScanner(ContentPolicyConfig())


@pytest.mark.parametrize("reason", sorted(PLANTED))
def test_planted_secrets_are_found_with_their_reason(scanner: SecretScanner,
                                                     reason: str) -> None:
    finding = scanner.scan(PLANTED[reason])
    assert finding is not None and finding.reason == reason, finding
    # the finding names the kind, never the value
    assert PLANTED[reason].split()[-1] not in finding.detail


@pytest.mark.parametrize("text", CLEAN)
def test_clean_prose_and_code_are_not_flagged(scanner: SecretScanner, text: str) -> None:
    assert scanner.scan(text) is None


def _chunks(paths: list[Path], lines_per_chunk: int = 40) -> list[str]:
    out = []
    for path in paths:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        out += ["\n".join(lines[i:i + lines_per_chunk])
                for i in range(0, len(lines), lines_per_chunk)]
    return out


def _sources() -> list[Path]:
    paths = sorted(DATA_DIR.glob("*.txt"))
    for name in STDLIB:
        origin = Path(str(importlib.import_module(name).__file__))
        paths += sorted(origin.parent.glob("*.py")) if origin.name == "__init__.py" else [origin]
    return paths


def test_false_positive_rate_on_normal_text_and_code(scanner: SecretScanner) -> None:
    chunks = _chunks(_sources())
    reasons = collections.Counter(f.reason for c in chunks if (f := scanner.scan(c)))
    secrets = sum(n for r, n in reasons.items() if r.startswith("secret:"))
    print(json.dumps({"figure": "secret_scan_false_positives", "chunks": len(chunks),
                      "secret_hits": secrets, "rate": secrets / len(chunks),
                      "by_reason": dict(reasons)}))
    assert len(chunks) > 500
    assert secrets / len(chunks) <= 0.005, reasons
    # the project's own replay corpus is replayed by the demo: nothing may be dropped
    assert all(scanner.scan(c) is None for c in _chunks(sorted(DATA_DIR.glob("*.txt"))))


def _window(tokens: list[int], roles: tuple[str, ...] = ("user", "assistant")) -> dict[str, Any]:
    return {"token_ids": tokens, "turns": [{"role": r} for r in roles]}


def _decode(ids: Any) -> str:
    return "".join(chr(i) for i in ids)


def test_excluded_roles_drop_the_window_as_tool_output() -> None:
    text = [ord(c) for c in "the tool said: 42 rows"]
    default = ContentPolicy(ContentPolicyConfig(), _decode)
    assert default.screen(_window(text, ("user", "tool"))) is None
    strict = ContentPolicy(ContentPolicyConfig(excluded_roles=("tool",)), _decode)
    finding = strict.screen(_window(text, ("user", "tool")))
    assert finding is not None and finding.reason == "tool_output"
    assert strict.screen(_window(text)) is None


def test_the_window_text_is_what_gets_scanned_and_disabled_means_nothing_dropped() -> None:
    secret = [ord(c) for c in PLANTED["secret:AWSKeyDetector"]]
    found = ContentPolicy(ContentPolicyConfig(), _decode).screen(_window(secret))
    assert found is not None and found.reason == "secret:AWSKeyDetector"
    assert ContentPolicy(ContentPolicyConfig(enabled=False), _decode).screen(
        _window(secret)) is None


def test_custom_patterns_and_plugins_are_configurable(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text('[content_policy]\nplugins = ["AWSKeyDetector"]\nexcluded_roles = ["tool"]\n'
                    '[content_policy.patterns]\niban = "\\\\bDE\\\\d{20}\\\\b"\n')
    config = policy_from_file(path)
    assert config.plugins == ("AWSKeyDetector",) and config.excluded_roles == ("tool",)
    scanner = SecretScanner(config)
    iban = scanner.scan("pay to DE89370400440532013000 today")
    assert iban is not None and iban.reason == "pattern:iban"
    assert scanner.scan("mail jane.doe@example.org") is None  # patterns replaced, not merged
    assert policy_from_mapping(config.to_dict()) == config


@pytest.mark.parametrize(("values", "field"), [
    ({"plugins": ("NoSuchDetector",)}, "plugins"),
    ({"base64_limit": 9.0}, "base64_limit"),
    ({"min_entropy_length": 4}, "min_entropy_length"),
    ({"patterns": {"broken": "(unclosed"}}, "patterns"),
])
def test_bad_settings_are_refused_naming_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ContentPolicyConfig(**values)


def test_unknown_keys_in_a_config_table_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown keys"):
        policy_from_mapping({"enable": True})


def test_the_health_line_shows_windows_dropped_by_reason() -> None:
    from hebrus_flywheel.core.progress import format_health

    record = {"name": "replay", "pid": 1, "lag": 0, "processed": 8, "last_progress_at": 0.0,
              "policy_dropped": {"secret:AWSKeyDetector": 2, "tool_output": 1}}
    line = format_health(record, 1.0, alive=True)
    assert line.endswith("policy_dropped=3 (secret:AWSKeyDetector=2, tool_output=1)"), line
    del record["policy_dropped"]
    assert "policy_dropped" not in format_health(record, 1.0, alive=True)
