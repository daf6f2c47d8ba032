"""One row of a client's request, as rank 0's engine tracks it from arrival to its last token: one object with named
fields and a status, which the scheduler, the output processor and the loop each read and write their own part of.

- what the client asked: its row (prompt, sampling parameters, stops), whether it streams, who to answer (`client`,
  the HTTP request's id, and `index`, the row's place in it);
- the scheduler's (scheduler.py): its blocks in the KV cache, how many of its tokens have keys and values there,
  the blocks it may still take, whether a step of it is in flight, its draft;
- the output processor's (output.py): the tokens generated, their log-probabilities, its text, its timings.

No torch: the runner knows a request by its id alone (lockstep/step.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from autotp.serve.engine.blocks import Key
from autotp.serve.engine.text import Detokenizer, TextStream
from autotp.serve.types import Row, TokenLogprob


class Status(Enum):
    WAITING = "waiting"  # queued, holding nothing
    RUNNING = "running"  # admitted: holds blocks, computes in steps
    STOPPED = "stop"  # finished by an eos token or a stop string
    LENGTH = "length"  # finished by its max_tokens
    ABORTED = "aborted"  # its client went away: nobody is answered
    FAILED = "failed"  # answered with an error

    @property
    def finished(self) -> bool:
        return self not in (Status.WAITING, Status.RUNNING)


@dataclass(eq=False)  # identity: two requests with the same fields are two requests
class Request:
    id: int  # the engine's, unique for the server's lifetime: what the runners know it by
    client: str  # the HTTP request's id (its answers are routed by it, its log line names it)
    index: int  # its place in the client's request (choices, prompts)
    row: Row
    stream: bool = False
    arrived: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    # the scheduler's
    blocks: list[int] = field(default_factory=list)  # its block table
    keys: list[Key] = field(default_factory=list)  # the cache keys of its first len(keys) blocks, full and cached
    computed: int = 0  # its first `computed` tokens have keys and values in its blocks
    scheduled: int = 0  # its first `scheduled` tokens were handed out in steps (computed, or in flight)
    reserved: int = 0  # blocks it may still take (its whole life's were reserved at admission)
    cached: int = 0  # prompt tokens it found in the prefix cache at admission
    in_flight: int = 0  # steps that compute its tokens handed out and not yet come back (several: prompt chunks)
    lane: int = 0  # the lane whose steps compute it (a pipeline keeps one step of each lane in flight)
    draft: tuple[int, ...] = ()  # the tokens it guesses follow its last one (lookup.py), fed after it this step
    history: object = None  # its prompt as a numpy array, made at its first draft (lookup.py searches it)
    # the output processor's
    output: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # the first has none
    text: Detokenizer | None = None  # its text so far, where it is needed at every token (stop strings, streams)
    streamed: TextStream | None = None  # what its stream has sent
    admitted: float | None = None  # when it took its first blocks
    first_token: float | None = None
    last_token: float | None = None

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.row.ids

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        return len(self.row.ids) + len(self.output)

    @property
    def no_cache(self) -> bool:
        """Its prompt's every position is scored (prompt log-probabilities): nothing of it comes from the cache."""
        return self.row.prompt_logprobs

    def span(self, a: int, b: int) -> tuple[int, ...]:
        """Tokens a .. b - 1 of prompt + generated, without building the whole sequence (a long prompt, every step)."""
        p = len(self.row.ids)
        return tuple(self.row.ids[a:b]) + tuple(self.output[max(0, a - p):max(0, b - p)])
