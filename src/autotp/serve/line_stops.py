"""The two per-line stopping rules llama-server applies for editors, as functions of a row's text: `n_indent`
(Row.indent) and `t_max_predict_ms` (Row.newline_deadline_s), as tools/server/server-context.cpp's process_token
applies them after each token.

The engine ends a row that sets them after the token where they say so (finish_reason "length", llama-server's
stop_type "limit"): `indent_cut` on the row's text so far, cutting the text where it answers; `past_deadline` on
the token's text. The llama answers (api/llama_api.py) apply `indent_cut` to a finished text too, which changes
nothing where the engine already cut. A leaf: no torch, nothing of autotp.
"""

from __future__ import annotations

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
