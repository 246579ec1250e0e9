"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The single-node tests keep 4 partitions per keyed topic (the catalogue's default is 12,
# see docs/operations.md): set FLYWHEEL_TOPIC_PARTITIONS to run them with another count.
os.environ.setdefault("FLYWHEEL_TOPIC_PARTITIONS", "4")
# One owner key store for the session (tests.support.sealing): the publisher, in-process
# pipelines and worker subprocesses seal and open capture with the same keys.
os.environ.setdefault("FLYWHEEL_OWNER_KEYS",
                      os.path.join(tempfile.mkdtemp(prefix="flywheel-test-"), "owner-keys"))


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Qwen3-Next teacher (with its tokenizer), built once per session."""
    import torch

    from hebrus_flywheel.replay.teacher import init_teacher

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("teacher") / "tiny-qwen3-next"
    init_teacher(out, preset="tiny-qwen3-next", seed=0)
    return out
