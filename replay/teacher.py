"""The frozen teacher: create the embedded tiny Qwen3-Next, load any supported checkpoint.

:func:`init_teacher` writes a deterministic, randomly initialised Qwen3-Next checkpoint
(``save_pretrained`` safetensors + the flywheel tokenizer + ``flywheel_teacher.json``)
with the design note's routing geometry: 512 experts, top-10, every layer sparse,
hybrid linear/full attention, ``norm_topk_prob=True``; widths are tiny so it decodes at
tens to hundreds of tokens/s on a 2-core CPU.

Router scaling (why): the gate reads ``post_attention_layernorm(x)``, which at init has
unit RMS per element, so its logits have standard deviation ``std(W) * sqrt(H)``. With
the transformers default ``std(W) = 0.02`` and ``H = 64`` that is ~0.16: the softmax over
512 experts is almost flat, all ten selected weights are ~0.1, and the choice is made by
logit differences of ~1e-3, i.e. routing is an arbitrary, indecisive function of the
input. We redraw every gate as ``N(0, (router_logit_std / sqrt(H))^2)`` so logits have
standard deviation ``router_logit_std`` (2.0 by default): top-k weights are peaked, the
selected experts differ clearly from the rejected ones, and routes are a strong, still
input-dependent function of the hidden state. Note that this scales margins AND any
logit error propagated from upstream rounding alike; it does not by itself make
decode/prefill parity more robust (see tests/unit/test_decode.py).

:func:`load_teacher` loads any local checkpoint of a family in :mod:`replay.adapters`
strictly offline (``local_files_only=True``), in eval mode with gradients off. By default
(``exact_tie_break=True``) each routed gate executes the identity's tie-break rule: the
native gates use ``torch.topk``, whose order on exactly equal scores is unspecified, and
exact float32 ties do occur (about 1 in 10^5 adjacent top-11 gaps on the 48-layer teacher);
without the rule the executed experts could then differ from the recorded label.

Tensor legend: B batch, T tokens, L routed layers, E experts, K top-k, H hidden.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from hebrus_flywheel.core.dtypes import COMPUTE_DTYPES
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_replace_dir, make_dirs
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.replay import float64
from hebrus_flywheel.replay.adapters import (
    FamilyAdapter,
    RouterPass,
    adapter_for,
    check_dense_layers,
    expert_scale_LE,
    forward_routes,
    install_exact_routing,
    score_bias_LE,
)
from hebrus_flywheel.replay.adapters_c import text_config
from hebrus_flywheel.replay.checkpoint import (
    INDEX_FILE,
    CheckpointStorage,
    check_memory,
    check_quantization,
    loads_onto_device,
)
from hebrus_flywheel.replay.exceptions import TeacherError
from hebrus_flywheel.replay.routing import (
    parse_rule,
    selection_scores,
    topk_weights,
    topk_with_tie_break,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hebrus_flywheel.core.execution import Execution

MANIFEST_FILE = "flywheel_teacher.json"
MANIFEST_FORMAT = "hebrus-flywheel-teacher/v1"
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in COMPUTE_DTYPES}
"""The torch dtype of each compute dtype (float64: :mod:`replay.float64`)."""
# tiled_mm (replay.experts) computes every (token, expert) pair at one fixed tile shape,
# independently of the other tokens in the batch, so prefill and single-token decode
# take the same arithmetic per row; unlike batched_mm it gathers expert weights once per
# tile, not once per pair, which makes prefill replay about 5x faster on a CPU.
DEFAULT_EXPERTS_IMPLEMENTATION = "tiled_mm"
EXPERTS_IMPLEMENTATIONS = ("batched_mm", "grouped_mm", "eager", "tiled_mm")
_INT_FIELDS = (
    "num_hidden_layers", "full_attention_interval", "hidden_size", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "vocab_size", "max_position_embeddings",
)


@dataclass(frozen=True, kw_only=True)
class TeacherPreset:
    """Geometry of a generated Qwen3-Next teacher.

    Fields:
        name: preset name recorded in ``flywheel_teacher.json``.
        num_hidden_layers: decoder layers; every one is a routed (sparse MoE) layer.
        full_attention_interval: every n-th layer uses full attention, the rest gated
            delta-net linear attention (Qwen3-Next's hybrid layout).
        hidden_size: residual width H.
        num_experts: routed experts per layer E.
        num_experts_per_tok: top-k K.
        moe_intermediate_size: per-expert intermediate width.
        shared_expert_intermediate_size: the always-on shared expert's width.
        num_attention_heads, num_key_value_heads, head_dim: full-attention heads.
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
            linear_value_head_dim, linear_conv_kernel_dim: linear-attention geometry.
        vocab_size: target size of the generated tokenizer; the model's vocabulary is
            the size the tokenizer actually has.
        max_position_embeddings: RoPE range.
        initializer_range: std of the transformers default weight init.
        router_logit_std: std of router logits at init (see the module docstring).
    """

    name: str
    num_hidden_layers: int = 4
    full_attention_interval: int = 4
    hidden_size: int = 64
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 16
    shared_expert_intermediate_size: int = 32
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 2
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    vocab_size: int = 4096
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    router_logit_std: float = 2.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("name must be a non-empty preset name")
        for field in _INT_FIELDS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{field} must be a positive integer, got {value!r}")
        for field in ("initializer_range", "router_logit_std"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{field} must be a positive finite number, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError("num_experts_per_tok must be <= num_experts")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    def layer_types(self) -> list[str]:
        n = self.full_attention_interval
        return [
            "full_attention" if (i + 1) % n == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]


PRESETS: dict[str, TeacherPreset] = {
    p.name: p
    for p in (
        TeacherPreset(name="tiny-qwen3-next"),
        TeacherPreset(name="tiny-qwen3-next-48l", num_hidden_layers=48),
    )
}
DEFAULT_PRESET = "tiny-qwen3-next"
QWEN3_NEXT = "qwen3_next"


def get_preset(name: str) -> TeacherPreset:
    if name not in PRESETS:
        raise ConfigError(
            f"preset: unknown teacher preset {name!r}; choose one of {sorted(PRESETS)}"
        )
    return PRESETS[name]


@dataclass(eq=False)
class Teacher:
    """A loaded, frozen teacher and what is needed to read its routes."""

    path: Path
    model: PreTrainedModel
    adapter: FamilyAdapter
    geometry: RouteGeometry
    dtype: str
    artifact_digest: str
    eos_token_ids: tuple[int, ...]
    exact_tie_break: bool = True
    score_bias_LE: torch.Tensor | None = None
    expert_scale_LE: torch.Tensor | None = None
    device: str = "cpu"
    attention: str = "sdpa"
    experts_implementation: str = DEFAULT_EXPERTS_IMPLEMENTATION

    @property
    def kernel_path(self) -> str:
        """The identity's ``kernel_path``: device type, attention and expert kernels."""
        from hebrus_flywheel.core.execution import Execution

        return Execution(device=self.device, dtype=self.dtype, attention=self.attention
                         ).kernel_path(self.experts_implementation)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def context_length(self) -> int:
        """Most positions one forward may cover (``max_position_embeddings``; 0: unknown)."""
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    def route(self, router_logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ranked top-k ids and weights under this teacher's rule (last two dims L, E);
        in the teacher's numerics, like the gates that executed them."""
        with float64.numerics(self.dtype):
            return topk_with_tie_break(
                router_logits_TE, self.geometry.top_k, weight_rule=self.geometry.weight_rule,
                bias_TE=self.score_bias_LE, expert_scale_TE=self.expert_scale_LE,
            )

    def weights_of(self, router_logits_TE: torch.Tensor, expert_ids_TK: torch.Tensor
                   ) -> torch.Tensor:
        """Weights of the given ids under this teacher's rule (last dims L, E/K): float32,
        float64 for a float64 teacher."""
        with float64.numerics(self.dtype):
            return topk_weights(router_logits_TE, expert_ids_TK, self.geometry.weight_rule,
                                self.expert_scale_LE)

    def selection_scores(self, router_logits_XLE: torch.Tensor) -> torch.Tensor:
        """What the rule ranks experts by (the logits themselves for softmax routers);
        margins are gaps of these. The last two dims are (routed layer, expert)."""
        with float64.numerics(self.dtype):
            return selection_scores(router_logits_XLE, self.geometry.weight_rule,
                                    self.score_bias_LE)

    def forward_routes(
        self, input_ids_BT: torch.Tensor, *, attention_mask_BT: torch.Tensor | None = None,
        capture_hidden: bool = False,
    ) -> RouterPass:
        """ONE plain causal forward (no cache) and the router logits of every routed layer."""
        return forward_routes(
            self.model, self.adapter, self.geometry, input_ids_BT,
            attention_mask_BT=attention_mask_BT, capture_hidden=capture_hidden,
        )


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """Silence transformers' per-call progress bars (save/load) and restore the setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# --- digests ----------------------------------------------------------------------------


def _artifact_files(directory: Path) -> list[Path]:
    if not (directory / "config.json").is_file():
        raise TeacherError(f"{directory} has no config.json; point at a saved HF checkpoint")
    weights = sorted(
        p for p in directory.iterdir()
        if p.is_file() and (p.name.endswith(".safetensors") or p.name.startswith("pytorch_model"))
    )
    index = directory / INDEX_FILE  # sharded: the index decides which shard holds what
    weights += [index] if index.is_file() and weights else []
    if not weights:
        raise TeacherError(
            f"{directory} has no weight files (*.safetensors or pytorch_model*.bin); the "
            "checkpoint is incomplete"
        )
    return [directory / "config.json", *weights]


def artifact_digest(directory: str | Path) -> str:
    """Hex SHA-256 over ``config.json`` and the weight files: names sorted, then content.

    Each file contributes its name, its byte length and its bytes; timestamps and other
    files (tokenizer, generation config, manifest) do not enter.
    """
    digest = hashlib.sha256()
    for path in _artifact_files(Path(directory)):
        digest.update(path.name.encode() + b"\0" + path.stat().st_size.to_bytes(8, "big"))
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


# --- init -------------------------------------------------------------------------------


def _qwen3_next_config(preset: TeacherPreset, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    from transformers import Qwen3NextConfig

    skip = ("vocab_size", "full_attention_interval")
    fields = {f: getattr(preset, f) for f in _INT_FIELDS if f not in skip}
    return Qwen3NextConfig(
        **fields, vocab_size=vocab_size, intermediate_size=preset.shared_expert_intermediate_size,
        initializer_range=preset.initializer_range, decoder_sparse_step=1, mlp_only_layers=[],
        layer_types=preset.layer_types(), norm_topk_prob=True, tie_word_embeddings=False,
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, dtype="float32",
    )


def _build_model(config: Any, preset: TeacherPreset, seed: int) -> PreTrainedModel:
    """Deterministic init under ``seed`` without touching the caller's global RNG."""
    from transformers import Qwen3NextForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3NextForCausalLM(config)
        router_std = preset.router_logit_std / math.sqrt(preset.hidden_size)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, router_std)
    return model.eval()


def _manifest(preset: TeacherPreset | None, seed: int, family: str) -> str:
    body: dict[str, Any] = {"format": MANIFEST_FORMAT, "family": family, "seed": seed}
    if preset is not None:
        body.update(preset=preset.name, preset_config=asdict(preset))
    else:
        from hebrus_flywheel.replay.families import get_family

        body.update(preset=f"tiny-{family}", family_config=get_family(family).fields)
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def _write_checkpoint(target: Path, preset: TeacherPreset | None, seed: int, family: str,
                      storage: CheckpointStorage) -> None:
    from hebrus_flywheel.replay.families import build_family_model, get_family
    from hebrus_flywheel.replay.tokenizer import build_tokenizer, load_tokenizer

    build_tokenizer(target, vocab_size=preset.vocab_size if preset else 4096)
    tok = load_tokenizer(target)
    vocab = tok.tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id, pad_id = tok.eos_id, tok.pad_id
    if preset is not None:
        model = _build_model(_qwen3_next_config(preset, vocab, eos_id, pad_id), preset, seed)
    else:
        spec = get_family(family)
        config = spec.config(vocab_size=vocab, eos_id=eos_id, pad_id=pad_id)
        model = build_family_model(spec, config, seed)
    model = cast(Any, model).to(DTYPES[storage.weights_dtype])  # .to is typed oddly
    model.config.dtype = storage.weights_dtype
    with _quiet_progress():
        model.save_pretrained(target, max_shard_size=storage.max_shard_size)
    (target / MANIFEST_FILE).write_text(_manifest(preset, seed, family), encoding="utf-8")


def init_teacher(
    out_dir: str | Path, *, preset: str | TeacherPreset = DEFAULT_PRESET, seed: int = 0,
    overwrite: bool = False, family: str | None = None, storage: CheckpointStorage | None = None,
) -> Path:
    """Create a deterministic teacher checkpoint in ``out_dir`` and return ``out_dir``.

    ``family`` (a :data:`replay.families.FAMILIES` name) makes a tiny random checkpoint
    of that MoE family; without it (or for ``qwen3_next``) ``preset`` picks the Qwen3-Next
    geometry. The same family/preset and seed give the same :func:`artifact_digest`. The
    directory is written beside its final place and renamed into it, so it is never
    half-written. ``storage`` picks the stored weight dtype and the shard size (a sharded
    checkpoint has ``model.safetensors.index.json``); the default is one float32 file.
    """
    from hebrus_flywheel.replay.families import get_family

    name = get_family(family).name if family is not None else QWEN3_NEXT
    chosen = None
    if name == QWEN3_NEXT:
        chosen = get_preset(preset) if isinstance(preset, str) else preset
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    target = Path(out_dir).resolve()
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise TeacherError(
            f"{target} is not empty; choose a new directory or pass overwrite=True (--overwrite)"
        )
    make_dirs(target.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_checkpoint(staging, chosen, seed, name, storage or CheckpointStorage())
        if target.exists():
            shutil.rmtree(target)
        atomic_replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# --- load -------------------------------------------------------------------------------


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """``flywheel_teacher.json`` of a generated teacher, or None for other checkpoints."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TeacherError(f"{path} is not valid JSON ({exc.msg}); re-create the teacher") from None


def read_geometry(directory: str | Path) -> RouteGeometry:
    """The route geometry of a checkpoint from its ``config.json`` alone (no weights)."""
    config = _read_config(Path(directory))
    return adapter_for(config.model_type).geometry(text_config(config))


def default_weight_encoding(directory: str | Path) -> str:
    """``uint8`` when the teacher's weights stay in [0, 1] (the shard's uint8 range), else
    ``float16`` (rules that scale weights, e.g. DeepSeek's ``routed_scaling_factor`` or
    Gemma 4's learned per-expert scale)."""
    rule = parse_rule(read_geometry(directory).weight_rule)
    return "uint8" if rule.scale <= 1.0 and not rule.expert_scale else "float16"


def _eos_ids(model: nn.Module) -> tuple[int, ...]:
    generation = getattr(model, "generation_config", None)
    raw = getattr(generation, "eos_token_id", None)
    if raw is None:
        raw = getattr(model.config, "eos_token_id", None)
    if raw is None:
        return ()
    return tuple(int(x) for x in (raw if isinstance(raw, list | tuple) else [raw]))


def _load_model(path: Path, torch_dtype: torch.dtype, experts_implementation: str,
                execution: Execution, model_type: str) -> PreTrainedModel:
    import transformers
    from transformers import AutoModelForCausalLM

    from hebrus_flywheel.replay.composites import (
        CAUSAL_LM_CLASSES,
        is_composite_text_teacher,
        load_text_causal_lm,
    )
    from hebrus_flywheel.replay.experts import register

    register()
    # a vision-language composite without a causal-LM class: its own class, text LM kept
    load: Any = load_text_causal_lm if is_composite_text_teacher(model_type) else \
        AutoModelForCausalLM.from_pretrained
    if model_type in CAUSAL_LM_CLASSES:  # a causal LM the auto class does not map
        load = getattr(transformers, CAUSAL_LM_CLASSES[model_type]).from_pretrained
    # With accelerate, an accelerator's weights go straight onto it shard by shard, so a
    # checkpoint larger than host RAM loads when the device holds it (check_memory agrees).
    placement = {"device_map": execution.device} if loads_onto_device(execution.device) else {}
    try:
        with _quiet_progress():
            model = load(
                str(path), local_files_only=True, dtype=torch_dtype,
                experts_implementation=experts_implementation,
                attn_implementation=execution.attention, **placement,
            )
    except (OSError, ValueError) as exc:
        hint = ""
        if execution.attention == "sdpa" and "scaled_dot_product_attention" in str(exc):
            hint = ("; this family has no sdpa attention in transformers: run with "
                    "--attention eager, or auto (the default) to take what the model "
                    "supports (e.g. gpt_oss, `flywheel teacher families`)")
        raise TeacherError(f"transformers cannot load the checkpoint in {path}: {exc}{hint}"
                           ) from None
    return cast(Any, model).to(execution.device)  # transformers types .to oddly


def _on_cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Labels are ranked on the CPU (logits come back there), so is the bias."""
    return None if tensor is None else tensor.cpu()


def model_attention(config: Any, attention: str) -> str:
    """``attention`` resolved for a checkpoint of ``config``: ``auto`` is sdpa where the
    family's transformers causal-LM class supports it, else eager."""
    if attention != "auto":
        return attention
    from hebrus_flywheel.replay.composites import (
        causal_lm_class,
        composite_model_class,
        is_composite_text_teacher,
    )

    model_class = composite_model_class(config) if is_composite_text_teacher(
        config.model_type) else causal_lm_class(config)
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def resolve_attention(directory: str | Path, attention: str) -> str:
    """:func:`model_attention` for the checkpoint in ``directory`` (reads its config)."""
    if attention != "auto":
        return attention
    return model_attention(_read_config(Path(directory).resolve()), attention)


def _read_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TeacherError(f"cannot read {path / 'config.json'}: {exc}") from None
    check_quantization(raw if isinstance(raw, dict) else {}, path)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TeacherError(f"cannot read {path / 'config.json'}: {exc}") from None


def load_teacher(
    directory: str | Path, *, dtype: str = "float32",
    experts_implementation: str = DEFAULT_EXPERTS_IMPLEMENTATION, exact_tie_break: bool = True,
    device: str = "cpu", attention: str = "auto",
) -> Teacher:
    """Load a local checkpoint of a supported family as a frozen :class:`Teacher`.

    ``exact_tie_break`` makes the gates execute the recorded tie-break rule (see the
    module docstring); ``False`` leaves the family's native ``torch.topk`` gates alone.
    ``device`` and ``attention`` (with ``dtype`` and the experts kernel) are the kernel
    path recorded in the identity (:mod:`core.execution`). A quantized checkpoint, or
    one whose weights do not fit in memory at ``dtype``, is refused before loading
    (:mod:`replay.checkpoint`).
    """
    from hebrus_flywheel.core.execution import Execution, require_device

    Execution(device=device, dtype=dtype, attention=attention)  # checks the names
    if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ConfigError(
            f"experts_implementation must be one of {EXPERTS_IMPLEMENTATIONS}, got "
            f"{experts_implementation!r}"
        )
    require_device(device)
    path = Path(directory).resolve()
    digest = artifact_digest(path)
    config = _read_config(path)
    adapter = adapter_for(config.model_type)
    attention = model_attention(config, attention)
    execution = Execution(device=device, dtype=dtype, attention=attention)
    check_memory(path, dtype, execution.device)
    model = _load_model(path, DTYPES[dtype], experts_implementation, execution,
                        config.model_type)
    model.eval().requires_grad_(False)
    if dtype == float64.FLOAT64:
        float64.install(model)
    geometry = adapter.geometry(model.config)
    layers = adapter.decoder_layers(model)
    for index in geometry.routed_layers:
        adapter.router(layers[index])
    check_dense_layers(model, adapter, geometry)
    if exact_tie_break:
        install_exact_routing(model, adapter, geometry)
    return Teacher(path=path, model=model, adapter=adapter, geometry=geometry, dtype=dtype,
                   artifact_digest=digest, eos_token_ids=_eos_ids(model),
                   exact_tie_break=exact_tie_break,
                   score_bias_LE=_on_cpu(score_bias_LE(model, adapter, geometry)),
                   expert_scale_LE=_on_cpu(expert_scale_LE(model, adapter, geometry)),
                   device=device, attention=attention,
                   experts_implementation=experts_implementation)
