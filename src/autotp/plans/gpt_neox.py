"""GPT-NeoX (Pythia): multi-head attention whose forward infers the head count from the shapes.

query_key_value.weight (3*hidden, hidden) is per-head interleaved, (heads, 3, d); the forward views it as
(-1, 3*head_size) and chunks, so no per-rank attribute is needed.
"""

from autotp.parallel.styles import Colwise, FusedQKV, Rowwise, Vocab, VocabHead
from autotp.plans.common import head_dim
from autotp.plans.plan import Plan


def plan(config) -> Plan:
    heads = config.num_attention_heads
    return Plan(
        family="gpt_neox",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim(config, "hidden_size", "num_attention_heads"),
        layers={
            "gpt_neox.embed_in": Vocab(),
            "gpt_neox.layers.*.attention.query_key_value": FusedQKV(layout="grouped"),
            "gpt_neox.layers.*.attention.dense": Rowwise(split="q_heads"),
            "gpt_neox.layers.*.mlp.dense_h_to_4h": Colwise(),
            "gpt_neox.layers.*.mlp.dense_4h_to_h": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention="gpt_neox.layers.*.attention",
        checkpoint_names={"lm_head.weight": "embed_out.weight"},
    )
