"""The paged KV pool of one rank and the attention that reads it: the only code that touches its tensors.

Every layer keeps keys and values for `num_blocks * block_size` token slots, (slots + 2, kv_heads, head_dim)
each, kv_heads being this rank's own (replicated where KV heads < tp, StarCoder's one K/V head on every rank).
Slot `block * block_size + i` holds token i of that block; of the two extra slots, the first stays zero and
is what padding reads, the second (scratch) is what the compiled decode's padding rows write (compiled.py).
A sequence is a block table (block ids in order), so rows join and leave a batch by
bookkeeping alone, and two prompts with a common prefix can share its blocks.

The model stays Hugging Face's. One forward runs a whole step: every row's new tokens flattened into one
(1, tokens) input, decode rows and prefill chunks alike. HF's attention modules call `cache.update(k, v,
layer_idx)` (here: write the new keys and values into their slots) and then the function registered as
`ATTENTION` in transformers' `AttentionInterface` (here: `paged_attention`, which reads each row's
context from the pool). The step's index tensors (`Layout`) are built once per forward and reach the
attention through the forward's keyword arguments, which HF passes down to it.

Attention is exact SDPA per row: the decode rows in one padded batch (one query each), each prefill chunk
on its own with its causal offset, a sliding window where the layer has one. A model whose attention does
not reach the interface (BLOOM, Falcon and MPT compute ALiBi attention inline) is found by `reaches` and
served by the padded engine instead (state.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION = "autotp_paged"


@dataclass
class Layout:
    """One step's tensors, built on every rank from the step's rows (runner.py).

    write: (tokens,) the slot of each new token; decode: indices into the tokens of the rows that compute
    one token, with their context slots (rows, longest) and its mask (rows, 1, 1, longest); prefill: per
    other row, its token range [a, b), its context slots (start + b - a,) and the position of its first
    token; positions: (tokens,) of every new token, for sliding windows."""

    write: torch.Tensor
    positions: torch.Tensor
    decode: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefill: list[tuple[int, int, torch.Tensor, int]]


class KvPool:
    """Keys and values of every layer, allocated once at start-up from what a probe forward stored."""

    def __init__(self, shapes: list[tuple[int, int, torch.dtype]], num_blocks: int, block_size: int,
                 device: torch.device):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.slots = num_blocks * block_size  # the index of the zero padding slot
        self.scratch = self.slots + 1  # written by padding rows, never read
        self.keys, self.values = [], []
        for heads, dim, dtype in shapes:
            for store in (self.keys, self.values):
                t = torch.empty(self.slots + 2, heads, dim, dtype=dtype, device=device)
                t[self.slots].zero_()
                store.append(t)


class PagedCache:
    """What HF's attention calls `update` on: stores a layer's new keys and values in their slots.

    pool None: a probe that only records each layer's (kv_heads, head_dim, dtype) (`probe`)."""

    def __init__(self, pool: KvPool | None, layout: Layout | None):
        self.pool, self.layout = pool, layout
        self.shapes: dict[int, tuple[int, int, torch.dtype]] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key, value: (1, kv_heads, tokens, head_dim), the step's new tokens. Returned unchanged: the
        attention reads them back from the pool with the context they belong to."""
        if self.pool is None:
            self.shapes[layer_idx] = (key.shape[1], key.shape[3], key.dtype)
            return key, value
        write = self.layout.write
        self.pool.keys[layer_idx].index_copy_(0, write, key[0].transpose(0, 1))
        self.pool.values[layer_idx].index_copy_(0, write, value[0].transpose(0, 1))
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given; nothing in HF's forward needs more than this


def _window(mask: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
    """Also hide keys more than window - 1 positions before their query (HF's sliding-window rule)."""
    if window is None:
        return mask
    return mask & (keys > queries - window)


def _check(module, paged, kwargs: dict) -> None:
    """What this attention cannot do, said before it computes anything wrong."""
    if paged is None:
        raise RuntimeError("paged attention called without the step's layout (this model's forward does not pass "
                           "its keyword arguments to its attention)")
    if kwargs.get("softcap") is not None or hasattr(module, "sinks"):
        raise RuntimeError("paged attention has no logit soft-capping or attention sinks")


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                    paged: tuple[KvPool, Layout] | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, heads, tokens, head_dim) -> (1, tokens, heads, head_dim), each token attending to its own
    row's context in the pool. attention_mask is unused: the layout says who sees what."""
    _check(module, paged, kwargs)
    pool, layout = paged
    layer = module.layer_idx
    keys, values = pool.keys[layer], pool.values[layer]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # (tokens, heads, head_dim)
    if layout.decode is not None:
        q = query[0, :, layout.decode, :].transpose(0, 1)[:, :, None]  # (rows, heads, 1, head_dim)
        rows, longest = layout.decode_slots.shape
        flat = layout.decode_slots.flatten()  # index_select: 5x faster than indexing with a tensor on CPU
        k = keys.index_select(0, flat).view(rows, longest, *keys.shape[1:]).transpose(1, 2)  # (rows, kv, L, d)
        v = values.index_select(0, flat).view(rows, longest, *values.shape[1:]).transpose(1, 2)
        mask = layout.decode_mask
        if sliding_window is not None:
            cols = torch.arange(k.shape[2], device=k.device)
            mask = _window(mask, cols, layout.positions[layout.decode][:, None, None, None], sliding_window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[layout.decode] = o[:, :, 0]
    for a, b, slots, start in layout.prefill:
        q = query[:, :, a:b]  # (1, heads, n, head_dim)
        k, v = keys.index_select(0, slots).transpose(0, 1)[None], values.index_select(0, slots).transpose(0, 1)[None]
        cols = torch.arange(len(slots), device=q.device)
        rows = torch.arange(start, start + b - a, device=q.device)[:, None]
        mask = _window(cols <= rows, cols, rows, sliding_window)
        out[a:b] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                                  enable_gqa=True)[0].transpose(0, 1)
    return out[None], None


AttentionInterface.register(ATTENTION, paged_attention)


def probe(model) -> tuple[list[tuple[int, int, torch.dtype]] | None, str]:
    """A 1-token forward through the paged path with a recording cache: this rank's (kv_heads, head_dim,
    dtype) of every layer, or None and why when the model's attention does not reach the interface
    (BLOOM, Falcon, MPT: inline ALiBi attention). Every rank calls it together (it is a forward)."""
    seen: set[int] = set()

    def recording(module, query, *args, paged=None, **kwargs):
        _check(module, paged, kwargs)
        seen.add(module.layer_idx)
        return query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3]), None

    cache, device = PagedCache(None, None), model.device
    previous = model.config._attn_implementation
    AttentionInterface._global_mapping[ATTENTION] = recording
    try:
        model.config._attn_implementation = ATTENTION
        with torch.inference_mode():
            model(input_ids=torch.tensor([[0]], device=device), position_ids=torch.tensor([[0]], device=device),
                  cache=cache, use_cache=True, logits_to_keep=1, paged=(None, None))
    except Exception as e:  # noqa: BLE001 - a forward that refuses the keyword, loses it, or needs its own mask
        return None, f"its forward does not run on the paged pool ({type(e).__name__}: {e})".splitlines()[0][:200]
    finally:
        AttentionInterface._global_mapping[ATTENTION] = paged_attention
        model.config._attn_implementation = previous
    if not cache.shapes or seen != set(cache.shapes):
        return None, "its attention does not go through transformers' AttentionInterface"
    return [cache.shapes[i] for i in range(len(cache.shapes))], ""
