"""``flywheel teacher pretrain``: give the tiny teacher routes that mean something.

A randomly initialised teacher routes by arbitrary functions of its input, so a
predictor's score on it says little about real MoE models. This module trains the tiny
Qwen3-Next for a few minutes on text and code that every machine already has (no
download): the installed Python packages' sources and docs (``*.py``, ``*.md``,
``*.rst``, ``*.txt`` under every ``site-packages`` on ``sys.path``) and Debian's
documentation (``/usr/share/doc``). The objective is next-token cross-entropy plus the
standard (Switch/Mixtral) MoE load-balancing loss, ``router_aux_loss_coef * aux``.

Determinism: the budget is a number of optimiser steps, never wall time. Given the
seed, the step budget and the corpus list (recorded with its digest in
``flywheel_teacher.json``), the weights are the same on the same torch build and thread
count, however loaded the machine. The corpus is a seeded sample of the candidate files
(ranked by SHA-256 of seed and relative path, up to ``corpus_bytes``); every 20th
sampled file is held out for the held-out loss. ``max_seconds`` is only a safety
ceiling: a run that passes it fails loudly (:class:`TeacherError`) instead of saving a
shorter, machine-dependent teacher. It is not part of the teacher's identity: the cache
key is :func:`config_digest` of every other field.

The corpus is tokenized with the flywheel's own tokenizer (:mod:`replay.tokenizer`),
the one written beside the weights. Reports: held-out loss (nats/token) before and
after, and the expert-load entropy (normalised by ``log E``; 1.0 is perfectly even) of
every layer on held-out text.

Tensor legend: B batch, T tokens, L routed layers, E experts, K top-k.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_replace_dir, make_dirs
from hebrus_flywheel.replay.exceptions import TeacherError

PRETRAIN_FORMAT = "hebrus-flywheel-teacher-pretrain/v1"
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")
DOC_ROOT = Path("/usr/share/doc")
HELD_OUT_EVERY = 20


@dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    """Budget and corpus of one pretraining run (every field but ``max_seconds`` enters
    the cache key, :func:`config_digest`)."""

    preset: str = "tiny-qwen3-next"
    """Teacher preset (geometry) to initialise and train."""
    seed: int = 0
    """Initialisation, corpus-sampling and batch-order seed."""
    steps: int = 100
    """Optimiser steps: the deterministic budget."""
    max_seconds: float = 1800.0
    """Safety ceiling on training wall time: past it the run fails (never a shorter
    teacher). Not part of the cache key."""
    batch_size: int = 8
    """Sequences per step."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """Peak AdamW learning rate (warm-up 20 steps, cosine to lr/10)."""
    aux_loss_coef: float = 0.01
    """Weight of the MoE load-balancing loss."""
    corpus_bytes: int = 3_000_000
    """Bytes of text sampled from the candidate files."""
    max_file_bytes: int = 65536
    """Larger files are skipped (keeps the sample diverse)."""
    eval_batches: int = 8
    """Held-out batches for loss and load entropy."""
    threads: int = 1
    """torch threads (part of the determinism contract). One: on a shared 2-core machine
    two threads spin against other processes and ran 7-25x slower per step (measured)."""
    corpus_roots: tuple[str, ...] = ()
    """Directories to sample text from; empty: :func:`corpus_roots` (site-packages and
    ``/usr/share/doc``)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "corpus_bytes", "max_file_bytes",
                     "eval_batches", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PretrainConfig.{name} must be a positive integer, "
                                  f"got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"PretrainConfig.seed must be a non-negative int, got {self.seed!r}")
        for name in ("max_seconds", "lr"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"PretrainConfig.{name} must be a positive number, "
                                  f"got {value!r}")
        object.__setattr__(self, "corpus_roots", tuple(str(r) for r in self.corpus_roots))
        if not (math.isfinite(self.aux_loss_coef) and self.aux_loss_coef >= 0):
            raise ConfigError("PretrainConfig.aux_loss_coef must be >= 0")


def config_digest(config: PretrainConfig) -> str:
    """SHA-256 of the fields that decide the weights (all but ``max_seconds``)."""
    fields = {k: v for k, v in asdict(config).items() if k != "max_seconds"}
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=list)
    return hashlib.sha256(body.encode()).hexdigest()


def corpus_roots() -> list[Path]:
    """Every ``site-packages`` directory on ``sys.path`` and ``/usr/share/doc``."""
    roots = sorted({Path(p).resolve() for p in sys.path
                    if p.endswith("site-packages") and Path(p).is_dir()})
    return [*roots, *([DOC_ROOT] if DOC_ROOT.is_dir() else [])]


