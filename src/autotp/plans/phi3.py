"""Phi-3: fused qkv_proj [Q | K | V] with grouped-query attention, fused gate_up_proj [gate | up].

qkv_proj.weight (heads*d + 2*kv_heads*d, hidden): each rank keeps its query heads' rows and the rows of
the KV heads they use. gate_up_proj.weight (2*I, hidden) = [gate (I) | up (I)]: each rank keeps the same
piece of both halves, so the forward's `chunk(2)` pairs gate and up of the same features.
Phi3Attention reads `self.num_key_value_heads`, `num_key_value_groups`, and slices Q at
`self.config.num_attention_heads * head_dim`: its config is a per-rank copy (see Plan.attention_config).
"""

from autotp.parallel.styles import Colwise, FusedQKV, Rowwise, Vocab, VocabHead
from autotp.plans.common import llama_heads
from autotp.plans.plan import Plan


def plan(config) -> Plan:
    heads, kv_heads, head_dim = llama_heads(config)
    return Plan(
        family="phi3",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        layers={
            "model.embed_tokens": Vocab(),
            "model.layers.*.self_attn.qkv_proj": FusedQKV(layout="blocks"),
            "model.layers.*.self_attn.o_proj": Rowwise(split="q_heads"),
            "model.layers.*.mlp.gate_up_proj": Colwise(blocks=2),
            "model.layers.*.mlp.down_proj": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention="model.layers.*.self_attn",
        attention_attrs={"num_key_value_heads": "kv_heads", "num_key_value_groups": "q_per_kv"},
        attention_config={"num_attention_heads": "q_heads"},
    )
