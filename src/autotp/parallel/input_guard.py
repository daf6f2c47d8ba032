"""The input guard: every rank of a sharded model must run the same forward, or the sums are garbage.

Tensor parallelism is only correct when all ranks feed the same token ids: each all-reduce adds up
partial results, and partial results of *different* sequences add up to silent nonsense. autotp makes
ranks agree where it can (rank 0's random state on every rank after loading), but a user script can
still make them diverge, most often with `torch.manual_seed(rank)`. So before each forward every rank
takes a fingerprint of its input ids and one all-reduce (MAX of [f, -f], 16 bytes) tells whether all
fingerprints are equal; only when they are not, a second collective gathers them to name the ranks.
Every rank sees the same reduced value, so every rank raises together: an error, never a hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autotp.errors import AutotpError
from autotp.parallel.collectives import GroupRef

# odd 61-bit multiplier: fingerprint = sum(ids[i] * (i + 1) * M) in wrapping int64 arithmetic, so
# swapped, changed, added or dropped tokens all change it
_MULTIPLIER = 0x1FFFFFFFFFFFFFFF - 130


def fingerprint(ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) integer ids -> 0-d int64, equal for equal ids and shapes (including the shape)."""
    flat = ids.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * _MULTIPLIER
    return (flat * weights).sum() + ids.shape[-1] * 1_000_003 + flat.numel()


class InputGuard:
    """A forward pre-hook for the top-level model: raises on every rank when ranks' input ids differ."""

    def __init__(self, group: GroupRef, device: torch.device):
        self.group, self.device = group, device  # where the fingerprint travels: distributed.wire_device
        self.calls = 0  # forward calls so far, to name the step that diverged

    def __call__(self, module, args, kwargs) -> None:
        if torch.compiler.is_compiling():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            return  # inputs_embeds only: nothing to compare cheaply
        self.calls += 1
        f = fingerprint(ids).to(self.device)
        both = torch.stack([f, -f])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group.get())
        if both[0] == -both[1]:  # max(f) == min(f): every rank has the same fingerprint
            return
        everyone = [torch.zeros_like(f) for _ in range(self.group.size)]
        dist.all_gather(everyone, f, group=self.group.get())
        odd = [r for r, g in enumerate(everyone) if not torch.equal(g, everyone[0])]
        raise AutotpError(
            f"tensor-parallel ranks fed different input ids to forward call {self.calls} (shape "
            f"{tuple(ids.shape)}): rank{'s' * (len(odd) > 1)} {', '.join(map(str, odd))} disagree with rank 0. "
            "Every rank must run the same inputs and sample the same tokens: seed all ranks alike "
            "(the same torch.manual_seed(s) everywhere, not one per rank) or leave seeding to autotp")
