"""The plain types every part of `autotp serve` shares: a row of work, a job's result, the log.

A leaf: it imports nothing of autotp and no torch, so the torch-free API boundary (api.py) and the
torch side (batch.py, engine.py) both build on it without depending on each other.
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


@dataclass
class Result:
    """A finished row as its client gets it: the text, cut at its stop string."""

    text: str
    finish_reason: str
    completion_tokens: int
    tokens: tuple[int, ...] = ()  # the generated ids, the one that ended the row included


def log(message: str) -> None:
    print(f"autotp serve: {message}", file=sys.stderr, flush=True)
