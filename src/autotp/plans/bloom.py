"""BLOOM: multi-head attention with ALiBi, one fused query_key_value per-head interleaved, (heads, 3, d).

query_key_value is "grouped" with groups of one query head. BloomAttention reads `num_heads` and
`hidden_size` (both per rank; `split_size` is set alike for consistency). BloomModel keeps the global head
count: it builds the ALiBi bias for all heads, (batch * heads, 1, k), from it, and the slopes depend on the
global count and each head's index, so no per-rank attribute can give a rank its own slopes; `alibi` is
named in `head_inputs` and each rank's attention receives the global bias at its heads only.
pretraining_tp > 1 with slow_but_exact=True is refused: that path multiplies dense's weight in slices itself,
bypassing the row-parallel layer.
"""

from autotp.errors import AutotpError
from autotp.parallel.styles import Colwise, FusedQKV, Rowwise, Vocab, VocabHead
from autotp.plans.common import head_count, head_dim
from autotp.plans.plan import Plan


def plan(config) -> Plan:
    if config.pretraining_tp > 1 and config.slow_but_exact:
        raise AutotpError(f"BLOOM with slow_but_exact=True and pretraining_tp={config.pretraining_tp} is not "
                          "supported: that path slices the output projections' weights itself; "
                          "set slow_but_exact=False")
    heads = head_count(config, "num_attention_heads")
    return Plan(
        family="bloom",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim(config, "hidden_size", "num_attention_heads"),
        layers={
            "transformer.word_embeddings": Vocab(),
            "transformer.h.*.self_attention.query_key_value": FusedQKV(layout="grouped"),
            "transformer.h.*.self_attention.dense": Rowwise(split="q_heads"),
            "transformer.h.*.mlp.dense_h_to_4h": Colwise(),
            "transformer.h.*.mlp.dense_4h_to_h": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention="transformer.h.*.self_attention",
        attention_attrs={"num_heads": "q_heads", "hidden_size": "q_dim", "split_size": "q_dim"},
        head_inputs=("alibi",),
    )
