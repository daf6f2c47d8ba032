"""The plain types every part of `autotp serve` shares: a row of work, its tokens, a job's result, the log.

A leaf: it imports nothing of autotp and no torch, so the torch-free API boundary (api.py) and the
torch side (engine/) both build on it without depending on each other.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One prompt's work, as rank 0's engine receives it from the API boundary."""

    ids: tuple[int, ...]  # prompt token ids
    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0: off
    logprobs: int | None = None  # each generated token's log-probability and this many alternatives (0-5)
    prompt_logprobs: bool = False  # also the prompt tokens' (each given the tokens before it)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of its scores, before any sampling
    parameter) and the most likely alternatives at that position, most likely first."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Piece:
    """One generated token as a streaming client gets it: the text it releases (held-back text comes
    with a later token; the last token releases the rest), whether it is a special token."""

    id: int
    text: str
    special: bool
    logprob: TokenLogprob | None = None


@dataclass
class Result:
    """A finished row as its client gets it: the text, cut at its stop string."""

    text: str
    finish_reason: str
    completion_tokens: int
    tokens: tuple[int, ...] = ()  # the generated ids, the one that ended the row included
    logprobs: tuple[TokenLogprob, ...] = ()  # per generated token, when the row asked for them
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # per prompt token (the first has none)
    stopped_by: str = ""  # the stop string that ended it (cut from text), if one did


def log(message: str) -> None:
    sys.stderr.write(f"autotp serve: {message}\n")  # one write: lines from the HTTP and engine threads never merge
    sys.stderr.flush()
