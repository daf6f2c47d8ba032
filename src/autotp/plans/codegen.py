"""CodeGen (Salesforce): one fused qkv_proj interleaved in mp_num = 4 blocks, each [Q | V | K] of heads/4 heads.

qkv_proj.weight (3*hidden, hidden): CodeGenAttention views its output as (..., mp_num, 3 * hidden/mp_num) and
splits each block into query, value, key (in that order). `BlockInterleavedQKV` gives a rank exactly the
rows of its heads, head after head, [q | v | k] per head, so the rank's output is q_heads blocks of one
head: the attention gets `mp_num` = its query head count and `embed_dim` = its query width (and
`num_attention_heads`, set alike); the rest of its forward infers heads from the shapes. No tp is refused
beyond the head count. mp_num is hard-coded 4 in HF's CodeGenAttention, not in the config.
"""

from autotp.parallel.styles import BlockInterleavedQKV, Colwise, Rowwise, Vocab, VocabHead
from autotp.plans.common import head_count, head_dim
from autotp.plans.plan import Plan

MP_NUM = 4  # CodeGenAttention.mp_num: the 4 model-parallel shards CodeGen was trained with


def plan(config) -> Plan:
    heads = head_count(config, "num_attention_heads")
    return Plan(
        family="codegen",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim(config, "hidden_size", "num_attention_heads"),
        layers={
            "transformer.wte": Vocab(),
            "transformer.h.*.attn.qkv_proj": BlockInterleavedQKV(blocks=MP_NUM),
            "transformer.h.*.attn.out_proj": Rowwise(split="q_heads"),
            "transformer.h.*.mlp.fc_in": Colwise(),
            "transformer.h.*.mlp.fc_out": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention="transformer.h.*.attn",
        attention_attrs={"embed_dim": "q_dim", "num_attention_heads": "q_heads", "mp_num": "q_heads"},
    )
