"""The server's incremental detokenizer against the tokenizer's own full decode, token by token.

Tokenizers of the kinds served: byte-level BPE (StarCoder's and the demo model's, SmolLM2's and GPT-2's
kind, with FIM special tokens), a word-level one that joins words with spaces, and a Llama-style
sentencepiece BPE with byte fallback (its decoder strips the first word's leading space and fuses byte
tokens into characters). Sequences are random ids, so characters split over tokens, special tokens and
invalid UTF-8 all occur. Whenever the full decode has no character still waiting for its bytes, the
incremental text equals it exactly.
"""

from __future__ import annotations

import random

import fim_model
import pytest
from checkpoints import word_tokenizer
from transformers import AutoTokenizer

from autotp.serve.engine.text import Detokenizer, decode

TEXT = ["déjà vu — naïve café ☕ über straße 日本語のテキスト 🙂 emoji",
        "def add(a, b):\n    return a + b  # ünïcode\n", "  leading spaces and\ttabs\n\nnew lines",
        "for i in range(10):\n    total += i"] * 10


def sentencepiece_like(directory) -> str:
    """Llama's layout: Metaspace words, BPE with <0xNN> byte fallback, a decoder that replaces '▁' by ' ', fuses
    byte tokens and strips one leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=600, special_tokens=specials[:3]))
    tok.add_tokens([t for t in specials[3:]])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            clean_up_tokenization_spaces=False).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=["demo", "fim", "words", "sentencepiece"])
def tokenizer(request, tmp_path_factory):
    from autotp.cli import default_model

    made = tmp_path_factory.mktemp(request.param)
    path = {"demo": lambda: default_model(), "fim": lambda: (fim_model.tokenizer(made), str(made))[1],
            "words": lambda: word_tokenizer(made), "sentencepiece": lambda: sentencepiece_like(made)}[request.param]()
    return AutoTokenizer.from_pretrained(path)


def test_the_incremental_text_is_the_full_decode_whenever_nothing_waits(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(150)]
    sequences += [tokenizer(t).input_ids for t in TEXT[:4]]  # real text, split where its tokenizer splits it
    checked = 0
    for ids in sequences:
        detok = Detokenizer(tokenizer)
        for i, token in enumerate(ids):
            text = detok.add(token)
            full = decode(tokenizer, ids[:i + 1])
            if not full.endswith("\ufffd"):
                assert text == full, (ids[:i + 1], text, full)
                checked += 1
            else:
                assert full.startswith(text)
        assert detok.final() == decode(tokenizer, ids)
    assert checked > 1000
