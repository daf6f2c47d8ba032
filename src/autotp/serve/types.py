"""The plain types every part of `autotp serve` shares: a row of work, its outcome, a job's result, the log.

A leaf: it imports nothing of autotp and no torch, so the torch-free API boundary (api.py) and the
torch side (batch.py, engine.py) both build on it without depending on each other.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One prompt's work, as every rank receives it."""

    ids: tuple[int, ...]  # prompt token ids
    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()


@dataclass
class Outcome:
    """What one rank's batch made of a row (tokens, not yet text)."""

    tokens: list[int]  # generated ids, up to and including the one that ended the row
    finish_reason: str  # "stop" (eos or a stop string), "length", "cancelled" or "error"
    error: str = ""  # why, for "error"


@dataclass
class Result:
    """A finished row as its client gets it: the text, cut at its stop string."""

    text: str
    finish_reason: str
    completion_tokens: int


def log(message: str) -> None:
    print(f"autotp serve: {message}", file=sys.stderr, flush=True)
