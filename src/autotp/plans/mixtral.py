"""Mixture-of-experts decoders with Llama's attention: mixtral, and qwen2_moe with its shared expert.

Attention is Llama's (separate q/k/v/o, grouped-query; see llama.py). The sparse MLP block is
`mlp.gate` (the router, (experts, hidden): replicated, so every rank picks the same experts for every
token) and `mlp.experts`, transformers 5's fused experts: gate_up_proj (experts, 2*I, hidden) =
[gate | up] per expert and down_proj (experts, hidden, I). Each expert's I intermediate features are split
evenly across ranks (styles.FusedExperts: every rank holds a slice of every expert) and the experts'
combined output is all-reduced once per layer. Expert parallelism (whole experts per rank) is not done:
see FusedExperts for why.

Checkpoints on the hub (and transformers 5's own `save_pretrained`) store the experts un-fused, one tensor
per expert: Mixtral's `block_sparse_moe.experts.E.w1` (gate, (I, hidden)), `.w3` (up) and `.w2` (down,
(hidden, I)), with the router at `block_sparse_moe.gate`; Qwen2-MoE's `mlp.experts.E.gate_proj`, `up_proj`
and `down_proj`. `fused_sources` says how they form the fused parameters (transformers' conversion_mapping
facts, restated), so each rank reads its rows of every gate and up and its columns of every down; a
checkpoint holding the fused tensors loads too.

Qwen2-MoE adds `mlp.shared_expert`, a dense gated MLP (column-, then row-parallel: its down_proj
all-reduces), scaled by `sigmoid(mlp.shared_expert_gate(x))`, a replicated (1, hidden) linear on the full
hidden state. The block returns experts + gate * shared: both terms are complete sums on every rank, so
nothing is summed twice and there are no biases to add once. Layers listed in `mlp_only_layers`, or off
the `decoder_sparse_step`, have a dense MLP at `mlp.{gate,up,down}_proj`.
"""

from autotp.parallel.styles import Colwise, FusedExperts, Rowwise
from autotp.plans.llama import GATED, decoder_plan
from autotp.plans.plan import FusedSource, Plan

FAMILIES = ("mixtral", "qwen2_moe")


def _has_dense_layers(config) -> bool:
    """Qwen2-MoE: whether any decoder layer has a dense MLP instead of experts (its own rule, restated)."""
    if config.model_type != "qwen2_moe":
        return False
    step, only = config.decoder_sparse_step, set(config.mlp_only_layers or ())
    return any(i in only or config.num_experts == 0 or (i + 1) % step for i in range(config.num_hidden_layers))


def _per_expert(config) -> tuple[dict[str, FusedSource], dict[str, str]]:
    """The hub's per-expert names: fused sources, and the router's old name (Mixtral only)."""
    if config.model_type == "mixtral":
        moe = "model.layers.*.block_sparse_moe.experts.{expert}"
        gate_up, down = (f"{moe}.w1.weight", f"{moe}.w3.weight"), (f"{moe}.w2.weight",)
        router = {f"model.layers.{i}.mlp.gate.weight": f"model.layers.{i}.block_sparse_moe.gate.weight"
                  for i in range(config.num_hidden_layers)}
    else:
        moe = "model.layers.*.mlp.experts.{expert}"
        gate_up, down = (f"{moe}.gate_proj.weight", f"{moe}.up_proj.weight"), (f"{moe}.down_proj.weight",)
        router = {}
    sources = {"model.layers.*.mlp.experts.gate_up_proj": FusedSource(gate_up),
               "model.layers.*.mlp.experts.down_proj": FusedSource(down)}
    return sources, router


def plan(config) -> Plan:
    mlp = {"mlp.experts": FusedExperts()}
    if config.model_type == "qwen2_moe":
        mlp |= {"mlp.shared_expert.gate_proj": Colwise(), "mlp.shared_expert.up_proj": Colwise(),
                "mlp.shared_expert.down_proj": Rowwise()}
    if _has_dense_layers(config):
        mlp |= GATED
    sources, router = _per_expert(config)
    return decoder_plan(config, mlp, checkpoint_names=router, fused_sources=sources)
