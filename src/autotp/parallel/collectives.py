"""The two collectives a tensor-parallel forward needs.

Under `torch.compile` they are functional collectives (`torch.distributed._functional_collectives`),
which return new tensors and keep the sharded model traceable without graph breaks; CPU tensors go through
the custom ops `autotp::all_reduce_sum` and `autotp::all_gather`, which the compiled graph calls as it calls
a matmul, so a compiled step keeps the shared-memory path below instead of gloo's ~1 ms per call. In eager mode they
are the plain in-place `torch.distributed` calls: measured on 2 CPU ranks (gloo), a 2048-float
all-reduce took 102 us in place against 283 us through the functional wrapper and its wait, 5-11% of a
starcoderbase-1b decode step at tp 2. Both are the identity on a single rank, so tp 1 pays nothing.
CPU tensors of ranks that share a host go through shared memory instead (shm.py: a 64 KB all-reduce at tp 2
in tens of microseconds against gloo's hundreds); gloo carries them across hosts and where that cannot be set
up, NCCL carries CUDA tensors.

The sharded model names its process group (`GroupRef`) instead of holding it, as DeviceMesh does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group

from autotp.parallel import shm

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older releases lack the new one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class GroupRef:
    """A process group by its name (and size), looked up at each collective (0.15 us).

    A sharded model lives as long as the user's script, often until the interpreter exits. Were its
    layers to hold the ProcessGroup itself, `destroy_process_group` could not free it: gloo's worker
    threads would live on, and one that drops its last reference to a collective's tensor after
    interpreter finalization has begun needs the GIL, cannot have it, and aborts the process
    (autotp.distributed.init says more). By name, destroying the group frees it and joins its threads."""

    name: str
    size: int

    @staticmethod
    def of(group: dist.ProcessGroup | None) -> GroupRef | None:
        return None if group is None else GroupRef(group.group_name, dist.get_world_size(group))

    def get(self) -> dist.ProcessGroup:
        return _resolve_process_group(self.name)


def group_size(group: GroupRef | None) -> int:
    return 1 if group is None else group.size


def all_reduce_sum(x: torch.Tensor, group: GroupRef | None) -> torch.Tensor:
    """Sum of `x` over the ranks of `group`, the same bits on every rank. Eager mode sums into `x`,
    which callers pass fresh (a matmul or lookup output nothing else holds)."""
    if group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        if x.device.type == "cpu":
            return torch.ops.autotp.all_reduce_sum(x, group.name, group.size)
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group.name))
    return _reduce_in_place(x, group)


def _reduce_in_place(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    pg = group.get()
    local = _shared(group, pg, x)
    if local is not None:
        return local.all_reduce(x)
    dist.all_reduce(x, group=pg)
    return x


def _shared(group: GroupRef, pg: dist.ProcessGroup, x: torch.Tensor) -> shm.ShmGroup | None:
    """The group's shared segment where x can go through it (a contiguous CPU tensor of ranks on one host)."""
    return shm.for_group(group.name, pg) if x.device.type == "cpu" and x.is_contiguous() else None


def all_gather_last_dim(x: torch.Tensor, sizes: list[int], group: GroupRef | None) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim; rank r contributes `sizes[r]` columns.

    Uneven sizes are padded to the largest so that one all-gather of equal blocks suffices:
    x (..., sizes[rank]) -> padded (..., max) -> gathered (tp, ..., max) -> (..., sum(sizes)).
    """
    if len(sizes) == 1:
        return x
    width = max(sizes)
    if x.shape[-1] != width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    x = x.unsqueeze(0).contiguous()
    if not torch.compiler.is_compiling():
        gathered = _gather(x, group)
    elif x.device.type == "cpu":
        gathered = torch.ops.autotp.all_gather(x, group.name, group.size)
    else:
        gathered = funcol.wait_tensor(funcol.all_gather_single(x, 0, group.name))
    return torch.cat([gathered[r, ..., :n] for r, n in enumerate(sizes)], dim=-1)


def _gather(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    """x (1, ...) -> (tp, ...), every rank's x in rank order."""
    pg = group.get()
    local = _shared(group, pg, x)
    if local is not None:
        return local.all_gather(x[0])
    gathered = x.new_empty((group.size, *x.shape[1:]))
    _all_gather_single(gathered, x, group=pg)
    return gathered


# The eager collectives as ops a compiled graph calls opaquely (out of place, as a compiler wants them).
@torch.library.custom_op("autotp::all_reduce_sum", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return _reduce_in_place(x.clone(), GroupRef(group, size))


@_all_reduce_op.register_fake
def _(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("autotp::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return _gather(x.contiguous(), GroupRef(group, size))


@_all_gather_op.register_fake
def _(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return x.new_empty((size, *x.shape[1:]))
