"""Paged attention for the families whose HF attention is computed inline, not through AttentionInterface.

BLOOM, Falcon and MPT compute their attention (ALiBi or rotary) inside their attention module's forward, so the
paged engine cannot reach it through transformers' interface. For each, an adapter replaces that one module's
`forward` (the instance's, never the class's, so two models in one process do not interfere): called with a
`PagedCache` it runs HF's own projections and splits, writes the new keys and values into the pool, and
attends through the cache with HF's arithmetic (scale, where the bias goes, its dtype); called with anything
else (HF's `generate`, a DynamicCache) it is HF's forward, unchanged. The bias is the one the family's own
forward computed and autotp narrowed to this rank's heads (parallel/head_inputs.py), read as a table:

- BLOOM: `alibi` (heads, 1, width), key j's bias at column j, scores = beta * bias + (q k^T) / sqrt(d);
- Falcon with alibi=True: the same table (slopes rounded through bfloat16, as HF builds it), scores =
  (q k^T + bias) / sqrt(d); plain Falcon applies its rotary embedding instead;
- MPT: `position_bias` (heads, 1, max_seq_len), relative to the row's last key, scores = (q k^T) * scale + bias.

The tables are as wide as the step's longest context because the cache says so (`PagedCache.get_mask_sizes`).
"""

from __future__ import annotations

import types

from transformers.models.bloom.modeling_bloom import dropout_add
from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

from autotp.serve.runner.attention import Alibi
from autotp.serve.runner.paged import PagedCache


def _bloom(module, hidden_states, residual, alibi, attention_mask, layer_past=None, **kwargs):
    """BloomAttention.forward on the pool. query_key_value: per-head interleaved (heads, 3, d)."""
    batch, tokens, _ = hidden_states.shape
    q, k, v = module._reshape(module.query_key_value(hidden_states))  # (1, heads, tokens, d) each
    layer_past.update(k, v, module.layer_idx)
    bias = Alibi(alibi.view(module.num_heads, -1), scale=module.beta)
    out = layer_past.attend(module.layer_idx, q, module.inv_norm_factor, alibi=bias)
    out = module.dense(out.reshape(batch, tokens, module.num_heads * module.head_dim))
    return dropout_add(out, residual, module.hidden_dropout, module.training), None


def _falcon(module, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
            position_embeddings=None, **kwargs):
    """FalconAttention.forward on the pool, its three fused layouts (plans/falcon.py) with their real KV heads."""
    fused = module.query_key_value(hidden_states)
    batch, tokens, _ = fused.shape
    if module.new_decoder_architecture:  # (kv_heads, heads / kv_heads + 2, d): K and V close each group
        qkv = fused.view(batch, tokens, -1, module.num_heads // module.num_kv_heads + 2, module.head_dim)
        q, k, v = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    else:
        q, k, v = module._split_heads(fused)  # (1, tokens, heads or 1, d)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if alibi is None:
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    layer_past.update(k, v, module.layer_idx)
    bias = None if alibi is None else Alibi(alibi.view(module.num_heads, -1), scale=module.inv_norm_factor)
    out = layer_past.attend(module.layer_idx, q, module.inv_norm_factor, alibi=bias)
    return module.dense(out.reshape(batch, tokens, module.num_heads * module.head_dim)), None


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
# MPT's forward calls `.to(torch.bool)` on the causal mask it builds: it needs an implementation that builds one
# (for our own, transformers builds none). Its (tokens, width) mask is the only cost; the adapter ignores it.
MASKS = {"MptAttention": "eager"}


def _adapted(adapter, argument: str, original):
    def forward(module, *args, **kwargs):
        if isinstance(kwargs.get(argument), PagedCache):
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
    return next((MASKS[type(m).__name__] for m in model.modules() if type(m).__name__ in MASKS), None)
