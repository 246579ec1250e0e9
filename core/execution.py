"""Where and how a teacher runs: device, compute dtype and attention kernel (one definition).

Decode/prefill parity is a property of the arithmetic that actually ran, so it is
established per *kernel path*: the device type, the compute dtype and the attention and
expert kernels. :class:`Execution` is that choice; :meth:`Execution.kernel_path` is the
string recorded in the runtime identity (``RuntimeIdentity.v3``'s ``kernel_path``; the
dtype has its own identity field), so a record captured on one path never replays on
another: its identity differs and replay refuses it, naming the field.

The typer options (:data:`DEVICE_OPTION`, :data:`DTYPE_OPTION`, :data:`ATTENTION_OPTION`)
are shared by capture, replay, parity and train so the flags mean the same everywhere.
``cuda`` and ``mps`` fail with a clear message where this torch build has no such
device (:func:`require_device`). torch is imported inside the functions only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer

from hebrus_flywheel.core.dtypes import COMPUTE_DTYPES
from hebrus_flywheel.core.errors import ConfigError

DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "mps")
ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager")
ATTENTION_CHOICES: tuple[str, ...] = ("auto", *ATTENTION_IMPLEMENTATIONS)
"""``auto`` resolves when the checkpoint is read: sdpa where its transformers model class
supports it, else eager (GPT-OSS's attention sinks); only a resolved kernel is recorded."""
DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_ATTENTION = "cpu", "float32", "auto"



def device_option(default: str | None = DEFAULT_DEVICE, *, what: str = "Teacher",
                  allow_auto: bool = False) -> Any:
    """The ``--device`` option (``auto`` too where ``allow_auto``)."""
    choices = "auto, " * allow_auto + "cpu, cuda, cuda:N or mps"
    return typer.Option(default, "--device", help=f"{what} device: {choices}; cuda and mps "
                        "fail clearly where this machine has none.")


DEVICE_OPTION: Any = device_option()
DTYPE_OPTION: Any = typer.Option(
    DEFAULT_DTYPE, "--dtype", help="Teacher compute dtype: float32, bfloat16, float16 or "
    "float64 (part of the runtime identity; float64 also raises the float32 parts of the "
    "modeling code, so decode and replay agree to ~1e-14: see replay.float64).")
ATTENTION_OPTION: Any = typer.Option(
    DEFAULT_ATTENTION, "--attention", help="Attention kernel: auto, sdpa or eager (part of "
    "the kernel path recorded in the runtime identity; auto: sdpa where the checkpoint's "
    "model supports it, else eager).")


def check_device_name(device: str, *, allow_auto: bool = False) -> str:
    """``device`` if it names a device type this project knows (``cuda:N`` included)."""
    kind, sep, index = device.partition(":")
    known = kind in DEVICE_TYPES and (not sep or (kind == "cuda" and index.isdigit()))
    if not (known or (allow_auto and device == "auto")):
        choices = ", ".join(("auto",) * allow_auto + DEVICE_TYPES + ("cuda:N",))
        raise ConfigError(f"device must be one of {choices}, got {device!r}")
    return device


def require_device(device: str) -> None:
    """ConfigError naming what to do unless ``device`` exists in this torch build."""
    import torch

    kind = check_device_name(device).split(":", 1)[0]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device}: CUDA is not available here (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}, no visible GPU); pass "
                "--device cpu, or run on a machine with an NVIDIA GPU and a CUDA torch")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device {device}: only {torch.cuda.device_count()} CUDA "
                              "device(s) are visible; pass --device cuda:0")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device}: Apple MPS is not available here (needs macOS on "
                          "Apple silicon and an MPS torch build); pass --device cpu")


@dataclass(frozen=True, kw_only=True)
class Execution:
    """How a teacher executes.

    Fields:
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``mps``; only its type enters the kernel
            path (``cuda:0`` and ``cuda:1`` run the same kernels).
        dtype: compute dtype the weights are cast to (``float32``, ``bfloat16``,
            ``float16``, ``float64``: :mod:`replay.float64`).
        attention: attention implementation (``sdpa`` or ``eager``); replay needs a
            materialised mask, which both give. ``auto`` until the checkpoint is read
            (:meth:`with_attention`); a kernel path needs it resolved.
    """

    device: str = DEFAULT_DEVICE
    dtype: str = DEFAULT_DTYPE
    attention: str = DEFAULT_ATTENTION

    def __post_init__(self) -> None:
        check_device_name(self.device)
        if self.dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"dtype must be one of {list(COMPUTE_DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float64" and self.device_type == "mps":
            raise ConfigError("dtype float64: Apple MPS has no float64 kernels; run float64 "
                              "on --device cpu or cuda, or pick float32")
        if self.attention not in ATTENTION_CHOICES:
            raise ConfigError(f"attention must be one of {list(ATTENTION_CHOICES)}, "
                              f"got {self.attention!r}")

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    def with_attention(self, attention: str) -> Execution:
        """This execution with ``attention`` (a resolved ``auto``)."""
        return Execution(device=self.device, dtype=self.dtype, attention=attention)

    def kernel_path(self, experts_implementation: str) -> str:
        """``device=…;attention=…;experts=…``: the identity's record of the kernels."""
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ConfigError(f"attention {self.attention!r} must be resolved (sdpa or eager) "
                              "before it is recorded in a kernel path")
        return (f"device={self.device_type};attention={self.attention};"
                f"experts={experts_implementation}")


def parse_kernel_path(text: str) -> dict[str, str]:
    """The ``key=value`` fields of a :meth:`Execution.kernel_path` ({} for ``""``)."""
    if not text:
        return {}
    pairs = [item.partition("=") for item in text.split(";")]
    if any(not key or sep != "=" for key, sep, _ in pairs):
        raise ConfigError(f"kernel_path {text!r} is not a ';'-separated list of key=value")
    return {key: value for key, _, value in pairs}
