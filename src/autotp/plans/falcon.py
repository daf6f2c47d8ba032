"""Falcon: one fused query_key_value in three layouts, chosen by the config.

new_decoder_architecture (Falcon-40B/180B): (kv_heads, heads/kv_heads + 2, d), "grouped"; a rank whose
    query heads are part of a group keeps them with the group's K and V.
multi_query (Falcon-7B): [Q (heads*d) | K (d) | V (d)], "blocks" with one KV head, replicated.
neither: per-head interleaved (heads, 3, d), "grouped" with groups of one.
FalconAttention reads `num_heads`, `num_kv_heads` and `num_key_value_groups` (all per rank). With alibi=True
FalconModel keeps the global head count: it builds the bias for all heads and folds it into the causal mask,
(batch, heads, q, k) (transformers >= 5.25); the slopes depend on the global count, so `attention_mask` is
named in `head_inputs` and each rank's attention receives its heads' rows (a mask without heads, size 1 at
dim -3, passes as is).
"""

from autotp.parallel.styles import Colwise, FusedQKV, Rowwise, Vocab, VocabHead
from autotp.plans.common import head_dim
from autotp.plans.plan import Plan


def plan(config) -> Plan:
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
        attention_attrs={"num_heads": "q_heads", "num_kv_heads": "kv_heads", "num_key_value_groups": "q_per_kv"},
        head_inputs=("attention_mask",) if config.alibi else (),
    )
