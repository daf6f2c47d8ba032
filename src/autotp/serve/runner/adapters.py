"""Paged attention for the families whose HF attention is computed inline, not through AttentionInterface.

BLOOM, Falcon and MPT compute their attention (ALiBi or rotary) inside their attention module's forward, so the
paged engine cannot reach it through transformers' interface. For each, an adapter replaces that one module's
`forward` (the instance's, never the class's, so two models in one process do not interfere): called with a
`StepCache` it runs HF's own projections and splits, writes the new keys and values into the pool, and
attends through the cache with HF's arithmetic (scale, where the bias goes, its dtype); called with anything
else (HF's `generate`, a DynamicCache) it is HF's forward, unchanged. The bias is read as a table, the one the
family's own forward computed and autotp narrowed to this rank's heads (parallel/head_inputs.py), or, where the
forward hands its layers only a mask with the bias folded in, built the way HF builds it:

- BLOOM: `alibi` (heads, 1, width), key j's bias at column j, scores = beta * bias + (q k^T) / sqrt(d);
- Falcon with alibi=True: the same table (HF's build_alibi_tensor, its slopes rounded through bfloat16) for the
  rank's heads, scores = (q k^T + bias) / sqrt(d); plain Falcon applies its rotary embedding instead (it calls
  transformers' AttentionInterface since 5.25, but without the keyword arguments that carry the step's cache);
- MPT: `position_bias` (heads, 1, max_seq_len), relative to the row's last key, scores = (q k^T) * scale + bias.

The tables are as wide as the step's longest context because the cache says so (`StepCache.get_mask_sizes`).
"""

from __future__ import annotations

import types

import torch
from transformers.models.bloom.modeling_bloom import dropout_add
from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb, build_alibi_tensor

from autotp.serve.runner.attention.step import Alibi
from autotp.serve.runner.kv_cache import StepCache


def _bloom(module, hidden_states, residual, alibi, attention_mask, layer_past=None, **kwargs):
    """BloomAttention.forward on the pool. query_key_value: per-head interleaved (heads, 3, d)."""
    batch, tokens, _ = hidden_states.shape
    q, k, v = module._reshape(module.query_key_value(hidden_states))  # (1, heads, tokens, d) each
    layer_past.update(k, v, module.layer_idx)
    bias = Alibi(alibi.view(module.num_heads, -1), scale=module.beta)
    out = layer_past.attend(module.layer_idx, q, module.inv_norm_factor, alibi=bias)
    out = module.dense(out.reshape(batch, tokens, module.num_heads * module.head_dim))
    return dropout_add(out, residual, module.hidden_dropout, module.training), None


def _falcon(module, hidden_states, attention_mask=None, position_ids=None, layer_past=None,
            position_embeddings=None, **kwargs):
    """FalconAttention.forward on the pool, its three fused layouts (plans/falcon.py) with their real KV heads."""
    fused = module.query_key_value(hidden_states)
    batch, tokens, _ = fused.shape
    heads, d = module.num_heads, module.head_dim
    if module.new_decoder_architecture:  # (kv_heads, heads / kv_heads + 2, d): K and V close each group
        qkv = fused.view(batch, tokens, -1, heads // module.num_kv_heads + 2, d)
        q, k, v = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    elif module.multi_query:  # [Q (heads * d) | K (d) | V (d)]
        q, k, v = fused.view(batch, tokens, heads + 2, d).split([heads, 1, 1], dim=2)
    else:  # (heads, 3, d): query, key and value interleaved per head
        q, k, v = fused.view(batch, tokens, heads, 3, d).unbind(3)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if not module.config.alibi:
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    layer_past.update(k, v, module.layer_idx)
    bias = _falcon_alibi(module, layer_past, hidden_states.dtype) if module.config.alibi else None
    out = layer_past.attend(module.layer_idx, q, module.inv_norm_factor, alibi=bias)
    return module.dense(out.reshape(batch, tokens, heads * d)), None


def _falcon_alibi(module, cache: StepCache, dtype: torch.dtype) -> Alibi:
    """Falcon's bias table for this rank's heads, (heads, width): HF's own build_alibi_tensor over the global head
    count (its slopes rounded through bfloat16), cut to the heads the rank holds. FalconModel folds the bias into
    the attention mask before its layers (transformers >= 5.25), a mask the paged attention does not read. Built
    once per forward, by its first layer."""
    heads = getattr(module, "autotp_heads", None)  # set where autotp sharded the model
    start = heads.q_start if heads is not None else 0
    key = ("falcon_alibi", start, module.num_heads, dtype)
    if key not in cache.per_step:
        total = module.config.num_attention_heads
        table = build_alibi_tensor(torch.ones(1, cache.width(), device=module.dense.weight.device), total, dtype)
        cache.per_step[key] = Alibi(table.view(total, -1)[start:start + module.num_heads],
                                    scale=module.inv_norm_factor)
    return cache.per_step[key]


def _mpt(module, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    """MptAttention.forward on the pool. Wqkv: [Q | K | V] blocks."""
    batch, tokens = hidden_states.shape[:2]
    mixed = module.Wqkv(hidden_states)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    q, k, v = (x.reshape(batch, tokens, module.n_heads, module.head_dim).transpose(1, 2) for x in mixed.chunk(3, 2))
    cache.update(k, v, module.layer_idx)
    bias = None if position_bias is None else Alibi(position_bias.view(module.n_heads, -1), from_end=True)
    out = cache.attend(module.layer_idx, q, module.softmax_scale, alibi=bias)
    return module.out_proj(out.reshape(batch, tokens, module.n_heads * module.head_dim)), None


# attention class -> (adapter, the name of the argument that carries the cache)
ADAPTERS = {"BloomAttention": (_bloom, "layer_past"), "FalconAttention": (_falcon, "layer_past"),
            "MptAttention": (_mpt, "cache")}
SUPPORTED = tuple(name.removesuffix("Attention") for name in ADAPTERS)
# The families whose forward needs the causal mask that transformers builds for an implementation (ours makes
# none): MPT calls `.to(torch.bool)` on it, ALiBi Falcon folds its bias into it, a (heads, tokens, width) float
# tensor per step. The adapters ignore it; building it is the cost.
MASKS = {"MptAttention": lambda module: True, "FalconAttention": lambda module: module.config.alibi}


def _adapted(adapter, argument: str, original):
    def forward(module, *args, **kwargs):
        if isinstance(kwargs.get(argument), StepCache):
            return adapter(module, *args, **kwargs)
        return original(*args, **kwargs)

    return forward


def install(model) -> None:
    """Give each attention module of an adapted family its paged forward (once; idempotent)."""
    for module in model.modules():
        spec = ADAPTERS.get(type(module).__name__)
        if spec is not None and not getattr(module, "_autotp_paged", False):
            module.forward = types.MethodType(_adapted(*spec, module.forward), module)
            module._autotp_paged = True


def mask_implementation(model) -> str | None:
    """The attention implementation a paged forward of this model must set, where ours would not do."""
    for module in model.modules():
        need = MASKS.get(type(module).__name__)
        if need is not None and need(module):
            return "eager"
    return None
