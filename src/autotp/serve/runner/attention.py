"""One step's attention over the paged KV pool: the step's description and the function every layer calls.

The runner builds one `StepMeta` per step (runner.py), before the forward, and every layer reads it; nothing
here is recomputed per layer except what depends on the layer (its grouped-query factor, window or bias), and
even that is built once per step and kept (`Group.mask`). The rows of a step fall in at most two `Group`s:

- short rows: every row whose query is at most `short` tokens (a decode row's 1, a drafted row's 1 + K, the
  few tokens a cached prompt still computes), padded to the longest of them;
- long rows: the prefill chunks, padded to the longest chunk.

Each group is one attention kernel call per layer, whatever its number of rows: queries (R, Q) against each
row's context gathered from the pool by slot (R, L), under a (R, 1, Q, L) boolean mask that hides what is
not the row's (causality, its length, a sliding window). Grouped-query heads are packed into the query
dimension (transformers' `pack_gqa`): kv head j serves the G = heads / kv_heads query heads j*G .. j*G+G-1
(HF's `repeat_kv` order), so q (R, kv, G*Q, d) attends to k, v (R, kv, L, d) as plain multi-head attention
and no K/V is ever expanded per query head. That also keeps CUDA's SDPA off its math kernel, which is what a
masked `enable_gqa=True` call falls back to.

Biases and soft-capping ride the same calls: ALiBi (`Alibi`) is an additive float mask built from the bias
table the family's own forward computed (its slopes, its dtype); logit soft-capping (Gemma 2) takes an
explicit score path with HF's eager arithmetic, since SDPA has no soft-cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

BACKEND = "sdpa"  # the one backend today: torch's scaled_dot_product_attention over K/V gathered by slot


@dataclass
class Alibi:
    """A family's ALiBi bias as its forward computed it: table (heads, width), the bias of key column c for
    each of this rank's heads; from_end: column `width - length + j` holds key j of a row of `length` keys
    (MPT's bias is relative to the last key), else column j does (BLOOM, Falcon); scale: multiplies it."""

    table: torch.Tensor
    from_end: bool = False
    scale: float = 1.0


@dataclass
class Group:
    """R rows attended in one kernel call (see the module docstring).

    index (R, Q): each query's token in the step's flattened tokens (a padding query repeats the row's first);
    slots (R, L): the slots of each row's context in the pool, positions 0 .. L - 1 (padding: the zero slot);
    visible (R, 1, Q, L): key j visible to query i; a padding query sees key 0 only, so no softmax row is empty;
    qpos (R, 1, Q, 1): each query's position (sliding windows); lengths (R, 1): each row's context length;
    real: the flat (R * Q) indices of the queries that are not padding, tokens: their token index (None: all)."""

    index: torch.Tensor
    slots: torch.Tensor
    visible: torch.Tensor
    qpos: torch.Tensor
    lengths: torch.Tensor
    real: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)

    def mask(self, groups: int, window: int | None, alibi: Alibi | None, dtype: torch.dtype) -> torch.Tensor:
        """The mask of a layer with `groups` query heads per kv head: (R, 1 or kv, G * Q, L), boolean, or float
        with the bias added. Built once per step and kept, except while compiling (the graph builds it)."""
        key = (groups, window, dtype, None if alibi is None else (alibi.table.data_ptr(), alibi.table.shape))
        if not torch.compiler.is_compiling() and key in self.masks:
            return self.masks[key]
        visible = self.visible
        if window is not None:  # HF's sliding-window rule: key positions > query position - window
            visible = visible & (torch.arange(visible.shape[-1], device=visible.device) > self.qpos - window)
        rows, _, q, width = visible.shape
        packed = visible[:, :, None].expand(rows, 1, groups, q, width).reshape(rows, 1, groups * q, width)
        mask = packed
        if alibi is not None:
            cols = torch.arange(width, device=visible.device)[None].expand(rows, width)
            if alibi.from_end:
                cols = cols + alibi.table.shape[1] - self.lengths
            cols = cols.clamp(0, alibi.table.shape[1] - 1)  # past a row's length: masked anyway
            bias = alibi.table[:, cols].transpose(0, 1) * alibi.scale  # (R, heads, L)
            heads = bias.shape[1]
            bias = bias.view(rows, heads // groups, groups, 1, width).expand(rows, heads // groups, groups, q, width)
            bias = bias.reshape(rows, heads // groups, groups * q, width).to(dtype)
            mask = bias.masked_fill(~packed, float("-inf"))
        if not torch.compiler.is_compiling():
            self.masks[key] = mask
        return mask


@dataclass
class StepMeta:
    """One step, as every layer reads it. slot_mapping (tokens,): where each new token's keys and values go;
    positions (tokens,); groups: at most two (short rows, long rows); width: the longest context in the step."""

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    groups: list[Group]
    width: int


def _kernel(q, k, v, mask, scale: float | None, softcap: float | None) -> torch.Tensor:
    """q (R, kv, G*Q, d), k and v (R, kv, L, d) -> (R, kv, G*Q, d)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # Gemma 2's eager arithmetic: scores in the model's dtype, capped, masked, softmax in float32
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: StepMeta, scale: float | None = None,
           window: int | None = None, softcap: float | None = None, alibi: Alibi | None = None) -> torch.Tensor:
    """query (tokens, heads, d); keys and values: one layer's pool, (slots + 2, kv, d). -> (tokens, heads, d), each
    token attending to its own row's context: one kernel call per group."""
    tokens, heads, dim = query.shape
    kv = keys.shape[1]
    g = heads // kv
    out = query.new_empty(tokens, heads, dim)
    for group in meta.groups:
        rows, q = group.index.shape
        width = group.slots.shape[1]
        # (R, Q, kv, G, d) -> (R, kv, G * Q, d): query head h = j * G + i serves kv head j
        qs = query.index_select(0, group.index.flatten()).view(rows, q, kv, g, dim)
        qs = qs.permute(0, 2, 3, 1, 4).reshape(rows, kv, g * q, dim)
        flat = group.slots.flatten()  # index_select: 5x faster than indexing with a tensor on CPU
        k = keys.index_select(0, flat).view(rows, width, kv, dim).transpose(1, 2)
        v = values.index_select(0, flat).view(rows, width, kv, dim).transpose(1, 2)
        o = _kernel(qs, k, v, group.mask(g, window, alibi, query.dtype), scale, softcap)
        o = o.view(rows, kv, g, q, dim).permute(0, 3, 1, 2, 4).reshape(rows * q, heads, dim)
        if group.real is None:
            out.index_copy_(0, group.index.flatten(), o)
        else:
            out.index_copy_(0, group.tokens, o.index_select(0, group.real))
    return out
