"""Tokens to the text a client gets: decoding, stop strings, and streamed deltas that never need taking back."""

from __future__ import annotations


def decode(tokenizer, tokens: list[int]) -> str:
    """The completion text as `autotp generate --json` writes it."""
    return tokenizer.decode(tokens, skip_special_tokens=True)


class Detokenizer:
    """A row's completion text, decoded incrementally (vLLM's incremental detokenizer; tokenizers'
    DecodeStream does the same): each new token decodes a window of a few tokens, not the whole completion.

    The window starts at `prefix`, a token boundary already decoded; the text the tokens from `read` on add
    is decode(tokens[prefix:]) less decode(tokens[prefix:read]), so what a tokenizer does across token
    boundaries (a sentencepiece word's leading space, byte-level characters split over tokens) is decoded
    with its left context. A trailing U+FFFD (a character whose bytes are not all generated yet) waits for
    the next token. `text` equals `decode(tokenizer, tokens)` whenever nothing waits (tested on the
    served tokenizers); `final` decodes the whole completion once, the answer's text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.prefix = self.read = 0

    def add(self, token: int) -> str:
        """The text so far, with this token's part unless it waits for the next one."""
        self.tokens.append(token)
        before = decode(self.tokenizer, self.tokens[self.prefix:self.read])
        after = decode(self.tokenizer, self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        return self.text

    def final(self) -> str:
        return decode(self.tokenizer, self.tokens)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """text up to the earliest stop string (excluded), and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def first_stop(text: str, stop: tuple[str, ...], start: int = 0) -> str:
    """The stop string that occurs first in text ("" if none does): the one `cut_at_stop` cuts at. start:
    none occurs within text[:start] (checked before), so only a stop that ends past it is looked for."""
    hits = [(i, s) for s, i in ((s, text.find(s, max(0, start - len(s) + 1))) for s in stop) if i >= 0]
    return min(hits)[1] if hits else ""


class TextStream:
    """Streamed text of one row: deltas that never need taking back.

    Held back: trailing U+FFFD (a multi-byte character whose bytes are not all generated yet) and the
    last len(longest stop) - 1 characters (they may begin a stop string, which is never sent)."""

    def __init__(self, stop: tuple[str, ...]):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def delta(self, text: str, final: bool = False) -> str:
        if not final:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - self.hold]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
