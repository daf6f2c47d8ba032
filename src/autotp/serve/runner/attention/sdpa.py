"""The `sdpa` attention backend, the default: at most two scaled_dot_product_attention calls per layer and step, over
each row's context gathered out of the paged KV pool.

The rows of a step fall in at most two `Group`s:

- short rows: every row whose query is at most `short` tokens (a decode row's 1, a drafted row's 1 + K, the
  few tokens a cached prompt still computes), padded to the longest of them;
- long rows: the prefill chunks, padded to the longest chunk.

Each group is one attention kernel call per layer, whatever its number of rows: queries (R, Q) against each
row's context gathered from the pool by slot (R, L), under a (R, 1, Q, L) boolean mask that hides what is
not the row's (causality, its length, a sliding window). Grouped-query heads are packed into the query
dimension (transformers' `pack_gqa`): kv head j serves the G = heads / kv_heads query heads j*G .. j*G+G-1
(HF's `repeat_kv` order), so q (R, kv, G*Q, d) attends to k, v (R, kv, L, d) as plain multi-head attention
and no K/V is ever expanded per query head. That also keeps CUDA's SDPA off its math kernel, which is what a
masked `enable_gqa=True` call falls back to. What depends on the layer (its grouped-query factor, window or bias)
is built once per step and kept (`Group.mask`).

Biases and soft-capping ride the same calls: ALiBi (step.Alibi) is an additive float mask built from the bias
table the family's own forward computed (its slopes, its dtype); logit soft-capping (Gemma 2) takes an
explicit score path with HF's eager arithmetic, since SDPA has no soft-cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from autotp.serve.runner.attention.step import Alibi, StepLayout


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

    def mask(self, heads: int, groups: int, window: int | None, alibi: Alibi | None,
             dtype: torch.dtype) -> torch.Tensor:
        """The additive mask (0 or -inf, the bias added) of a layer with `heads` query heads, `groups` of them
        packed per kv head into the query dimension (1: not packed): (R, 1 or heads / groups, groups * Q, L), in
        the queries' dtype, so that no layer converts it again. Built once per step and kept, except while
        compiling (the graph builds it)."""
        bias_key = None if alibi is None else (alibi.table.data_ptr(), alibi.table.shape, alibi.from_end, alibi.scale)
        key = (heads, groups, window, dtype, bias_key)
        if not torch.compiler.is_compiling() and key in self.masks:
            return self.masks[key]
        visible = self.visible
        cols = torch.arange(visible.shape[-1], device=visible.device)
        if window is not None:  # HF's sliding-window rule: key positions > query position - window
            visible = visible & (cols > self.qpos - window)
        rows, _, q, width = visible.shape
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
        if alibi is not None:  # (R, heads, Q, L): each head's bias of each key, as its family computes it
            at = alibi.column(cols, self.qpos[:, 0]).expand(rows, q, width)
            bias = alibi.table[:, at].transpose(0, 1) * alibi.scale
            mask = mask + bias.to(dtype)
        if groups > 1:  # query head h = j * G + i, packed at (j, i * Q + query)
            lead = mask.shape[1] // groups if mask.shape[1] > 1 else 1
            mask = mask.view(rows, lead, -1, q, width).expand(rows, lead, groups, q, width)
            mask = mask.reshape(rows, lead, groups * q, width)
        if not torch.compiler.is_compiling():
            self.masks[key] = mask
        return mask


def _kernel(q, k, v, mask, scale: float | None, softcap: float | None) -> torch.Tensor:
    """q (R, H', Q', d), k and v (R, H', L, d), mask additive (R, 1 or H', Q', L) -> (R, H', Q', d)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # Gemma 2's eager arithmetic: scores in the model's dtype, capped, masked, softmax in float32
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, groups: list[Group],
           scale: float | None = None, window: int | None = None, softcap: float | None = None,
           alibi: Alibi | None = None) -> torch.Tensor:
    """query (tokens, heads, d); keys and values: one layer's pool, (slots + 2, kv, d). -> (tokens, heads, d), each
    token attending to its own row's context: one kernel call per group.

    A group whose queries are no longer than a head (decode and drafted rows) packs its grouped-query heads into
    the query dimension: its mask grows G-fold, (R, 1, G * Q, L), and no K/V is expanded. A longer group (prefill
    chunks) expands K/V to every query head instead, (R, heads, L, d): for Q > d that is the smaller of the two
    (StarCoder's 48 heads on a 2048-token chunk: a packed mask of 48 x 2048 x L against K/V of 48 x 128 x L)."""
    tokens, heads, dim = query.shape
    kv = keys.shape[1]
    g = heads // kv
    # One group without padding holds every token in step order (rows of equal length, consecutive): its queries
    # are the step's as they stand and its output is the layer's, with no gather and no scatter (a decode step).
    alone = len(groups) == 1 and groups[0].real is None
    out = None if alone else query.new_empty(tokens, heads, dim)
    for group in groups:
        rows, q = group.index.shape
        width = group.slots.shape[1]
        flat = group.slots.flatten()  # index_select: 5x faster than indexing with a tensor on CPU
        k = keys.index_select(0, flat).view(rows, width, kv, dim).transpose(1, 2)  # (R, kv, L, d)
        v = values.index_select(0, flat).view(rows, width, kv, dim).transpose(1, 2)
        qs = query if alone else query.index_select(0, group.index.flatten())
        qs = qs.reshape(rows, q, kv, g, dim)
        packed = g > 1 and q <= dim
        if packed:  # (R, Q, kv, G, d) -> (R, kv, G * Q, d): query head h = j * G + i serves kv head j
            qs = qs.permute(0, 2, 3, 1, 4).reshape(rows, kv, g * q, dim)
        else:  # (R, heads, Q, d) against K/V repeated as HF's repeat_kv does
            qs = qs.view(rows, q, heads, dim).transpose(1, 2)
            if g > 1:
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        mask = group.mask(heads, g if packed else 1, window, alibi, query.dtype)
        o = _kernel(qs, k, v, mask, scale, softcap)
        if packed:
            o = o.view(rows, kv, g, q, dim).permute(0, 3, 1, 2, 4).reshape(rows * q, heads, dim)
        else:
            o = o.transpose(1, 2).reshape(rows * q, heads, dim)
        if alone:
            return o
        if group.real is None:
            out.index_copy_(0, group.index.flatten(), o)
        else:
            out.index_copy_(0, group.tokens, o.index_select(0, group.real))
    return out


