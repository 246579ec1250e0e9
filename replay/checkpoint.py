"""What a checkpoint directory holds, read before any weight is loaded.

- :func:`weight_files`: the safetensors shards (``model.safetensors.index.json`` and every
  shard its ``weight_map`` names, all present) or the single ``model.safetensors``.
- :func:`tensor_table`: every tensor's dtype and shape from the safetensors headers (the
  8-byte little-endian header length and the JSON header; no tensor data is read).
- :func:`check_quantization`: a ``quantization_config`` in ``config.json`` (bitsandbytes,
  GPTQ, AWQ, fp8, …) is refused: quantized kernels are not exact between single-token
  decode and batched prefill, and this project's gates and tie-break rule assume the
  dense weights it loads. The message says what to do instead.
- :func:`check_memory`: the bytes the weights take once cast to the compute dtype versus
  the memory they pass through: a CUDA device's free memory (``torch.cuda.mem_get_info``)
  and, unless accelerate is installed (then the weights load straight onto the device
  with a one-device ``device_map``, see :func:`loads_onto_device`), the host's too
  (``MemAvailable`` of ``/proc/meminfo``, else ``os.sysconf``; Apple MPS shares it), each
  capped by ``$FLYWHEEL_TEACHER_MEMORY_BYTES``. accelerate is optional and multi-device
  maps and offload are not used, so a teacher that does not fit is refused before
  loading, naming both figures and what to do.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.dtypes import COMPUTE_DTYPE_BYTES
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.replay.exceptions import TeacherError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MEMORY_ENV = "FLYWHEEL_TEACHER_MEMORY_BYTES"
MEMORY_HEADROOM = 1.25
"""Loading needs more than the weights (activations, the KV cache, allocator slack)."""
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4,
               "U64": 8}
STORED_DTYPES = ("float32", "bfloat16", "float16")  # what init_teacher writes
_HEADER_LIMIT = 100 << 20


@dataclass(frozen=True, kw_only=True)
class CheckpointStorage:
    """How :func:`init_teacher` stores the weights.

    Fields:
        weights_dtype: dtype of the saved tensors (``float32``, ``bfloat16``, ``float16``).
        max_shard_size: largest safetensors shard, e.g. ``"64KB"`` or an int of bytes;
            a checkpoint bigger than this is split into shards plus
            ``model.safetensors.index.json``.
    """

    weights_dtype: str = "float32"
    max_shard_size: str | int = "50GB"

    def __post_init__(self) -> None:
        if self.weights_dtype not in STORED_DTYPES:
            raise ConfigError(f"weights_dtype must be one of {sorted(STORED_DTYPES)}, got "
                              f"{self.weights_dtype!r}")
        size = self.max_shard_size
        if isinstance(size, bool) or (isinstance(size, int) and size < 1) or (
                isinstance(size, str) and not size.rstrip("KMGTkmgtiBb").isdigit()):
            raise ConfigError(f"max_shard_size must be a positive byte count or a size like "
                              f"'64KB', got {size!r}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: its stored dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of ``directory`` (shards named by the index, all present)."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise TeacherError(f"{index} is not a safetensors index ({exc}); re-save the "
                               "checkpoint with save_pretrained") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise TeacherError(f"{index} names shard(s) {missing} that are not in "
                               f"{directory}; copy every shard of the checkpoint")
        return [directory / n for n in names]
    single = directory / SINGLE_FILE
    return [single] if single.is_file() else []


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file (no tensor data is read)."""
    with path.open("rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise TeacherError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > _HEADER_LIMIT:
            raise TeacherError(f"{path} claims a {length}-byte header; not a safetensors file")
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TeacherError(f"{path} has no valid safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise TeacherError(f"{path} has no valid safetensors header (not an object)")
    return header


def tensor_table(directory: Path) -> list[TensorInfo]:
    """Every tensor of the checkpoint's safetensors files, from their headers."""
    table: list[TensorInfo] = []
    for path in weight_files(directory):
        for name, info in read_header(path).items():
            if name == "__metadata__":
                continue
            table.append(TensorInfo(name, str(info["dtype"]), tuple(int(s) for s in info["shape"])))
    return table


def stored_dtypes(directory: Path) -> list[str]:
    """The distinct stored dtypes of the floating-point tensors, sorted (e.g. ``["BF16"]``)."""
    return sorted({t.dtype for t in tensor_table(directory) if t.dtype.startswith(("F", "BF"))})


def weight_bytes(directory: Path, compute_dtype: str) -> int:
    """Bytes the weights take once loaded: floating tensors at ``compute_dtype``."""
    size = COMPUTE_DTYPE_BYTES[compute_dtype]
    total = 0
    for tensor in tensor_table(directory):
        floating = tensor.dtype.startswith(("F", "BF"))
        total += tensor.numel * (size if floating else DTYPE_BYTES.get(tensor.dtype, 8))
    if not total:  # pytorch_model*.bin or no weights: the files' size is the estimate
        total = sum(p.stat().st_size for p in directory.glob("pytorch_model*.bin"))
    return total


def check_quantization(config: Mapping[str, Any], where: Path) -> None:
    """TeacherError when ``config`` (a parsed config.json) declares a quantization."""
    quant = config.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method", "unknown") if isinstance(quant, Mapping) else "unknown"
    raise TeacherError(
        f"{where / 'config.json'} declares a quantized checkpoint (quantization_config, "
        f"quant_method={method!r}); quantized kernels are not exact between single-token "
        "decode and batched prefill replay, so its routes cannot be replayed exactly. Use "
        "the unquantized checkpoint the quantization was made from (bf16/fp16/fp32 "
        "safetensors), or dequantize it and save it (transformers: "
        "model.dequantize(); model.save_pretrained(DIR)) and point --teacher at DIR")


def available_memory_bytes() -> int:
    """Memory available for a new allocation: ``MemAvailable``, else free pages."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def device_memory_bytes(device: str) -> tuple[int, str]:
    """Memory free for new allocations on ``device`` and what the figure is."""
    if device.split(":", 1)[0] != "cuda":
        return available_memory_bytes(), "available memory"
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), f"free memory of {device}"


def memory_limit_bytes(device: str = "cpu") -> tuple[int, str]:
    """The memory a teacher may use on ``device`` and where the figure came from."""
    available, source = device_memory_bytes(device)
    raw = os.environ.get(MEMORY_ENV)
    if raw is None or raw == "":
        return available, source
    try:
        cap = int(raw)
    except ValueError:
        raise ConfigError(f"{MEMORY_ENV} must be a whole number of bytes, got {raw!r}") from None
    if cap < 1:
        raise ConfigError(f"{MEMORY_ENV} must be positive, got {cap}")
    return (cap, f"${MEMORY_ENV}") if cap < available else (available, source)


def loads_onto_device(device: str) -> bool:
    """Whether weights for ``device`` load straight onto it: an accelerator, and
    accelerate installed (transformers needs it for any ``device_map``). Otherwise they
    load into host memory first and are moved."""
    import importlib.util

    return device != "cpu" and importlib.util.find_spec("accelerate") is not None


def check_memory(directory: Path, compute_dtype: str, device: str = "cpu") -> int:
    """The weights' loaded bytes; TeacherError before loading if they do not fit in each
    memory they pass through on their way to ``device``."""
    need = weight_bytes(directory, compute_dtype)
    cuda = device.startswith("cuda")  # cpu and mps weights live in host memory
    through_host = not cuda or not loads_onto_device(device)
    for place in (["cpu"] if through_host else []) + ([device] if cuda else []):
        limit, source = memory_limit_bytes(place)
        if need * MEMORY_HEADROOM > limit:
            raise TeacherError(
                f"the teacher in {directory} needs about {need / 2**30:.2f} GiB for its "
                f"weights in {compute_dtype} (x{MEMORY_HEADROOM} headroom: "
                f"{need * MEMORY_HEADROOM / 2**30:.2f} GiB) but {source} is "
                f"{limit / 2**30:.2f} GiB; replay keeps the whole model on one device (no "
                "multi-device device_map or offload). Use a machine with more memory, a "
                "smaller compute dtype (--dtype bfloat16), or a smaller checkpoint"
                + ("; installing accelerate loads the weights straight onto the device"
                   if place == "cpu" and cuda else ""))
    return need
