"""The two collectives a tensor-parallel forward needs, as functional collectives.

Functional collectives (`torch.distributed._functional_collectives`) return new tensors instead of
writing in place, which keeps the sharded model traceable by `torch.compile`. Both functions are the
identity on a single rank, so tp 1 pays nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of `x` over the ranks of `group`, the same bits on every rank."""
    if group_size(group) == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def all_gather_last_dim(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim; rank r contributes `sizes[r]` columns.

    Uneven sizes are padded to the largest so that one all-gather of equal blocks suffices:
    x (..., sizes[rank]) -> padded (..., max) -> gathered (tp, ..., max) -> (..., sum(sizes)).
    """
    if len(sizes) == 1:
        return x
    width = max(sizes)
    if x.shape[-1] != width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    gathered = funcol.wait_tensor(funcol.all_gather_single(x.unsqueeze(0).contiguous(), 0, group))
    return torch.cat([gathered[r, ..., :n] for r, n in enumerate(sizes)], dim=-1)
