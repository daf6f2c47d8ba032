"""Tiny random GPT-BigCode checkpoints saved as safetensors, and their unsharded reference outputs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

# name -> config. Head counts that divide every tp in 1..4 and ones that do not; vocab 101 and the MLP
# widths divide by none of 2, 3, 4 so every vocab/MLP split is uneven somewhere.
CONFIGS = {
    "mqa12": dict(n_embd=96, n_head=12, multi_query=True, n_inner=202),
    "mqa10": dict(n_embd=80, n_head=10, multi_query=True, n_inner=70),
    "mha6": dict(n_embd=96, n_head=6, multi_query=False, n_inner=130),
}
PROMPT = [[3, 17, 42, 8, 99, 51, 23]]


# fp32 logits: a row-parallel layer adds tp partial sums where the unsharded model does one matmul, and
# the lm_head gather is exact, so the only difference is rounding from reordered sums (fp32 eps 1.2e-7
# relative) through 2 layers and 4 reductions. Measured max |diff| over tp 2-4 on these models: 6.8e-6 to
# 1.3e-5 with max |logit| ~ 9; a wrong slice or a bias added tp times moves logits by O(0.1-10).
LOGIT_ATOL = 5e-5


def build(name: str, **overrides) -> GPTBigCodeForCausalLM:
    config = GPTBigCodeConfig(**{"n_layer": 2, "n_positions": 64, "vocab_size": 101, "bos_token_id": None,
                                 "eos_token_id": None, **CONFIGS[name], **overrides})
    torch.manual_seed(0)
    return widen(GPTBigCodeForCausalLM(config).eval())


def widen(model):
    """Wide random weights, in place, from torch's global generator; returns the model.

    HF's init (std 0.02, zero biases) gives near-uniform logits and degenerate greedy output; wide random
    weights and non-zero biases make tokens depend on every weight, so a wrong slice shows. Norms stay near
    1 (weight 1 + N(0, 0.1), bias N(0, 0.1)), everything else is N(0, 0.3)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln" in name:  # LayerNorm/RMSNorm: ln_1, ln_f, input_layernorm, ...
                p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    return model


def save(model, directory) -> str:
    model.save_pretrained(directory)
    return str(directory)


def saver(tmp_path_factory, make: Callable[[str], nn.Module]) -> Callable[[str], str]:
    """saver(tmp_path_factory, make)(name) -> the directory of make(name)'s checkpoint, written on first use (a
    module-scoped fixture's, so that the module's tests share each checkpoint)."""
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = save(make(name), tmp_path_factory.mktemp(name))
        return made[name]

    return get


def reference(model, new_tokens: int = 32, seed: int = 1234) -> dict:
    """Unsharded outputs: fp32 logits of PROMPT, greedy continuation, seeded sampled continuation."""
    from autotp.generate import generate

    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits
    greedy = generate(model, ids, max_new_tokens=new_tokens)
    sampled = generate(model, ids, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, seed=seed)
    nucleus = generate(model, ids, max_new_tokens=16, do_sample=True, temperature=0.7, top_p=0.9, top_k=20, seed=seed)
    beams = generate(model, ids, max_new_tokens=12, num_beams=3)
    return {"logits": logits, "greedy": greedy.tolist(), "sampled": sampled.tolist(), "nucleus": nucleus.tolist(),
            "beams": beams.tolist()}


def word_tokenizer(directory, vocab_size: int = 101) -> str:
    """A word-level tokenizer over tokens w0 .. w{vocab_size-2} plus <unk>, saved in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(directory)
    return str(directory)
