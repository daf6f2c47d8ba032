"""GPT-J: separate q/k/v_proj and out_proj, viewed with -1 heads (no per-rank attribute needed); fc_in ->
fc_out; its lm_head has a bias, split with the vocabulary rows."""

from autotp.parallel.styles import Colwise, Rowwise, Vocab, VocabHead
from autotp.plans.common import head_dim, separate_qkvo
from autotp.plans.plan import Plan


def plan(config) -> Plan:
    heads = config.n_head
    return Plan(
        family="gptj",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim(config, "n_embd", "n_head"),
        layers={
            "transformer.wte": Vocab(),
            **separate_qkvo("transformer.h.*.attn", o="out_proj"),
            "transformer.h.*.mlp.fc_in": Colwise(),
            "transformer.h.*.mlp.fc_out": Rowwise(),
            "lm_head": VocabHead(),
        },
        attention="transformer.h.*.attn",
    )
