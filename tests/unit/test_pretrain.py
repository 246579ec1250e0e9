"""Teacher pretraining: config errors name the field, the corpus sample is a function of
seed and files (with a held-out share), the tokenizer is the flywheel's own, a tiny run is
deterministic, cached, and loadable as a teacher."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.pretrain import (
    PretrainConfig,
    config_digest,
    corpus_digest,
    pretrain_teacher,
    sample_corpus,
    tokenize,
)


def _corpus(root, files: int = 40) -> None:
    for i in range(files):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(12))
        (root / f"m{i:02d}.py").write_text(body, encoding="utf-8")
    (root / "skip.bin").write_bytes(b"\0" * 1000)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="steps"):
        PretrainConfig(steps=0)
    with pytest.raises(ConfigError, match="max_seconds"):
        PretrainConfig(max_seconds=float("nan"))


def test_sample_is_seeded_and_holds_out_files(tmp_path) -> None:
    _corpus(tmp_path)
    config = PretrainConfig(corpus_bytes=10**6, corpus_roots=(str(tmp_path),))
    listing, train, held = sample_corpus(config)
    again, _, _ = sample_corpus(config)
    other, _, _ = sample_corpus(PretrainConfig(seed=1, corpus_bytes=10**6,
                                               corpus_roots=(str(tmp_path),)))
    assert corpus_digest(listing) == corpus_digest(again) != corpus_digest(other)
    assert len(listing) == 40 and len(held) == 2 and len(train) == 38
    assert not any(item["file"].endswith(".bin") for item in listing)


def test_tiny_pretrain_is_deterministic_cached_and_loads(tmp_path) -> None:
    from hebrus_flywheel.replay.teacher import artifact_digest, load_teacher
    from hebrus_flywheel.replay.tokenizer import load_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _corpus(corpus)
    config = PretrainConfig(steps=2, batch_size=2, seq_len=16, eval_batches=1,
                            corpus_bytes=10**6, corpus_roots=(str(corpus),))
    first, record, reused = pretrain_teacher(tmp_path / "a", config)
    assert not reused and record["steps_run"] == 2 and record["stopped"] == "steps"
    assert 0 < record["held_out_after"]["mean_load_entropy"] <= 1
    second, _, _ = pretrain_teacher(tmp_path / "b", config)
    assert artifact_digest(first) == artifact_digest(second)
    _, again, reused = pretrain_teacher(first, config)
    assert reused and again["corpus_digest"] == record["corpus_digest"]
    # the safety ceiling is not the teacher's identity: a new ceiling reuses the cache
    _, _, reused = pretrain_teacher(first, dataclasses.replace(config, max_seconds=5.0))
    assert reused
    manifest = json.loads((first / "flywheel_teacher.json").read_text())
    assert manifest["pretrain"]["config"]["steps"] == 2
    tok = load_tokenizer(first)
    ids = tokenize(tok.tokenizer, ["def f(x):\n"], tok.eos_id)
    assert ids[-1] == tok.eos_id and np.issubdtype(ids.dtype, np.integer)
    teacher = load_teacher(first)
    assert teacher.geometry.top_k == 10


def test_time_ceiling_fails_loudly_and_saves_nothing(tmp_path) -> None:
    from hebrus_flywheel.replay.exceptions import TeacherError

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _corpus(corpus)
    config = PretrainConfig(steps=3, batch_size=2, seq_len=16, eval_batches=1,
                            max_seconds=1e-9, corpus_bytes=10**6,
                            corpus_roots=(str(corpus),))
    with pytest.raises(TeacherError, match="safety ceiling"):
        pretrain_teacher(tmp_path / "t", config)
    assert not (tmp_path / "t").exists()
    assert config_digest(config) == config_digest(dataclasses.replace(config, max_seconds=9.0))
    assert config_digest(config) != config_digest(dataclasses.replace(config, steps=4))
