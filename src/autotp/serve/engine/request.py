"""One prompt of one request, as rank 0 tracks it from arrival to its last token: one object with named fields.

What the client asked (its row, where its events go, whether it went away) and, once admitted, its state in the
batch (its sampler, the tokens generated so far, its text, its draft, whether it is done). The planner keeps its
blocks under the same row id (planner.Seq); every rank keeps its block table (runner/model_runner.PagedBatch).
No torch: the sampler is made by the engine at admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from autotp.serve.engine.text import Detokenizer, TextStream
from autotp.serve.types import Row, TokenLogprob


@dataclass(eq=False)  # identity: two requests with the same fields are two requests
class Request:
    """emit(event) must be thread-safe; events are ("token", index, Piece) per generated token when streaming, then
    ("done", index, Result) or ("error", index, (status, message))."""

    row: Row
    index: int  # its prompt's place in the client's request (choices, prompts)
    emit: Callable[[tuple], None]
    stream: TextStream | None = None
    request_id: str = ""  # the client request's id, for the log
    cancelled: bool = False  # set from the HTTP thread when the client goes away; read at each step
    arrived: float = field(default_factory=time.monotonic)  # when the request came in, for the metrics
    # admitted (rank 0's engine thread only)
    sampler: object = None  # sampler.RowSampler, made at admission
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # the first has none
    next: int | None = None  # the token it feeds next
    done: bool = False  # finished, failed or answered: leaves at the next step
    last: float | None = None  # when its last token came out (metrics)
    text: Detokenizer | None = None  # its text so far, where it is needed at every token (stop strings, streams)
    draft: tuple[int, ...] = ()  # the tokens it guesses follow `next` (lookup.py), fed after it this step
    prompt: object = None  # its prompt ids as a numpy array, made at its first draft

    def fail(self, status: int, message: str) -> None:
        """Answer with an error; an admitted row leaves at the next step."""
        self.done = True
        self.emit(("error", self.index, (status, message)))
