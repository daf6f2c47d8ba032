"""Per-head inputs that a model hands its attention modules, cut to the heads one rank holds.

ALiBi models (BLOOM, Falcon with alibi=True, MPT) build one bias per head in the model's forward, from the
global head count, and pass the same tensor to every attention module. There is no per-rank setting that
gives a rank its own heads' slopes: a slope depends on the global head count and the head's index (BLOOM's
no-mask path calls the module-level `_get_alibi_slopes(self.num_heads)` itself), so a per-rank head count
on the model would give the wrong slopes. Instead a forward pre-hook on each attention module narrows the
keyword arguments the plan names (`Plan.head_inputs`) to the rank's heads [q_start, q_stop): rank r's
slopes are exactly the global slopes at its head indices. The hook belongs to one module instance, so two
models in one process never interfere, and no transformers function is patched.

Shape convention: the heads are dim -3 of an attention-score-shaped tensor (..., heads, q, k), with the
batch possibly folded in front of them ((batch * heads, q, k), head fastest, as BLOOM's `alibi`); a heads
dim of size 1 broadcasts over heads and is passed as is (a causal mask without a bias folded in).
"""

from __future__ import annotations

import torch

from autotp.errors import AutotpError
from autotp.parallel.partition import HeadShard


def narrow_heads(tensor: torch.Tensor, heads: HeadShard) -> torch.Tensor:
    """`tensor` (..., [batch *] total_heads, q, k) -> (..., [batch *] heads.q_heads, q, k): the rank's heads."""
    n, total = tensor.shape[-3], heads.total_q_heads
    if n == 1:
        return tensor
    if n % total:
        raise AutotpError(f"a per-head input of shape {tuple(tensor.shape)} has {n} rows at dim -3, not a multiple "
                          f"of the model's {total} heads")
    per_head = tensor.unflatten(-3, (n // total, total))  # (..., batch, total_heads, q, k)
    return per_head.narrow(-3, heads.q_start, heads.q_heads).flatten(-4, -3)


class NarrowHeads:
    """Forward pre-hook (with kwargs) of one attention module: narrows the named inputs to the rank's heads."""

    def __init__(self, names: tuple[str, ...], heads: HeadShard):
        self.names, self.heads = names, heads

    def __call__(self, module, args, kwargs):
        kwargs = dict(kwargs)
        for name in self.names:
            if name not in kwargs:
                raise AutotpError(f"{type(module).__name__} was called without {name}= as a keyword: autotp cannot "
                                  "narrow it to this rank's heads")
            if kwargs[name] is not None:
                kwargs[name] = narrow_heads(kwargs[name], self.heads)
        return args, kwargs
