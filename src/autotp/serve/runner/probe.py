"""The paged engine's start-up capability check: does this model's attention reach the pool, and with what shapes.

A 1-token forward with a recording cache (kv_cache.StepCache without a pool) on every rank: each layer's keys
(this rank's kv_heads, head_dim, dtype) size the pool (server.backend), and a layer whose attention never asks
the cache to attend is one the engine cannot serve. There is no other engine to fall back to: a model it cannot
run is refused at start-up, naming what it would need.
"""

from __future__ import annotations

import torch

from autotp.errors import AutotpError
from autotp.parallel import stage_io
from autotp.serve.runner import adapters
from autotp.serve.runner.kv_cache import ATTENTION, StepCache


class Implementation:
    """The paged attention implementation, set around a forward (`set`, then `restore` in a finally: a plain
    method pair, which torch.compile traces where it refuses a user-defined `with`): ours, or the one whose mask
    a family's forward cannot do without (adapters.MASKS). Set on every config the model's modules read, not
    only the model's: a sharded attention may hold a per-rank copy (plans/phi3.py)."""

    def __init__(self, model):
        self.name = adapters.mask_implementation(model) or ATTENTION
        configs = [model.config] + [getattr(m, "config", None) for m in model.modules()]
        self.configs = list({id(c): c for c in configs if hasattr(c, "_attn_implementation")}.values())
        self.previous: list[str] = []

    def set(self) -> None:
        self.previous = [c._attn_implementation for c in self.configs]
        for c in self.configs:
            c._attn_implementation = self.name

    def restore(self) -> None:
        for c, name in zip(self.configs, self.previous, strict=True):
            c._attn_implementation = name


MASKS = {"full_attention", "sliding_attention"}  # causal, and causal within a window: what the backends mask


def first_layer(model) -> int:
    """The first decoder layer this rank holds: 0, or its pipeline stage's first (parallel/stage_io.py)."""
    stage = getattr(model, "autotp_stage", None)
    return 0 if stage is None else stage.span.start


def probe(model, needs: set[str] | None = None) -> list[tuple[int, int, torch.dtype]]:
    """This rank's (kv_heads, head_dim, dtype) of every layer it holds (from `first_layer` on); raises where the
    model's attention does not reach the pool. Every rank of its tensor-parallel group calls it together: it is a
    forward. `needs`, where given, gets what some layer's attention asks beyond a causal mask and a window ("ALiBi",
    "soft-capping"): what a backend may not do (its refuse_model)."""
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ()) - MASKS
    if kinds:  # chunked (Llama 4), linear or bidirectional layers: masks the paged attention does not make
        raise AutotpError(f"autotp serve cannot run {config.model_type}: its layers of type {sorted(kinds)} need "
                          f"a mask the paged attention does not make (it makes {sorted(MASKS)})")
    adapters.install(model)
    cache, device = StepCache(None, None, 1), model.device
    implementation = Implementation(model)
    implementation.set()
    try:
        with torch.inference_mode():
            stage_io.forward(model, lambda: model(
                input_ids=torch.tensor([[0]], device=device), position_ids=torch.tensor([[0]], device=device),
                cache=cache, use_cache=True, logits_to_keep=1, paged=cache))
    except AutotpError as e:
        raise AutotpError(f"autotp serve cannot run {config.model_type}: {e}") from e
    finally:
        implementation.restore()
    if needs is not None:
        needs |= cache.needs
    layers, first = sorted(set(cache.shapes) | cache.attended), first_layer(model)
    if not cache.shapes or cache.attended != set(cache.shapes) or layers != list(range(first, first + len(layers))):
        missed = sorted(set(cache.shapes) ^ cache.attended)
        raise AutotpError(f"autotp serve cannot run {config.model_type}: the attention of "
                          f"{f'layers {missed}' if missed else 'its layers'} neither goes through transformers' "
                          f"AttentionInterface nor has an adapter ({', '.join(adapters.SUPPORTED)}), or does not "
                          f"store its keys and values through the cache")
    return [cache.shapes[i] for i in layers]
