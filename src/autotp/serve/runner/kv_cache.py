"""The paged KV pool of one rank, the cache object HF's forward writes through, and the attention interface.

Every layer keeps keys and values for `num_blocks * block_size` token slots, (slots + 2, kv_heads, head_dim)
each, kv_heads being this rank's own (replicated where KV heads < tp, StarCoder's one K/V head on every rank).
Slot `block * block_size + i` holds token i of that block; of the two extra slots, the first stays zero and
is what padding reads, the second (scratch) is what the compiled decode's padding rows write (compiled.py).
A sequence is a block table (block ids in order), so rows join and leave a batch by bookkeeping alone, and two
prompts with a common prefix can share its blocks.

The model stays Hugging Face's. One forward runs a whole step: every row's new tokens flattened into one
(1, tokens) input, decode rows and prefill chunks alike. HF's attention modules call `cache.update(k, v,
layer_idx)` (here: write the new keys and values into their slots) and then either the function registered as
`ATTENTION` in transformers' `AttentionInterface` (`paged_attention`), or, for the families whose attention is
computed inline (BLOOM, Falcon, MPT), their adapter (adapters.py). Both call `StepCache.attend`, which reads
each row's context from the pool as the step's description (attention/step.StepMeta) says.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AttentionInterface

from autotp.errors import AutotpError
from autotp.serve.runner.attention.step import Alibi, StepMeta, ship

ATTENTION = "autotp_paged"


class KvPool:
    """Keys and values of every layer this rank holds (layers first, first + 1, ...: a pipeline stage's), allocated
    once at start-up from what the probe forward stored."""

    def __init__(self, shapes: list[tuple[int, int, torch.dtype]], num_blocks: int, block_size: int,
                 device: torch.device, first: int = 0):
        self.block_size, self.num_blocks, self.first = block_size, num_blocks, first
        self.slots = num_blocks * block_size  # the index of the zero padding slot
        self.scratch = self.slots + 1  # written by padding rows, never read
        self.keys, self.values = [], []
        for heads, dim, dtype in shapes:
            for store in (self.keys, self.values):
                # zeros, not empty: flex reads slots no token has written yet (a row's partly filled last block;
                # eager flex, the whole pool), masked to a weight of 0, and 0 * NaN from uninitialized memory is NaN
                t = torch.zeros(self.slots + 2, heads, dim, dtype=dtype, device=device)
                if t.is_cuda:  # the compiled step writes into it: CUDA graphs need its address fixed
                    torch._dynamo.mark_static_address(t)
                store.append(t)

    def copy(self, copies: list[tuple[int, ...]]) -> None:
        """copies: (source block, destination block, m) each: the destination's first m slots get the source's keys
        and values, in every layer (a new row's prompt shares m tokens with a known block: blocks.BlockPool.extend).
        Two ops per layer, whatever the number of copies."""
        size = self.block_size
        src, dst = ship([np.array([s * size + i for s, _, m in copies for i in range(m)]),
                         np.array([d * size + i for _, d, m in copies for i in range(m)])], self.keys[0].device)
        with torch.no_grad():
            for t in (*self.keys, *self.values):
                t.index_copy_(0, dst, t.index_select(0, src))


class StepCache:
    """What HF's attention calls `update` on, and what it attends through.

    pool None: the probe, which only records each layer's (kv_heads, head_dim, dtype) and the layers that attend."""

    def __init__(self, pool: KvPool | None, meta: StepMeta | None, tokens: int):
        self.pool, self.meta, self.tokens = pool, meta, tokens
        self.per_step: dict = {}  # what every layer of this forward would compute alike (an adapter's bias table)
        self.shapes: dict[int, tuple[int, int, torch.dtype]] = {}
        self.attended: set[int] = set()
        self.needs: set[str] = set()  # what the probe saw a layer ask of the attention beyond a causal mask

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key, value: (1, kv_heads, tokens, head_dim), the step's new tokens. Returned unchanged: the
        attention reads them back from the pool with the context they belong to."""
        if self.pool is None:
            self.shapes[layer_idx] = (key.shape[1], key.shape[3], key.dtype)
            return key, value
        write, i = self.meta.slot_mapping, layer_idx - self.pool.first
        self.pool.keys[i].index_copy_(0, write, key[0].transpose(0, 1))
        self.pool.values[i].index_copy_(0, write, value[0].transpose(0, 1))
        return key, value

    def attend(self, layer_idx: int, query: torch.Tensor, scale: float | None = None, window: int | None = None,
               softcap: float | None = None, alibi: Alibi | None = None) -> torch.Tensor:
        """query (1, heads, tokens, head_dim) -> (1, tokens, heads, head_dim): every token over its own row's
        context (the step's attention backend); zeros in the probe, which records what the layer asked for (`needs`)."""
        if self.pool is None:
            self.attended.add(layer_idx)
            self.needs |= {"soft-capping"} if softcap is not None else set()
            self.needs |= {"ALiBi"} if alibi is not None else set()
            return query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
        i = layer_idx - self.pool.first
        keys, values = self.pool.keys[i], self.pool.values[i]
        out = self.meta.attention.attend(query[0].transpose(0, 1), keys, values, scale, window, softcap, alibi)
        return out[None]

    # What HF's model-level forwards ask a cache before their layers run. Positions are always given, and the
    # masks they would build go unused (the step's description says who sees what); the ALiBi families size
    # their bias table from these: it must cover the step's longest context.
    def width(self) -> int:
        return max(self.meta.width if self.meta is not None else 1, self.tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width() - self.tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.width(), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                    softcap: float | None = None, paged: StepCache | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (1, heads, tokens, head_dim) -> (1, tokens, heads, head_dim).
    attention_mask is unused: the step's description says who sees what."""
    if paged is None:
        raise AutotpError("paged attention called without the step's cache (this model's forward does not pass "
                          "its keyword arguments to its attention)")
    if hasattr(module, "sinks") or kwargs.get("s_aux") is not None:
        raise AutotpError("paged attention has no attention sinks")
    return paged.attend(module.layer_idx, query, scaling, sliding_window, softcap), None


AttentionInterface.register(ATTENTION, paged_attention)
