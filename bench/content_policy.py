"""Cost of the secrets and tool-output policy the replay worker runs on every window.

Windows of W tokens are cut from the shipped multilingual/code corpus with the teacher's
tokenizer (built into a scratch folder) and screened by ``ContentPolicy.screen`` with
the default configuration, exactly as the worker does before replay: decode the tokens,
then scan the text (patterns, detect-secrets plugins line by line, entropy runs). One
JSON line per W: windows/s and microseconds per window (best of ``--repeats``), plus
how many windows the policy dropped (0 expected: the corpus holds no secrets).

Figures vary with the machine and its load; they are reported, never asserted.

    .venv/bin/python bench/content_policy.py [--lengths 256 1024 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support


def emit(figure: str, value: float | int | str, unit: str, **extra: Any) -> None:
    print(json.dumps({"bench": "content_policy", "figure": figure, "value": value,
                      "unit": unit, **extra}), flush=True)


def _windows(tokens: list[int], length: int, count: int) -> list[dict[str, Any]]:
    step = max(1, (len(tokens) - length) // max(count, 1))
    return [{"token_ids": tokens[i * step:i * step + length], "turns": []}
            for i in range(count) if i * step + length <= len(tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from hebrus_flywheel.consumers.content_policy import (
        ContentPolicy,
        ContentPolicyConfig,
        tokenizer_decoder,
    )
    from hebrus_flywheel.replay.tokenizer import ensure_tokenizer
    from tests.support.windows import corpus_token_ids

    with tempfile.TemporaryDirectory(prefix="bench-policy-") as scratch:
        tok_dir = ensure_tokenizer(Path(scratch) / "tokenizer")
        tokens = corpus_token_ids(tok_dir, files=tuple(
            p.name for p in sorted((Path(__file__).resolve().parents[1] / "replay" / "data")
                                   .glob("*.txt"))))
        policy = ContentPolicy(ContentPolicyConfig(), tokenizer_decoder(tok_dir))
        for length in args.lengths:
            windows = _windows(tokens, length, args.windows)
            best, dropped = float("inf"), 0
            for _ in range(args.repeats):
                start = time.perf_counter()
                dropped = sum(policy.screen(w) is not None for w in windows)
                best = min(best, time.perf_counter() - start)
            emit("secret_scan_windows_per_s", round(len(windows) / best, 1), "windows/s",
                 window_tokens=length, windows=len(windows), dropped=dropped,
                 us_per_window=round(1e6 * best / len(windows), 1),
                 corpus_tokens=len(tokens))


if __name__ == "__main__":
    main()
