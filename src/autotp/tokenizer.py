"""Tokenizers for `autotp generate` and `autotp serve`: loading one, and the file-level fill-in-the-middle prompt
in the tokenizer's own FIM tokens (fim.py formats it).

No torch here (transformers is imported only when a tokenizer is loaded), so the serve API boundary can
use it. Encoding and decoding are the tokenizer's own; this module does not wrap them.
"""

from __future__ import annotations

from autotp.errors import AutotpError
from autotp.fim import FimError, fim_text

PROBE = "def hello(): return 0"  # any usable tokenizer encodes this to some tokens (an unknown-token id at worst)


def load_tokenizer(source: str, missing: str | None = None):
    """The tokenizer at `source` (a directory or hub id). Where none loads: None if `missing` is None, else
    an AutotpError whose message is `missing` with {source} and {cause} (why none loads) filled in, so each
    caller says in its own words what the user should do.

    "None loads" includes the empty tokenizer transformers 5 builds for a directory without tokenizer files
    when the config names a family whose tokenizer class can start from nothing (Qwen2, GPT-2, GPT-NeoX,
    Gemma...): its vocabulary is only its special tokens, so every prompt would encode to nothing. And it
    includes a tokenizer that encodes ordinary text to nothing: transformers 5 loads a directory's
    tokenizer.json into the class its config's family names (Qwen2Tokenizer for a qwen2 model), which
    can drop every token of a vocabulary that class does not expect."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        cause = type(e).__name__
    else:
        if len(tokenizer.get_vocab()) <= len(tokenizer.get_added_vocab()):
            cause = f"no tokenizer files: transformers built an empty {type(tokenizer).__name__}"
        elif not tokenizer(PROBE, add_special_tokens=False).input_ids:
            cause = f"transformers loaded it as a {type(tokenizer).__name__} that encodes {PROBE!r} to no tokens"
        else:
            return tokenizer
    if missing is None:
        return None
    raise AutotpError(missing.format(source=source, cause=cause))


def fim_prompt(tokenizer, prefix: str, suffix: str) -> str:
    """The prefix-suffix-middle prompt, `<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>` in StarCoder's
    tokens (in Qwen2.5-Coder's where the tokenizer has those); the model writes the middle."""
    try:
        return fim_text(tokenizer, prefix, suffix)
    except FimError as e:
        raise AutotpError(f"--suffix needs fill-in-the-middle tokens: {e}") from None
