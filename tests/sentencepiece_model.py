"""Sentencepiece-style tokenizers as Llama-2 / CodeLlama and Mistral ship them, and a tiny random model on one.

Llama-2's layout: a normalizer that prepends `▁` and writes spaces as `▁`, BPE with `<0xNN>` byte fallback,
`<s>` before every prompt, and a decoder that replaces `▁` by a space, fuses byte tokens and strips **one
leading space** (`Strip(" ", 1, 0)`). Mistral's newer layout does the same with a Metaspace pre-tokenizer
and decoder (`prepend_scheme="first"`). That stripped space is why a completion decoded without its prompt
loses its first space: `x = a` then `▁+` decodes as `+` alone, ` +` after the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from checkpoints import widen

TEXT = ["déjà vu — naïve café ☕ über straße 日本語のテキスト 🙂 emoji",
        "def add(a, b):\n    return a + b  # ünïcode\n", "  leading spaces and\ttabs\n\nnew lines",
        "for i in range(10):\n    total += i", "x = a + b - c\ny = a - b + c\n"] * 10
PROMPT = "x = a"  # the model below continues it with `▁+` first
FIRST = "▁+"


def tokenizer(directory, layout: str = "llama"):
    """layout: "llama" (Llama-2, CodeLlama: normalizer + Strip decoder) or "mistral" (Metaspace both ways)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if layout == "llama":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                     prepend_scheme="first")])
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"]))
    # the 256 byte tokens belong to the model's vocabulary, as in Llama's (added tokens would skip the decoder)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(directory)
    return fast


def build(directory: Path, chat_template: str | None = None) -> str:
    """Tokenizer (Llama's layout) + random GPT-BigCode weights whose greedy first token after PROMPT is `▁+`:
    the random model's own first token and `▁+` swap their (tied) vocabulary rows, which changes no input
    the prompt reads, so the model's scores at that position are its own with two entries swapped."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    tok = tokenizer(directory)
    if chat_template is not None:
        tok.chat_template = chat_template
        tok.save_pretrained(directory)
    config = GPTBigCodeConfig(n_layer=2, n_embd=64, n_head=4, multi_query=True, n_inner=150, n_positions=128,
                              vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = widen(GPTBigCodeForCausalLM(config).eval())
    ids = tok(PROMPT).input_ids
    first, wanted = model(torch.tensor([ids])).logits[0, -1].argmax().item(), tok.convert_tokens_to_ids(FIRST)
    assert first not in ids and wanted not in ids, (ids, first, wanted)
    with torch.no_grad():
        wte = model.transformer.wte.weight
        wte[[first, wanted]] = wte[[wanted, first]]
    model.save_pretrained(directory)
    return str(directory)
