"""The plain types every part of `autotp serve` shares: a row of work, its tokens, its result, the events the
engine sends back, and the log.

A leaf: it imports nothing of autotp and no torch, so the torch-free API (api/) and the engine (engine/) build on it
without depending on each other.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    """One prompt to complete once, as the API hands it to the engine: a request with P prompts and n choices is
    P x n rows."""

    ids: tuple[int, ...]  # prompt token ids
    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0: off
    logprobs: int | None = None  # each generated token's log-probability and this many alternatives (0-5)
    prompt_logprobs: bool = False  # also the prompt tokens' (each given the tokens before it)
    # llama-server's editor fields (api/llama_api.py); the engine honours them as engine/text.py describes
    stop_ids: tuple[int, ...] = ()  # sampling one ends the row as EOS does: a FIM layout's sentinels (fim.py)
    indent: int = 0  # n_indent: end the row before the first character of a line indented less (0: off)
    newline_deadline_s: float = 0.0  # t_max_predict_ms / 1000: end the row at a newline once this long has
    # passed since its first token (0: off)
    infill: tuple[int, ...] = ()  # llama.cpp's infill sampler in the chain: the ids that end the row, EOT first
    infill_scaled: bool = False  # temperature comes before it in the chain


def kv_slots(prompt_tokens: int, max_tokens: int) -> int:
    """The KV cache slots a row can ever fill: every token it computes, which is each prompt token and each generated
    one but the last (it ends the row and is never fed back). The one rule for what fits the cache: the API refuses a
    row that needs more than the cache holds, the scheduler reserves its blocks by it."""
    return prompt_tokens + max_tokens - 1


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


@dataclass(frozen=True)
class Result:
    """A finished row as its client gets it: the text, cut at its stop string, and what it cost."""

    text: str
    finish_reason: str  # "stop" (eos or a stop string) or "length"
    completion_tokens: int
    tokens: tuple[int, ...] = ()  # the generated ids, the one that ended the row included
    logprobs: tuple[TokenLogprob, ...] = ()  # per generated token, when the row asked for them
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # per prompt token (the first has none)
    stopped_by: str = ""  # the stop string that ended it (cut from text), if one did
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    # what it took (two results that differ only by these are the same answer)
    prompt_s: float = field(default=0.0, compare=False)  # from admission to its first token: the prompt's computation
    decode_s: float = field(default=0.0, compare=False)  # from its first token to its last


# What the engine sends back for a row, named by the client request's id and the row's place in it (`index`).


@dataclass(frozen=True)
class Token:
    """A streamed row's new token."""

    client: str
    index: int
    piece: Piece


@dataclass(frozen=True)
class Finished:
    """A row's answer."""

    client: str
    index: int
    result: Result


@dataclass(frozen=True)
class Failed:
    """A row that ended without its answer: 500 for a failed generation, 503 for the server going away."""

    client: str
    index: int
    status: int
    message: str


Event = Token | Finished | Failed


class StopFlag:
    """Set from a SIGINT/SIGTERM/SIGHUP handler (one assignment, safe there); remembers when."""

    def __init__(self):
        self.at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()

    def is_set(self) -> bool:
        return self.at is not None

    def age(self) -> float:
        return 0.0 if self.at is None else time.monotonic() - self.at


def log(message: str) -> None:
    try:
        sys.stderr.write(f"autotp serve: {message}\n")  # one write: lines from the HTTP and engine threads never merge
        sys.stderr.flush()
    except OSError:  # a terminal that hung up (EIO): the server drains and stops without its lines
        pass
