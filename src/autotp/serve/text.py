"""Tokens to the text a client gets: decoding, stop strings, and streamed deltas that never need taking back."""

from __future__ import annotations


def decode(tokenizer, tokens: list[int]) -> str:
    """The completion text as `autotp generate --json` writes it."""
    return tokenizer.decode(tokens, skip_special_tokens=True)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """text up to the earliest stop string (excluded), and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def first_stop(text: str, stop: tuple[str, ...]) -> str:
    """The stop string that occurs first in text ("" if none does): the one `cut_at_stop` cuts at."""
    hits = [(i, s) for s, i in ((s, text.find(s)) for s in stop) if i >= 0]
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
