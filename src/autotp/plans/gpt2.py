"""GPT-2: Conv1D layers, whose weights are stored (in, out), and a fused c_attn = [Q | K | V].

c_attn.weight (n_embd, 3*n_embd): output columns [Q | K | V] of n_embd each (blocks layout with
kv_heads == heads); each rank keeps its heads' columns of all three. c_proj (attention and MLP) is
row-parallel: rows of its (in, out) weight. GPT2Attention splits c_attn's output by `split_size` and
reads `num_heads`/`embed_dim` nowhere else in the forward; all three are set per rank.
"""

from autotp.errors import AutotpError
from autotp.parallel.styles import Colwise, FusedQKV, Rowwise, Vocab, VocabHead
from autotp.plans.common import head_dim
from autotp.plans.plan import Plan


def plan(config) -> Plan:
    if config.add_cross_attention:
        raise AutotpError("GPT-2 with add_cross_attention=True is not supported (no causal LM uses it)")
    heads = config.n_head
    return Plan(
        family="gpt2",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim(config, "n_embd", "n_head"),
        layers={
            "transformer.wte": Vocab(),
            "transformer.h.*.attn.c_attn": FusedQKV(layout="blocks"),
            "transformer.h.*.attn.c_proj": Rowwise(split="q_heads"),
            "transformer.h.*.mlp.c_fc": Colwise(),
            "transformer.h.*.mlp.c_proj": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention="transformer.h.*.attn",
        attention_attrs={"embed_dim": "q_dim", "split_size": "q_dim", "num_heads": "q_heads"},
    )
