"""Rows of one padded HF cache: the memory of the continuous batch, and the only code that edits a cache.

Layout, as in a left-padded HF `generate`: the batch is L columns wide and row i's tokens fill its last
len_i columns; the 2-D mask (rows, L) marks them. Every layer of the HF `DynamicCache` holds keys and
values (rows, kv_heads_per_rank, S, head_dim), with S = L for full attention and S = min(L, window - 1)
for a sliding-window layer (whose cumulative_length is L). HF builds each step's 4-D mask, ALiBi bias
and positions from exactly this, so the model's forward runs unchanged.

Rows join and leave by copying (TGI's `CausalLMBatch` does the same): `select` keeps some rows and trims
the leading columns none of them uses, `extend` left-pads both sides to the wider one and stacks them.
Only index and pad operations: a row's cached keys and values are never recomputed or changed.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from autotp.errors import AutotpError

SUPPORTED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def check_cache(cache: DynamicCache) -> None:
    """Refuse cache layers this module cannot edit (quantized, static, linear-attention state)."""
    for layer in cache.layers:
        if type(layer) not in SUPPORTED_LAYERS or not layer.is_initialized:
            raise AutotpError(f"autotp serve batches HF caches of {', '.join(t.__name__ for t in SUPPORTED_LAYERS)} "
                              f"layers; this model's cache has a {type(layer).__name__}")


def cache_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def _stored(layer, width: int) -> int:
    """How many of `width` columns a layer keeps: all, or a sliding window's last window - 1."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        return min(width, layer.sliding_window - 1)
    return width


def _set_width(layer, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
    layer.keys, layer.values = keys, values
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = width


def _pad_left(layer, old: int, new: int) -> None:
    """A layer `old` columns wide made `new` wide: zero keys and values in front (masked out)."""
    have, want = layer.keys.shape[-2], _stored(layer, new)
    if want > have:  # only when the layer held every column: the new ones are all padding
        shape = (*layer.keys.shape[:-2], want - have, layer.keys.shape[-1])
        keys = torch.cat([layer.keys.new_zeros(shape), layer.keys], dim=-2)
        values = torch.cat([layer.values.new_zeros(shape[:-1] + layer.values.shape[-1:]), layer.values], dim=-2)
    else:
        keys, values = layer.keys, layer.values
    _set_width(layer, keys, values, new)


class PaddedBatch:
    """rows: the row ids, in batch order; cache: their DynamicCache; mask: (rows, L) int64, 1 = a token."""

    def __init__(self, rows: list[int], cache: DynamicCache, mask: torch.Tensor):
        self.rows, self.cache, self.mask = rows, cache, mask

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def lengths(self) -> torch.Tensor:
        """(rows,) tokens each row holds: the position of its next token."""
        return self.mask.sum(dim=1)

    def grow(self, columns: int) -> torch.Tensor:
        """The mask for a forward that appends `columns` tokens to every row (kept as the new mask)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), columns)], dim=1)
        return self.mask

    def select(self, keep: list[int], trim: bool = True) -> None:
        """Keep these row ids (in this batch's order), then (trim) drop the leading columns none of them uses."""
        index = [self.rows.index(r) for r in keep]
        if index == list(range(len(self.rows))):
            return
        at = torch.tensor(index, device=self.mask.device)
        mask = self.mask.index_select(0, at)
        used = mask.any(dim=0).nonzero()
        start = (int(used[0]) if len(used) else self.width) if trim else 0
        width = self.width - start
        for layer in self.cache.layers:
            if not layer.is_initialized:  # a prefill cancelled before its first chunk
                continue
            keep_cols = _stored(layer, width)
            have = layer.keys.shape[-2]
            keys = layer.keys.index_select(0, at)[..., have - keep_cols:, :]
            values = layer.values.index_select(0, at)[..., have - keep_cols:, :]
            # contiguous: a view would pin the dropped rows' memory until the next step's cat
            _set_width(layer, keys.contiguous(), values.contiguous(), width)
        self.rows, self.mask = list(keep), mask[:, start:].contiguous()

    def extend(self, other: PaddedBatch) -> None:
        """Append other's rows (other is consumed): both left-padded to the wider batch, then stacked."""
        width = max(self.width, other.width)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            _pad_left(mine, self.width, width)
            _pad_left(theirs, other.width, width)
            _set_width(mine, torch.cat([mine.keys, theirs.keys]), torch.cat([mine.values, theirs.values]), width)
        pad = [m.new_zeros(m.shape[0], width - m.shape[1]) for m in (self.mask, other.mask)]
        self.mask = torch.cat([torch.cat([pad[0], self.mask], dim=1), torch.cat([pad[1], other.mask], dim=1)])
        self.rows = self.rows + other.rows
