"""MPT: multi-head attention with ALiBi, one fused Wqkv [Q | K | V] ("blocks", as many KV heads as query heads).

MptAttention reads `n_heads` (per rank). MptModel keeps the global head count: it builds the ALiBi bias for
all heads, (heads, 1, max_seq_len), and passes it as `position_bias`; the slopes depend on the global count,
so `position_bias` is named in `head_inputs` and each rank's attention receives the rows of its heads.
"""

from autotp.parallel.styles import Colwise, FusedQKV, Rowwise, Vocab, VocabHead
from autotp.plans.common import head_count, head_dim
from autotp.plans.plan import Plan


def plan(config) -> Plan:
    heads = head_count(config, "num_attention_heads")
    return Plan(
        family="mpt",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim(config, "hidden_size", "num_attention_heads"),
        layers={
            "transformer.wte": Vocab(),
            "transformer.blocks.*.attn.Wqkv": FusedQKV(layout="blocks"),
            "transformer.blocks.*.attn.out_proj": Rowwise(split="q_heads"),
            "transformer.blocks.*.ffn.up_proj": Colwise(),
            "transformer.blocks.*.ffn.down_proj": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention="transformer.blocks.*.attn",
        attention_attrs={"n_heads": "q_heads"},
        head_inputs=("position_bias",),
    )
