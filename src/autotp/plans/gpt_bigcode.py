"""GPT-BigCode (StarCoder, SantaCoder, starcoderbase-*): both attention layouts of HF's implementation.

multi_query=True  (StarCoder): c_attn.weight (n_embd + 2*head_dim, n_embd) = [Q | K | V] with one shared
                  K/V head; each rank keeps its whole query heads plus K and V, replicated.
multi_query=False: c_attn.weight (3*n_embd, n_embd) laid out per head as (n_head, 3, head_dim); each rank
                  keeps its heads' q, k and v rows.
attn.c_proj and mlp.c_proj are row-parallel (one all-reduce each, bias added once); mlp.c_fc is
column-parallel; wte/lm_head (tied) are vocab-parallel; wpe and the layer norms are replicated.
"""

from autotp.errors import AutotpError
from autotp.parallel.styles import Colwise, FusedQKV, Rowwise, Vocab, VocabHead
from autotp.plans.common import head_dim
from autotp.plans.plan import Plan


def plan(config) -> Plan:
    if config.add_cross_attention:
        raise AutotpError("GPT-BigCode with add_cross_attention=True is not supported (no causal LM uses it)")
    kv_heads = 1 if config.multi_query else config.n_head
    return Plan(
        family="gpt_bigcode",
        num_heads=config.n_head,
        num_kv_heads=kv_heads,
        head_dim=head_dim(config, "n_embd", "n_head"),
        layers={
            "transformer.wte": Vocab(),
            "transformer.h.*.attn.c_attn": FusedQKV(layout="blocks" if config.multi_query else "grouped"),
            "transformer.h.*.attn.c_proj": Rowwise(split="q_heads"),
            "transformer.h.*.mlp.c_fc": Colwise(),
            "transformer.h.*.mlp.c_proj": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention="transformer.h.*.attn",
        # GPTBigCodeAttention.forward splits c_attn's output by (embed_dim, kv_dim, kv_dim) (multi-query)
        # or views it as (num_heads, 3 * head_dim); attention repeats K/V num_key_value_groups times.
        attention_attrs={
            "embed_dim": "q_dim",
            "split_size": "q_dim",
            "num_heads": "q_heads",
            "kv_heads": "kv_heads",
            "kv_dim": "kv_dim",
            "num_key_value_groups": "q_per_kv",
        },
        # An (n_positions, n_positions) bool causal mask (64 MiB for StarCoder) that transformers 5 still
        # builds but no longer reads: masks come from create_causal_mask. The parity tests would catch a
        # version that reads it again.
        unused_buffers=("transformer.bias",),
    )
