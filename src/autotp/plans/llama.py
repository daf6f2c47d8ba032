"""Llama-layout decoders: separate q/k/v/o projections under `model.layers.*.self_attn`, grouped-query attention.

One plan for every family whose HF attention is Llama's: q_proj (heads*d, hidden), k_proj and v_proj
(kv_heads*d, hidden), o_proj (hidden, heads*d). The forward views projections as (-1, head_dim) and
repeats K/V `num_key_value_groups` times, the only per-rank number it reads. Each rank keeps its query
heads and the KV heads they use (KV heads replicated when kv_heads < tp). The families differ only in
the MLP, listed per family below: gated gate_proj/up_proj -> down_proj, or StarCoder2's c_fc -> c_proj.
"""

from autotp.parallel.styles import Colwise, Rowwise, Style, Vocab, VocabHead
from autotp.plans.common import llama_heads, separate_qkvo
from autotp.plans.plan import Plan

GATED = {"mlp.gate_proj": Colwise(), "mlp.up_proj": Colwise(), "mlp.down_proj": Rowwise()}
FC = {"mlp.c_fc": Colwise(), "mlp.c_proj": Rowwise()}

FAMILIES = {
    "llama": GATED,
    "mistral": GATED,
    "qwen2": GATED,
    "qwen3": GATED,  # q_norm/k_norm act on head_dim, within a head: replicated
    "gemma": GATED,
    "gemma2": GATED,  # logit soft-capping acts on the gathered logits
    "olmo": GATED,  # clip_qkv clamps elementwise
    "starcoder2": FC,
}

def plan(config) -> Plan:
    return decoder_plan(config, FAMILIES[config.model_type])


def decoder_plan(config, mlp: dict[str, Style], **fields) -> Plan:
    """The plan of a Llama-layout decoder whose per-layer MLP modules (paths under the layer) get `mlp`'s
    styles; `fields` are further Plan fields (the MoE families' checkpoint names and fused sources)."""
    heads, kv_heads, head_dim = llama_heads(config)
    layer = separate_qkvo("self_attn") | mlp
    return Plan(
        family=config.model_type,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        layers={"model.embed_tokens": Vocab()} | {f"model.layers.*.{k}": s for k, s in layer.items()}
        | {"lm_head": VocabHead()},
        attention="model.layers.*.self_attn",
        attention_attrs={"num_key_value_groups": "q_per_kv"},
        **fields,
    )
