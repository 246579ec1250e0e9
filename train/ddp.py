"""Distributed data parallel plumbing: one process per rank, started by ``torchrun``.

``torchrun --nproc_per_node=N -m train.cli train ...`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the rendezvous variables; :func:`init_distributed` then joins the
process group (``nccl`` on CUDA, ``gloo`` on CPU). Without those variables everything
runs as rank 0 of 1 and no process group is created. Ranks read disjoint units of the
snapshot (:mod:`train.data`), so the global batch is ``world_size * batch_size``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hebrus_flywheel.core.errors import ConfigError


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """``gloo``/``nccl`` when a process group was created, None for a single process."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None


def pick_device(device: str, local_rank: int) -> torch.device:
    """``auto`` is ``cuda:<local_rank>`` when CUDA is available, else ``cpu``; ``cuda`` or
    ``mps`` where this machine has none is a ConfigError saying so (core.execution)."""
    from hebrus_flywheel.core.execution import check_device_name, require_device

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device_name(device)
    require_device(device)
    if device == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_distributed(device: str = "auto") -> DistContext:
    """Join the torchrun process group if there is one (see the module doc)."""
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    chosen = pick_device(device, local_rank)
    if world <= 1:
        return DistContext(rank=0, world_size=1, local_rank=0, device=chosen, backend=None)
    backend = "nccl" if chosen.type == "cuda" else "gloo"
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=local_rank, device=chosen, backend=backend)


def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum of ``values`` over ranks (float64 on CPU for gloo; the input is unchanged)."""
    if not ctx.distributed:
        return values
    out = values.detach().to(torch.float64 if ctx.backend == "gloo" else values.dtype)
    out = out.to("cpu" if ctx.backend == "gloo" else ctx.device).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (a no-op for a single process)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()
