"""Tokens to the text a client gets: decoding, stop strings, and streamed deltas that never need taking back.

A completion's text is what its tokens add to its prompt's: decode(prompt + completion) less decode(prompt),
so that the prompt's text and the completion's join to the two decoded together (vLLM's and TGI's incremental
detokenizers, `prefix_offset`/`read_offset`). Decoded alone, a sentencepiece completion (Llama-2, CodeLlama,
Mistral: words as `▁word`, a decoder that strips one leading space) loses its first space: `x = a` and `▁+`
would give `+`, and an editor glues `a+`. Only the prompt's last CONTEXT tokens are decoded with it: what a
decoder does across a token boundary (a leading space, a character split over byte tokens, clean-up of
` n't`) reaches no further back.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT = 5  # prompt tokens decoded as a completion's left context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)


def decode(tokenizer, tokens: Sequence[int]) -> str:
    """Tokens as text, special tokens skipped (`autotp generate --json` writes a completion this way)."""
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


def added_text(tokenizer, left: Sequence[int], tokens: Sequence[int]) -> str:
    """The text `tokens` add after `left`: decode(left + tokens) less decode(left), decoding only the last
    CONTEXT tokens of `left`. Where the decoder rewrites the left text itself (no prefix: clean-up of a
    trailing space), the tokens decoded alone."""
    left = list(left[len(left) - CONTEXT:]) if len(left) > CONTEXT else list(left)
    before, after = decode(tokenizer, left), decode(tokenizer, left + list(tokens))
    return after[len(before):] if after.startswith(before) else decode(tokenizer, tokens)


def token_text(tokenizer, left: Sequence[int], token: int) -> str:
    """One token's text in a log-probability list: what it adds after `left` (so a sentencepiece `▁+` after
    `a` is ` +`, and the tokens join to the text); a special token, which the text skips, and a part of a
    character (a byte token) by their own decode."""
    text = added_text(tokenizer, left, [token]) if token not in tokenizer.all_special_ids else ""
    return text if text and "\ufffd" not in text else tokenizer.decode([token])


class TokenTexts:
    """One row's token texts as its log-probability lists show them (OpenAI's `tokens` and `top_logprobs`, TGI's
    `details`): each token's text is what it adds after the tokens before it (token_text, over a window of the last
    CONTEXT of them, the prompt's at first), so a sentencepiece `▁+` after `a` is ` +` and the texts join to the
    completion's. `text` names a token at the current position (the chosen one and its alternatives), `push`
    moves past the chosen one. The one owner of that window for every protocol."""

    def __init__(self, tokenizer, left: Sequence[int]):
        self.tokenizer, self.left = tokenizer, list(left[len(left) - CONTEXT:]) if len(left) > CONTEXT else list(left)

    def text(self, token: int) -> str:
        return token_text(self.tokenizer, self.left, token)

    def push(self, token: int) -> None:
        self.left = [*self.left[1 - CONTEXT:], token]


class Detokenizer:
    """A row's completion text, decoded incrementally (vLLM's incremental detokenizer; tokenizers'
    DecodeStream does the same): each new token decodes a window of a few tokens, not the whole completion.

    The window starts at `prefix`, a token boundary already decoded (at first the last CONTEXT tokens of the
    prompt, the completion's left context); the text the tokens from `read` on add is decode(tokens[prefix:])
    less decode(tokens[prefix:read]), so what a tokenizer does across token boundaries (a sentencepiece
    word's leading space, byte-level characters split over tokens) is decoded with its left context. A
    trailing U+FFFD (a character whose bytes are not all generated yet) waits for the next token. `text`
    equals `added_text(tokenizer, prompt, completion)` whenever nothing waits and the decoder never took back
    text it had given (tested on the served tokenizers); `final` decodes the whole completion once, the
    answer's text."""

    def __init__(self, tokenizer, prompt: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt[len(prompt) - CONTEXT:]) if len(prompt) > CONTEXT else list(prompt)
        self.start = len(self.tokens)  # the completion's first token
        self.text = ""
        self.prefix, self.read = 0, self.start

    def add(self, token: int) -> str:
        """The text so far, with this token's part unless it waits for the next one."""
        self.tokens.append(token)
        before = decode(self.tokenizer, self.tokens[self.prefix:self.read])
        after = decode(self.tokenizer, self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            # after starts with before, unless byte fallback rewrote a byte token already shown (`e` then 0xBE:
            # both become U+FFFD); the text never takes back what it showed, so it goes on from there (vLLM)
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        return self.text

    def final(self) -> str:
        return added_text(self.tokenizer, self.tokens[:self.start], self.tokens[self.start:])


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


# llama-server's two per-line rules for editors, as tools/server/server-context.cpp's process_token applies them
# after each token: `n_indent` (Row.indent) and `t_max_predict_ms` (Row.newline_deadline_s). The output processor
# ends a row where they say so (finish_reason "length", llama-server's stop_type "limit").

BLANKS = " \t"  # what llama-server counts as indentation: one column each, a tab included


def indent_cut(text: str, indent: int) -> int | None:
    """Where a completion that must stay indented at least `indent` columns ends: before the first character that
    is not a space or a tab on the first line, after the first one, that starts at a lower column (a newline
    counts as such a character: an empty line ends it too); None while every such line is indented enough or has
    only blanks so far. The first line, the rest of the cursor's line, is never judged. 0: off."""
    if indent <= 0:
        return None
    start = text.find("\n") + 1
    while start > 0:
        at = start
        while at < len(text) and text[at] in BLANKS:
            at += 1
        if at == len(text):
            return None
        if at - start < indent:
            return at
        start = text.find("\n", start) + 1
    return None


def past_deadline(token_text: str, since_first_token_s: float, deadline_s: float) -> bool:
    """Whether a row ends at this token: the token's text has a newline and more than `deadline_s` has passed since
    the row's first token (llama-server looks only at a token with a newline, and keeps it). 0: off."""
    return deadline_s > 0 and "\n" in token_text and since_first_token_s > deadline_s