def _candidates(roots: list[Path], max_bytes: int) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for root in roots:
        for path in root.rglob("*"):
            name = path.name
            doc = root == DOC_ROOT and (name.endswith(".gz") or "." not in name)
            if not (name.endswith(TEXT_SUFFIXES) or doc) or not path.is_file():
                continue
            size = path.stat().st_size
            if 256 <= size <= max_bytes:
                found.append((f"{root.name}/{path.relative_to(root)}", path))
    return found


def _read_text(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def sample_corpus(config: PretrainConfig, roots: list[Path] | None = None
                  ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(corpus list, train texts, held-out texts): a seeded sample of the candidates."""
    if roots is None:
        roots = [Path(r) for r in config.corpus_roots] if config.corpus_roots else None
    chosen = roots if roots is not None else corpus_roots()
    ranked = sorted(_candidates(chosen, config.max_file_bytes), key=lambda item: (
        hashlib.sha256(f"{config.seed}|{item[0]}".encode()).hexdigest(), item[0]))
    listing: list[dict[str, Any]] = []
    train: list[str] = []
    held: list[str] = []
    total = 0
    for name, path in ranked:
        text = _read_text(path)
        if not text or not text.strip():
            continue
        held_out = len(listing) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
        listing.append({"file": name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
                        "held_out": held_out})
        (held if held_out else train).append(text)
        total += len(text.encode())
        if total >= config.corpus_bytes:
            break
    if not held or not train:
        raise TeacherError(f"found too little text under {[str(r) for r in chosen]} to "
                           "pretrain; raise corpus_bytes or install Python packages")
    return listing, train, held


def corpus_digest(listing: list[dict[str, Any]]) -> str:
    body = json.dumps(listing, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def tokenize(tokenizer: Any, texts: list[str], eos_id: int) -> np.ndarray:
    """One int64 stream: every text's tokens followed by ``eos_id``."""
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    pieces = [np.array([*e.ids, eos_id], dtype=np.int64) for e in encoded]
    return np.concatenate(pieces)


def _windows(stream: np.ndarray, rng: np.random.Generator, batch: int,
             seq_len: int) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - seq_len - 1, batch)
    return torch.from_numpy(np.stack([stream[s:s + seq_len] for s in starts]))


def _lr(step: int, config: PretrainConfig) -> float:
    if step < 20:
        return config.lr * (step + 1) / 20
    ratio = (step - 20) / max(config.steps - 20, 1)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(ratio, 1.0))))


@torch.no_grad()
def held_out_figures(model: Any, stream: np.ndarray, config: PretrainConfig) -> dict[str, Any]:
    """Held-out loss (nats/token) and per-layer expert-load entropy / log E."""
    model.eval()
    rng = np.random.default_rng(config.seed + 1)
    losses, counts = [], None
    top_k = int(model.config.num_experts_per_tok)
    for _ in range(config.eval_batches):
        ids = _windows(stream, rng, config.batch_size, config.seq_len)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        losses.append(float(out.loss - config.aux_loss_coef * out.aux_loss))
        for layer, logits_TE in enumerate(out.router_logits):
            chosen = logits_TE.topk(top_k, dim=-1).indices.reshape(-1)
            hist = torch.bincount(chosen, minlength=logits_TE.shape[-1]).double()
            if counts is None:
                counts = torch.zeros(len(out.router_logits), logits_TE.shape[-1],
                                     dtype=torch.float64)
            counts[layer] += hist
    assert counts is not None
    share_LE = counts / counts.sum(dim=1, keepdim=True)
    entropy_L = -(share_LE * share_LE.clamp_min(1e-30).log()).sum(dim=1)
    normalised = (entropy_L / math.log(counts.shape[1])).tolist()
    return {"loss": float(np.mean(losses)), "load_entropy": [round(v, 4) for v in normalised],
            "mean_load_entropy": round(float(np.mean(normalised)), 4)}


