"""OPT: separate q/k/v_proj and out_proj, fc1 -> fc2, learned positions (replicated).

OPTAttention views its projections with `self.num_heads` (per rank). project_in/project_out (when
word_embed_proj_dim != hidden_size) are small and replicated; lm_head is tied to embed_tokens.
"""

from autotp.parallel.styles import Colwise, Rowwise, Vocab, VocabHead
from autotp.plans.common import head_dim, separate_qkvo
from autotp.plans.plan import Plan


def plan(config) -> Plan:
    heads = config.num_attention_heads
    layer = "model.decoder.layers.*"
    return Plan(
        family="opt",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim(config, "hidden_size", "num_attention_heads"),
        layers={
            "model.decoder.embed_tokens": Vocab(),
            **separate_qkvo(f"{layer}.self_attn", o="out_proj"),
            f"{layer}.fc1": Colwise(),
            f"{layer}.fc2": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention=f"{layer}.self_attn",
        attention_attrs={"num_heads": "q_heads"},
    )
