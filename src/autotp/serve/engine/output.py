"""The output processor: what a step's tokens become for their rows. The one place a row finishes.

The runner hands back each row's new tokens (lockstep/step.Sampled: one, or a verified draft's) with their
log-probabilities; here each token is appended to its row, decoded into text where the row needs text at every
token (a stop string to watch for, a stream, a line rule), checked for the row's end (an eos token or one of its
stop ids, a stop string, its max_tokens, llama-server's two line rules for editors: engine/text.py), and turned
into the events its client gets (types.Token, Finished, Failed), with the step's latencies in `StepStats`. A failure
here (a tokenizer that raises on a token) fails its row only, with 500. No torch.
"""

from __future__ import annotations

import time

from autotp.errors import one_line
from autotp.serve.engine.request import Request, Status
from autotp.serve.engine.stats import Ended, StepStats
from autotp.serve.engine.text import (
    Detokenizer,
    TextStream,
    added_text,
    cut_at_stop,
    first_stop,
    indent_cut,
    past_deadline,
)
from autotp.serve.lockstep.step import StepResult
from autotp.serve.types import Event, Failed, Finished, Piece, Result, Token, TokenLogprob, log


class OutputProcessor:
    """tokenizer: a copy of the API's own (HF fast tokenizers are not meant for two threads at once); eos: the ids
    that end a row (the model's generation config)."""

    def __init__(self, tokenizer, eos: frozenset[int]):
        self.tokenizer, self.eos = tokenizer, eos
        self.special = set(tokenizer.all_special_ids)

    def process(self, requests: dict[int, Request], result: StepResult, stats: StepStats) -> list[Event]:
        """The step's tokens into their rows (`requests` by id; one that ended meanwhile is passed over): their
        events, oldest first."""
        events: list[Event] = []
        for sampled in result.sampled.values():
            r = requests.get(sampled.id)
            if r is None or r.status.finished:
                continue
            r.prompt_logprobs += sampled.prompt_logprobs
            accepted = 0
            for i, token in enumerate(sampled.tokens):
                events += self._append(r, token, sampled.logprobs[i] if sampled.logprobs else None, stats)
                if r.status.finished or i == len(r.draft) or token != r.draft[i]:
                    break
                accepted += 1
            if r.draft and sampled.tokens:
                stats.drafted += len(r.draft)
                stats.accepted += accepted
            if sampled.error and not r.status.finished:
                log(f"{r.client} prompt {r.index} failed: {sampled.error}")
                events.append(self.fail(r, 500, sampled.error))
        return events

    @staticmethod
    def fail(r: Request, status: int, message: str) -> Failed:
        """The row ends without its answer: its client gets `status` and `message`."""
        r.status = Status.FAILED
        return Failed(r.client, r.index, status, message)

    def _append(self, r: Request, token: int, logprob: TokenLogprob | None, stats: StepStats) -> list[Event]:
        """A row's new token: it finishes here (eos, stop string, budget) or feeds the next step."""
        now = time.monotonic()
        r.output.append(token)
        if logprob is not None:
            r.logprobs.append(logprob)
        if r.first_token is None:
            r.first_token = now
            stats.first_tokens.append(now - r.arrived)
        else:
            stats.inter_tokens.append(now - r.last_token)
        r.last_token = now
        row = r.row
        try:
            # text needed at every token, not only the last
            watched = bool(row.stop) or r.stream or row.indent > 0 or row.newline_deadline_s > 0
            text = stopped_by = added = ""
            cut = None  # where a line indented less than row.indent starts: the text ends there
            if watched:
                if r.text is None:
                    r.text, r.streamed = Detokenizer(self.tokenizer, row.ids), TextStream(row.stop)  # prompt: context
                checked = len(r.text.text)
                text = r.text.add(token)
                added = text[checked:]
                stopped_by = first_stop(text, row.stop, checked) if row.stop else ""
                cut = indent_cut(text, row.indent)
            if token in self.eos or token in row.stop_ids or stopped_by:
                r.status = Status.STOPPED
            elif (len(r.output) >= row.max_tokens or cut is not None
                  or past_deadline(added, now - r.first_token, row.newline_deadline_s)):
                r.status = Status.LENGTH
            if r.status.finished:
                text = r.text.final() if watched else added_text(self.tokenizer, row.ids, r.output)
                text = cut_at_stop(text, row.stop)[0] if cut is None else text[:cut]
            events: list[Event] = []
            if r.stream:
                delta = r.streamed.delta(text, final=r.status.finished)
                events.append(Token(r.client, r.index, Piece(token, delta, token in self.special, logprob)))
            if r.status.finished:
                stats.ended.append(Ended(r.status.value, len(row.ids), len(r.output), now - r.arrived))
                events.append(Finished(r.client, r.index, Result(
                    text, r.status.value, len(r.output), tuple(r.output), tuple(r.logprobs), tuple(r.prompt_logprobs),
                    stopped_by, cached_tokens=r.cached, prompt_s=r.first_token - (r.admitted or r.arrived),
                    decode_s=now - r.first_token)))
            return events
        except Exception as e:  # noqa: BLE001 - rank 0's decoding, between steps: this request only
            log(f"{r.client} prompt {r.index} failed after generating: {one_line(e, 200)}")
            return [self.fail(r, 500, f"decoding the completion failed: {type(e).__name__}")]
