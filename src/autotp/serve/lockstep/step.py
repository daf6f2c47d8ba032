"""The messages between rank 0's engine and every rank's model runner: the `Step` the scheduler hands out, and the
`StepResult` the runner hands back, both by request id.

A step says everything a rank needs to run it: the requests that are new (with what their sampling needs), each
request's work (the tokens it computes, from which position, in which blocks), and the requests that ended since the
last step, whose blocks the runners forget. A result says, for each request that sampled, the tokens its sampler drew
(one, or for a verified draft up to 1 + the draft) and their log-probabilities; the engine's output processor turns
them into text and answers. No torch: tokens and ids only, pickled onto the wire (wire.py) every step.

`NewRequest` and `Work` are named tuples: constructed by keyword and read by name like any record, but pickled as
tuples, so their field names cost no bytes on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from autotp.sampling.rules import SamplingParams
from autotp.serve.types import TokenLogprob


class NewRequest(NamedTuple):
    """A request the runners meet for the first time. prompt: its ids, only where it asked for its prompt's
    log-probabilities (each prompt token is a target of the position before it)."""

    id: int
    sampling: SamplingParams
    logprobs: int | None = None  # the top alternatives of each generated token (None: no log-probabilities)
    prompt: tuple[int, ...] = ()


class Work(NamedTuple):
    """One request's part of a step (runner/model_runner.py)."""

    id: int  # the engine's request id, unique for the server's lifetime
    tokens: tuple[int, ...]  # the token ids it computes, in order
    start: int  # the position of the first of them
    blocks: tuple[int, ...]  # block ids appended to its table before the step
    sample: bool  # its last token gives its next one
    every: bool  # every position's scores are kept (prompt log-probabilities, a draft's verification)
    draft: int = 0  # its last `draft` tokens are a speculative draft (engine/lookup.py), not yet the request's
    copy: tuple[int, ...] = ()  # (source, destination, m): copy a block's first m keys and values before the step


@dataclass(frozen=True)
class Step:
    """What every rank does next: the requests in `finished` leave, the `new` ones arrive, then each entry of `work`
    computes its tokens, all in one forward."""

    new: tuple[NewRequest, ...] = ()
    work: tuple[Work, ...] = ()  # in forward order
    finished: tuple[int, ...] = ()  # requests that ended since the last step (their blocks are the scheduler's again)
    error: str = ""  # how the previous step failed on rank 0 ("" if it did not): every rank must agree (executor.py)
    stop: bool = False  # every rank returns

    @property
    def runs(self) -> bool:
        """Whether the step runs a forward."""
        return bool(self.work)


class Sampled(NamedTuple):
    """What a request's sampler made of its scores in one step."""

    id: int
    tokens: tuple[int, ...]  # drawn in order: one, or a draft's verification (the drafted tokens drawn, then one more)
    logprobs: tuple[TokenLogprob, ...] = ()  # per token drawn, where the request asked for them
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # its prompt positions scored in this step, in order
    error: str = ""  # the scores could not be sampled (sampler.SampleError): the request fails


@dataclass
class StepResult:
    """A step's outcome on the rank that samples: each sampling (or prompt-scored) request's `Sampled`, by id; or the
    forward's failure, the same on every rank (`error`), which fails the step's requests."""

    sampled: dict[int, Sampled] = field(default_factory=dict)
    error: str = ""


class LockstepLost(RuntimeError):
    """The ranks can no longer run in lockstep (a rank died, a collective failed, a forward failed on some ranks
    only): the message is the one line that says so."""
