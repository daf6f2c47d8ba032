"""A step's attention on a pool of random keys and values, and its oracle: dense attention per row and query in
float64, over the row's context read by position through its block table, with the family's bias (ALiBi from the
first or the last key), sliding window and soft-cap written out here, not taken from the code under test."""

from __future__ import annotations

import torch

from autotp.serve.runner.attention.backends import BACKENDS
from autotp.serve.runner.attention.step import StepLayout, StepMeta, ship
from autotp.serve.runner.kv_cache import KvPool

BLOCK = 4
# (start, tokens): decode rows, rows verifying a draft of 3, prefill chunks (one from position 0, one mid-prompt)
ROWS = [(9, 1), (2, 1), (17, 1), (5, 4), (12, 4), (0, 11), (6, 9), (0, 1)]
SHORT = 4  # 1 + a draft of 3: decode and drafted rows share one call


def describe(pool: KvPool, tables: list[list[int]], rows, backend: str) -> StepMeta:
    """The step's description as the model runner builds it: the rows' layout, then the backend's own."""
    layout = StepLayout(tables, torch.tensor([s for s, _ in rows]).numpy(), torch.tensor([n for _, n in rows]).numpy(),
                        pool.block_size, pool.num_blocks)
    arrays, build = BACKENDS[backend](SHORT).describe(layout)
    slots, positions, *rest = ship([layout.slots, layout.positions, *arrays], "cpu")
    return StepMeta(slots, positions, build(rest))


def attend(query, keys, values, meta: StepMeta, scale=None, window=None, softcap=None, alibi=None) -> torch.Tensor:
    """What a layer's attention does with the step's description (kv_cache.StepCache.attend)."""
    return meta.attention.attend(query, keys, values, scale, window, softcap, alibi)


def step(heads: int, kv: int, dim: int = 8, seed: int = 0, backend: str = "sdpa", rows=ROWS):
    """A pool with random keys and values, the rows' block tables (shuffled blocks), their new tokens' queries
    and keys written to their slots as `StepCache.update` does."""
    g = torch.Generator().manual_seed(seed)
    pool = KvPool([(kv, dim, torch.float32)], num_blocks=64, block_size=BLOCK, device=torch.device("cpu"))
    pool.keys[0][:pool.slots] = torch.randn(pool.slots, kv, dim, generator=g)
    pool.values[0][:pool.slots] = torch.randn(pool.slots, kv, dim, generator=g)
    order = torch.randperm(64, generator=g).tolist()
    tables = []
    for start, n in rows:
        blocks = -(-(start + n) // BLOCK)
        tables.append(order[:blocks])
        del order[:blocks]
    meta = describe(pool, tables, rows, backend)
    tokens = sum(n for _, n in rows)
    query = torch.randn(heads, tokens, dim, generator=g).transpose(0, 1)  # as StepCache.attend passes it
    pool.keys[0].index_copy_(0, meta.slot_mapping, torch.randn(tokens, kv, dim, generator=g))
    pool.values[0].index_copy_(0, meta.slot_mapping, torch.randn(tokens, kv, dim, generator=g))
    return pool, tables, meta, query


def dense(pool, tables, query, scale, window=None, softcap=None, slopes=None, from_end=False,
          rows=ROWS) -> torch.Tensor:
    """Row by row, query by query, in float64."""
    heads, kv = query.shape[1], pool.keys[0].shape[1]
    out, t = torch.empty(query.shape, dtype=torch.float64), 0
    for table, (start, n) in zip(tables, rows, strict=True):
        length = start + n
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)]
        k, v = pool.keys[0][slots].double(), pool.values[0][slots].double()  # (length, kv, d)
        for i in range(n):
            pos = start + i
            for h in range(heads):
                j = h // (heads // kv)
                scores = (k[:pos + 1, j] @ query[t + i, h].double()) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                keys = torch.arange(pos + 1, dtype=torch.float64)
                if slopes is not None:
                    scores = scores + slopes[h] * (keys - (length - 1) if from_end else keys)
                if window is not None:
                    scores = scores.masked_fill(keys <= pos - window, float("-inf"))
                out[t + i, h] = scores.softmax(-1) @ v[:pos + 1, j]
        t += n
    return out


LAYOUTS = {"multi-query": (6, 1), "grouped-query": (6, 2), "multi-head": (3, 3)}
