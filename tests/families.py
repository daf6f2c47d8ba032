"""Tiny random checkpoints of every family with a plan, and what each rank computes on them.

Each config is 2 layers of hidden 32-64 with vocab 101 (a prime: every vocab split is uneven). Head
counts are chosen so that tp 2, 3, 4 include an uneven head split per family and, for grouped-query
families, tp > kv_heads (KV heads replicated). Weights are drawn wide, like checkpoints.build, so greedy
output depends on every weight.
"""

from __future__ import annotations

import checkpoints
import torch
from checkpoints import widen
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

import autotp

COMMON = dict(num_hidden_layers=2, vocab_size=101, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False)
# Every config's own position limit, 64: max_position_embeddings, which GPT-2-style configs map to n_positions,
# except BLOOM's, which has none (ALiBi), and MPT's, which is max_seq_len (set below)
POSITIONS = dict(max_position_embeddings=64)
NO_MAX_POSITION_EMBEDDINGS = ("bloom", "mpt")
LLAMA_LIKE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=90)

# name -> (model_type, config overrides). The name is the family, or family_variant for a second layout.
FAMILIES = {
    "llama": ("llama", LLAMA_LIKE | dict(attention_bias=True)),  # 8 q / 2 kv: tp 3 and 4 replicate KV heads
    "mistral": ("mistral", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=90,
                                sliding_window=4)),
    "qwen2": ("qwen2", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=6, intermediate_size=90)),
    "qwen3": ("qwen3", dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                            intermediate_size=90)),  # heads*head_dim 64 != hidden 32
    "gemma": ("gemma", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                            intermediate_size=90, tie_word_embeddings=True)),  # multi-query, tied lm_head
    "gemma2": ("gemma2", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              intermediate_size=90, sliding_window=4)),  # tied, greedy output is constant
    "olmo": ("olmo", dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=5, intermediate_size=90,
                          clip_qkv=3.0)),  # 5 heads: every tp is uneven
    "starcoder2": ("starcoder2", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      intermediate_size=90, use_bias=True)),
    "phi3": ("phi3", LLAMA_LIKE),
    "gpt2": ("gpt2", dict(n_embd=48, n_head=6, n_inner=90, n_positions=64)),
    "gpt_neox": ("gpt_neox", dict(hidden_size=40, num_attention_heads=5, intermediate_size=70)),
    "gptj": ("gptj", dict(n_embd=48, n_head=6, n_inner=90, rotary_dim=4, n_positions=64)),
    "falcon_mq": ("falcon", dict(hidden_size=48, num_attention_heads=6, multi_query=True, bias=True)),
    "falcon_gqa": ("falcon", dict(hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                                  new_decoder_architecture=True)),
    "falcon_mha": ("falcon", dict(hidden_size=40, num_attention_heads=5, multi_query=False, parallel_attn=False)),
    "opt": ("opt", dict(hidden_size=48, num_attention_heads=6, ffn_dim=90, word_embed_proj_dim=48)),
    # ALiBi: head counts that are no power of 2 (the slopes' second series), uneven at tp 2, 3 and 4
    "bloom": ("bloom", dict(hidden_size=70, n_head=7, tie_word_embeddings=True)),  # tied, as BLOOM ships
    "falcon_alibi": ("falcon", dict(hidden_size=40, num_attention_heads=5, multi_query=False, parallel_attn=False,
                                    alibi=True, bias=True)),  # Falcon-RW's layout
    "mpt": ("mpt", dict(d_model=42, n_heads=7, max_seq_len=64)),
    # 8 heads in mp_num 4 blocks of 2: at tp 3 (3, 3, 2 heads) rank 0's heads span two blocks
    "codegen": ("codegen", dict(n_embd=64, n_head=8, rotary_dim=4, n_inner=90, n_positions=64)),
    # mixture of experts: 4 experts, top 2; each expert's 44 intermediate features are 11 granules of 4, split
    # 6/5, 4/4/3, 3/3/3/2 granules
    "mixtral": ("mixtral", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=44,
                                num_local_experts=4, num_experts_per_tok=2)),
    # and a shared expert (38 features) with its sigmoid gate; layer 1 of 3 is a dense MLP (90 features)
    "qwen2_moe": ("qwen2_moe", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3,
                                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=44,
                                    shared_expert_intermediate_size=38, intermediate_size=90, mlp_only_layers=[1],
                                    norm_topk_prob=True)),
    # no built-in plan: plan_for infers one from the module tree
    "granite": ("granite", LLAMA_LIKE | dict(num_key_value_heads=4)),
}
GLOBAL_SIZES = ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads", "hidden_size",
                "n_embd", "d_model")
PROMPT = [[3, 17, 42, 8, 99, 51, 23]]
NEW_TOKENS = 16


def config(name: str, **extra):
    model_type, overrides = FAMILIES[name]
    positions = {} if model_type in NO_MAX_POSITION_EMBEDDINGS else POSITIONS
    return AutoConfig.for_model(model_type, **(COMMON | positions | overrides | extra))


def build(name: str, **extra):
    """extra: config fields beyond the family's (num_hidden_layers for a deeper model, say)."""
    torch.manual_seed(0)
    return widen(AutoModelForCausalLM.from_config(config(name, **extra), dtype=torch.float32).eval())


def any_model(name: str, layers: int | None = None):
    """A test model by name: StarCoder's family as gpt_bigcode_<a checkpoints.CONFIGS name>, else a family of
    FAMILIES; layers: its decoder layers (default 2, or the family's own)."""
    if name.startswith("gpt_bigcode_"):
        return checkpoints.build(name.removeprefix("gpt_bigcode_"), **({} if layers is None else {"n_layer": layers}))
    return build(name, **({} if layers is None else {"num_hidden_layers": layers}))


# StarCoder's family (multi-query, 12 and 10 heads; multi-head) and every other family with a plan
MODELS = [f"gpt_bigcode_{name}" for name in checkpoints.CONFIGS] + list(FAMILIES)


def save(name: str, model, directory) -> None:
    """The model as `save_pretrained` writes it: transformers 5 un-fuses MoE experts into the hub's
    per-expert layout (Mixtral's block_sparse_moe.experts.E.w1/w2/w3, Qwen2-MoE's mlp.experts.E.*_proj)."""
    model.save_pretrained(directory)


def save_fused(model, directory) -> None:
    """The model's own state_dict, fused 3-D experts included, as its model.safetensors."""
    model.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{directory}/model.safetensors",
              metadata={"format": "pt"})


def reference(model) -> dict:
    from autotp.generate import generate

    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits
    return {"logits": logits, "greedy": generate(model, ids, max_new_tokens=NEW_TOKENS).tolist()}


def rank_outputs(model_dir: str) -> dict:
    """What one rank computes: its loaded tensors, the prompt's logits, the greedy continuation."""
    from autotp.generate import generate

    model = autotp.from_pretrained(model_dir)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits
    sizes = {k: v for k, v in model.config.to_dict().items() if k in GLOBAL_SIZES}
    return {"info": model.autotp, "state": {k: v.clone() for k, v in model.state_dict().items()}, "sizes": sizes,
            "logits": logits, "greedy": generate(model, ids, max_new_tokens=NEW_TOKENS).tolist()}
