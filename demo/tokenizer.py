"""The demo model's tokenizer: StarCoder-style byte-level BPE, trained with `tokenizers`, saved in Hugging Face
format and checked to round-trip every held-out file exactly.

It does not read the corpus (data.py does) and does not train the model (train.py does).
"""

from __future__ import annotations

from pathlib import Path

from common import EOT, SPECIAL_TOKENS, log


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    # StarCoder's tokenizer.json: BPE over bytes; pre-tokenizer = digits split one by one, then the GPT-2
    # regex over the byte-level alphabet (no prefix space, so encode/decode is exactly lossless).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,  # includes the 5 special tokens and the 256 byte symbols
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,  # ids 0..4, as in StarCoder
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk> ever
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def to_hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,  # StarCoder uses <|endoftext|> for bos, eos and unk
        eos_token=EOT,
        unk_token=EOT,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,  # the cleanup would rewrite " ," etc. -> not lossless
        model_max_length=512,
    )


def save_and_check(tok, out: Path, held_docs) -> object:
    """Save the tokenizer into `out` in Hugging Face format, reload it the way users load it, and check that it
    reproduces every held-out file byte for byte.  Returns the Hugging Face tokenizer that was saved."""
    from transformers import AutoTokenizer

    hf_tok = to_hf_tokenizer(tok)
    hf_tok.save_pretrained(out)
    shipped_tok = AutoTokenizer.from_pretrained(out)
    bad = [d.name for d in held_docs if shipped_tok.decode(shipped_tok(d.text).input_ids) != d.text]
    assert not bad, f"tokenizer does not round-trip: {bad[:5]}"
    assert len(shipped_tok) == tok.get_vocab_size()
    log(f"tokenizer round-trips all {len(held_docs)} held-out files exactly")
    return hf_tok


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def token_bytes_table(tok) -> list[bytes]:
    """id -> the exact bytes the token stands for (special tokens -> b""), for exact, cheap detokenizing."""
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    table = [b""] * tok.get_vocab_size()
    for piece, idx in tok.get_vocab().items():
        if piece not in SPECIAL_TOKENS:
            table[idx] = bytes(char_to_byte[c] for c in piece)
    return table
