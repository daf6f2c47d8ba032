"""Rank plumbing: process-group set-up from the launcher's environment, rank-aware printing.

torchrun and the `deepspeed` launcher both export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; multi-node torchrun (rendezvous) exports the same. CUDA ranks use NCCL on device
LOCAL_RANK, CPU ranks use gloo. A plain single process, with no WORLD_SIZE, is tp 1 with no group.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from autotp.errors import AutotpError


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None  # None when world_size == 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return default if value is None else int(value)
    except ValueError:
        raise AutotpError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present (or asked for), else cpu."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise AutotpError("device 'cuda' was asked for but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise AutotpError(f"LOCAL_RANK {local_rank} has no GPU: torch sees {torch.cuda.device_count()}")
    return device


def init(device: str | torch.device | None = None, timeout_s: float | None = None) -> Dist:
    """Join (or reuse) the default process group described by the environment."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK", rank)
        if device is None and dist.get_backend() == "gloo":
            device = "cpu"
        group = dist.group.WORLD if world > 1 else None
        return Dist(rank, world, local_rank, resolve_device(device, local_rank), group)

    world = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    dev = resolve_device(device, local_rank)
    if world == 1:
        return Dist(0, 1, 0, dev, None)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise AutotpError(f"WORLD_SIZE={world} but {name} is not set: launch with torchrun or deepspeed")
    timeout = timedelta(seconds=timeout_s or float(os.environ.get("AUTOTP_TIMEOUT", 600)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return Dist(rank, world, local_rank, dev, dist.group.WORLD)


def rank() -> int:
    """This process's rank, also before the process group exists (from the launcher's RANK)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def fail(message: str, code: int = 1) -> int:
    """One line on stderr: every rank would say the same, so rank 0 speaks unless the failure is its own."""
    prefix = "autotp: error" if rank() == 0 else f"autotp: error on rank {rank()}"
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)
    return code
