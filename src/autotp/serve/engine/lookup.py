"""Prompt-lookup drafts: the tokens that followed the last time a row's newest n-gram appeared in its own prompt
and output (TGI's `--speculate`, vLLM's `ngram` method, transformers' `prompt_lookup_num_tokens`).

Code repeats itself: a completion copies an identifier, a call or a whole line already in the file. The
engine feeds a row's draft after its last token in the same forward as every other row's tokens and keeps
the drafted tokens its own sampler would have drawn anyway (output.py), so a draft can only save forwards,
never change the text. No model and no torch: one vectorized search over the row's tokens per step.
"""

from __future__ import annotations

import numpy as np

MAX_NGRAM = 3  # the longest suffix looked up first: a longer match predicts better
MIN_NGRAM = 2  # a single repeated token (a space, a bracket) predicts too little to be worth a draft


def draft(tokens: np.ndarray, k: int) -> tuple[int, ...]:
    """Up to k tokens to follow `tokens` (a row's prompt and generated ones, 1-D): after the most recent earlier
    occurrence of its last n tokens, n from MAX_NGRAM down to MIN_NGRAM; () where none occurs."""
    total = len(tokens)
    if k <= 0:
        return ()
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if total <= n:
            continue
        tail = tokens[total - n:]
        # starts i of earlier occurrences with a token after them: i + n <= total - 1
        starts = np.flatnonzero(tokens[:total - n] == tail[0])
        for j in range(1, n):
            starts = starts[tokens[starts + j] == tail[j]]
        if starts.size:
            i = int(starts[-1]) + n
            return tuple(tokens[i:i + k].tolist())
    return ()
