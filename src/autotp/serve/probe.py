"""The paged engine's start-up capability check: does this model's attention reach the pool, and with what shapes.

A 1-token forward with a recording cache (paged.PagedCache without a pool) on every rank: each layer's keys
(this rank's kv_heads, head_dim, dtype) size the pool (engine.backend), and a layer whose attention never asks
the cache to attend is one the engine cannot serve. There is no other engine to fall back to: a model it cannot
run is refused at start-up, naming what it would need.
"""

from __future__ import annotations

import torch

from autotp.errors import AutotpError
from autotp.serve import adapters
from autotp.serve.paged import ATTENTION, PagedCache


def implementation(model) -> str:
    """The attention implementation a paged forward sets: ours, or the one whose mask a family's forward
    cannot do without (adapters.MASKS)."""
    return adapters.mask_implementation(model) or ATTENTION


def probe(model) -> list[tuple[int, int, torch.dtype]]:
    """This rank's (kv_heads, head_dim, dtype) of every layer; raises where the model's attention does not reach
    the pool. Every rank calls it together: it is a forward."""
    adapters.install(model)
    cache, device = PagedCache(None, None, 1), model.device
    config = model.config
    previous, config._attn_implementation = config._attn_implementation, implementation(model)
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([[0]], device=device), position_ids=torch.tensor([[0]], device=device),
                  cache=cache, use_cache=True, logits_to_keep=1, paged=cache)
    except AutotpError as e:
        raise AutotpError(f"autotp serve cannot run {config.model_type}: {e}") from e
    finally:
        config._attn_implementation = previous
    if not cache.shapes or cache.attended != set(cache.shapes):
        raise AutotpError(f"autotp serve cannot run {config.model_type}: its attention neither goes through "
                          f"transformers' AttentionInterface nor has an adapter ({', '.join(adapters.SUPPORTED)})")
    return [cache.shapes[i] for i in range(len(cache.shapes))]
