"""Falcon: one fused query_key_value in three layouts, chosen by the config.

new_decoder_architecture (Falcon-40B/180B): (kv_heads, heads/kv_heads + 2, d), "grouped"; a rank whose
    query heads are part of a group keeps them with the group's K and V.
multi_query (Falcon-7B): [Q (heads*d) | K (d) | V (d)], "blocks" with one KV head, replicated.
neither: per-head interleaved (heads, 3, d), "grouped" with groups of one.
FalconAttention reads `num_heads` and `num_kv_heads` (both per rank). ALiBi (alibi=True) is refused: the
model computes one bias per global head and the attention views it with the per-rank head count.
"""

from autotp.errors import AutotpError
from autotp.plans.common import head_dim
from autotp.plans.plan import Plan
from autotp.styles import Colwise, FusedQKV, Rowwise, Vocab, VocabHead


def plan(config) -> Plan:
    if config.alibi:
        raise AutotpError("Falcon with alibi=True is not supported: the ALiBi bias is built for all "
                          f"{config.num_attention_heads} heads in the model's forward, not per rank")
    heads = config.num_attention_heads
    if config.new_decoder_architecture:
        kv_heads, layout = config.num_kv_heads, "grouped"
    elif config.multi_query:
        kv_heads, layout = 1, "blocks"
    else:
        kv_heads, layout = heads, "grouped"
    return Plan(
        family="falcon",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim(config, "hidden_size", "num_attention_heads"),
        layers={
            "transformer.word_embeddings": Vocab(),
            "transformer.h.*.self_attention.query_key_value": FusedQKV(layout=layout),
            "transformer.h.*.self_attention.dense": Rowwise(split="q_heads"),
            "transformer.h.*.mlp.dense_h_to_4h": Colwise(),
            "transformer.h.*.mlp.dense_4h_to_h": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention="transformer.h.*.self_attention",
        attention_attrs={"num_heads": "q_heads", "num_kv_heads": "kv_heads"},
    )
