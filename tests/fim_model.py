"""A tiny random GPT-BigCode checkpoint with a byte-level BPE tokenizer that has StarCoder's FIM tokens.

Stands in for the demo model in the serve tests and benchmark, so they depend on neither its training
nor its timing. Any text tokenizes (byte-level), and the random model emits arbitrary bytes: invalid
UTF-8 in the middle of a completion is normal here, which exercises streaming's hold-back.
"""

from __future__ import annotations

from pathlib import Path

import torch
from checkpoints import widen

SPECIAL = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
CORPUS = ["def add(a, b):\n    return a + b\n", "def print_hello_world():\n    print('hello world')\n",
          "for i in range(10):\n    total += i\n", "class Point:\n    def __init__(self, x, y):\n"] * 20


# a ChatML-style template, as instruct models ship them (its markers are plain text to this tokenizer)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer(directory: Path, chat_template: str | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL[0], bos_token=SPECIAL[0],
                                   unk_token=SPECIAL[0], additional_special_tokens=SPECIAL[1:],
                                   clean_up_tokenization_spaces=False)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return fast


def build(directory: Path, n_positions: int = 128, chat_template: str | None = None) -> str:
    """Save tokenizer + random weights (vocab = the tokenizer's, eos = <|endoftext|>) into directory."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    tok = tokenizer(directory, chat_template)
    eos = tok.convert_tokens_to_ids(SPECIAL[0])
    config = GPTBigCodeConfig(n_layer=2, n_embd=64, n_head=4, multi_query=True, n_inner=150, n_positions=n_positions,
                              vocab_size=len(tok), bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    widen(GPTBigCodeForCausalLM(config).eval()).save_pretrained(directory)
    return str(directory)