def group(layout: StepLayout, rows: np.ndarray) -> list[np.ndarray]:
    """Rows `rows` of the layout as one attention group, on the host: [index (R, Q), slots (R, L), qpos (R, Q),
    ends (R,), and where some queries are padding the flat indices of the real ones and their tokens] (Group)."""
    size, tables = layout.block_size, [layout.tables[r] for r in rows]
    starts, counts, firsts = layout.starts[rows], layout.counts[rows], layout.firsts[rows]
    q, ends = int(counts.max()), starts + counts
    width = int(ends.max())
    blocks = -(-width // size)
    table = np.zeros((len(rows), blocks), dtype=np.int64)
    for r, t in enumerate(tables):
        t = t[:blocks]
        table[r, :len(t)] = t
    cols = np.arange(width)
    slots = (table[:, :, None] * size + np.arange(size)).reshape(len(rows), -1)[:, :width]
    slots[cols[None] >= ends[:, None]] = layout.zero  # past a row's context: the zero slot
    real = np.arange(q)[None] < counts[:, None]  # (R, Q): not padding
    index = np.where(real, firsts[:, None] + np.arange(q)[None], firsts[:, None])
    qpos = np.where(real, starts[:, None] + np.arange(q)[None], 0)  # a padding query sees key 0 alone
    arrays = [index, slots, qpos, ends]
    if not real.all():
        flat = np.flatnonzero(real)
        arrays += [flat, index.reshape(-1)[flat]]
    return arrays


def grouped(arrays: list[torch.Tensor]) -> Group:
    """group()'s arrays, on the device, as a Group."""
    index, slots, qpos, ends, *padding = arrays
    qpos = qpos[:, None, :, None]
    visible = torch.arange(slots.shape[1], device=slots.device) <= qpos  # (R, 1, Q, L)
    return Group(index, slots, visible, qpos, ends[:, None], *padding)


@dataclass
class SdpaStep:
    """A step as the sdpa backend reads it: at most two groups (short rows, long rows)."""

    groups: list[Group]

    @property
    def width(self) -> int:
        """The longest context: a shape, so that a compiled graph keeps it symbolic."""
        return max(g.slots.shape[1] for g in self.groups)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None,
               window: int | None, softcap: float | None, alibi: Alibi | None) -> torch.Tensor:
        return attend(query, keys, values, self.groups, scale, window, softcap, alibi)


class Sdpa:
    """The backend's entry in the table (backends.py). short: the longest query the short group takes (1 + the
    draft length: decode and drafted rows share one call)."""

    name = "sdpa"

    def __init__(self, short: int = 1):
        self.short = short

    @staticmethod
    def refuse(device: torch.device, block_size: int) -> str | None:
        return None

    @staticmethod
    def refuse_model(needs: set[str], shapes: list[tuple[int, int, torch.dtype]]) -> str | None:
        return None

    @staticmethod
    def how(device: torch.device) -> str:
        return "at most two kernel calls per layer and step"

    def describe(self, layout: StepLayout) -> tuple[list[np.ndarray], Callable[[list[torch.Tensor]], SdpaStep]]:
        """The host arrays of the step's groups, and what makes the step of them once they are on the device."""
        parts = [group(layout, np.flatnonzero(m)) for m in (layout.counts <= self.short, layout.counts > self.short)
                 if m.any()]

        def build(tensors: list[torch.Tensor]) -> SdpaStep:
            groups, at = [], 0
            for arrays in parts:
                groups.append(grouped(tensors[at:at + len(arrays)]))
                at += len(arrays)
            return SdpaStep(groups)

        return [a for arrays in parts for a in arrays], build