def train_model(model: Any, stream: np.ndarray, config: PretrainConfig) -> dict[str, Any]:
    """The training loop: exactly ``config.steps`` steps; returns the loss trace.
    Raises :class:`TeacherError` past ``max_seconds`` (the safety ceiling)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    rng = np.random.default_rng(config.seed)
    started, trace = time.perf_counter(), []
    for step in range(config.steps):
        elapsed = time.perf_counter() - started
        if elapsed > config.max_seconds:
            raise TeacherError(
                f"teacher pretraining passed its safety ceiling of {config.max_seconds:.0f} s "
                f"after {step} of {config.steps} steps; the machine is slower or busier than "
                "planned. Nothing was saved: raise --max-seconds (the teacher is the same "
                "either way) or lower --steps (a different teacher)")
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, config)
        ids = _windows(stream, rng, config.batch_size, config.seq_len)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == config.steps - 1:
            trace.append({"step": step, "loss": round(float(out.loss.detach()), 4),
                          "aux": round(float(out.aux_loss.detach()), 4)})
    seconds = time.perf_counter() - started
    return {"steps_run": config.steps, "stopped": "steps", "trace": trace,
            "train_seconds": round(seconds, 1),
            "seconds_per_step": round(seconds / config.steps, 3)}


def cached(out_dir: Path, config: PretrainConfig) -> dict[str, Any] | None:
    """The recorded pretraining of ``out_dir`` when it was made with ``config``."""
    from hebrus_flywheel.replay.teacher import read_manifest

    if not (out_dir / "config.json").is_file():
        return None
    manifest = read_manifest(out_dir) or {}
    record = manifest.get("pretrain") or {}
    return record if record.get("config_digest") == config_digest(config) else None


def _manifest(config: PretrainConfig, record: dict[str, Any]) -> str:
    from hebrus_flywheel.replay.teacher import MANIFEST_FORMAT, get_preset

    preset = get_preset(config.preset)
    body = {"format": MANIFEST_FORMAT, "preset": preset.name, "seed": config.seed,
            "preset_config": asdict(preset), "pretrain": record}
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def _pretrain_into(target: Path, config: PretrainConfig) -> dict[str, Any]:
    from hebrus_flywheel.replay.experts import NAME as TRAIN_EXPERTS
    from hebrus_flywheel.replay.experts import register as register_tiled
    from hebrus_flywheel.replay.teacher import (
        _build_model,
        _quiet_progress,
        _qwen3_next_config,
        get_preset,
    )
    from hebrus_flywheel.replay.tokenizer import build_tokenizer, load_tokenizer

    preset = get_preset(config.preset)
    started = time.perf_counter()
    listing, train_texts, held_texts = sample_corpus(config)
    build_tokenizer(target, vocab_size=preset.vocab_size)
    tok = load_tokenizer(target)
    train_stream = tokenize(tok.tokenizer, train_texts, tok.eos_id)
    held_stream = tokenize(tok.tokenizer, held_texts, tok.eos_id)
    corpus_seconds = round(time.perf_counter() - started, 1)
    vocab = tok.tokenizer.get_vocab_size(with_added_tokens=True)
    model_config = _qwen3_next_config(preset, vocab, tok.eos_id, tok.pad_id)
    model_config.router_aux_loss_coef = config.aux_loss_coef
    model = _build_model(model_config, preset, config.seed)
    register_tiled()
    model.set_experts_implementation(TRAIN_EXPERTS)  # ~100x faster than grouped_mm on CPU
    before = held_out_figures(model, held_stream, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        run = train_model(model, train_stream, config)
    after = held_out_figures(model, held_stream, config)
    model.eval()
    with _quiet_progress():
        model.save_pretrained(target)
    record = {"format": PRETRAIN_FORMAT, "config": asdict(config),
              "config_digest": config_digest(config),
              "corpus_digest": corpus_digest(listing), "corpus_files": len(listing),
              "train_tokens": len(train_stream), "held_out_tokens": len(held_stream),
              "corpus_seconds": corpus_seconds, "held_out_before": before,
              "held_out_after": after, **run,
              "total_seconds": round(time.perf_counter() - started, 1),
              "torch": torch.__version__}
    (target / "pretrain-corpus.json").write_text(json.dumps(listing, indent=1) + "\n",
                                                 encoding="utf-8")
    from hebrus_flywheel.replay.teacher import MANIFEST_FILE

    (target / MANIFEST_FILE).write_text(_manifest(config, record), encoding="utf-8")
    return record


def pretrain_teacher(out_dir: str | Path, config: PretrainConfig, *,
                     overwrite: bool = False) -> tuple[Path, dict[str, Any], bool]:
    """Pretrain into ``out_dir`` (staged, then renamed). Returns (dir, record, reused):
    a directory already pretrained with the same config is reused as it is."""
    target = Path(out_dir).resolve()
    found = cached(target, config)
    if found is not None and not overwrite:
        return target, found, True
    if target.exists() and any(target.iterdir()) and not overwrite and found is None:
        raise TeacherError(f"{target} holds another teacher; choose a new --out or pass "
                           "--overwrite")
    make_dirs(target.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        record = _pretrain_into(staging, config)
        if target.exists():
            shutil.rmtree(target)
        atomic_replace_dir(staging, target)
    finally:
        torch.set_num_threads(previous)
        shutil.rmtree(staging, ignore_errors=True)
    return target, record, False
