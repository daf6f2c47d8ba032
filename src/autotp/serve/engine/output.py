"""Rank 0's side of a step's scores: each row's next token, its log-probabilities, its text and its end.

The engine hands over the scores a forward computed (runner/model_runner.Scores); this module samples the rows that get
a token (each with its own seeded sampler.RowSampler), computes the log-probabilities rows asked for,
decodes and streams the text, and answers a row that finished (eos, a stop string, its budget). Its own
failures (an allocation for a long prompt's scores, a bug) fail only the rows they were for, with 500:
the ranks ran the same forward, so they stay in lockstep. No collectives, no KV: only rank 0 runs this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autotp.sampler import SampleError, draws, read, sample
from autotp.serve.api.metrics import Metrics
from autotp.serve.engine.request import Request
from autotp.serve.engine.text import Detokenizer, added_text, cut_at_stop, first_stop
from autotp.serve.types import Piece, Result, TokenLogprob, log


def describe(e: BaseException) -> str:
    """An exception as one line, the same on every rank for the same failure."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()


def token_logprobs(scores: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """scores (n, vocab) and the token taken at each -> its log-probability and the tops[i] likeliest."""
    if not tokens:
        return []
    lp = torch.log_softmax(scores.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = max(tops)
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(t, c, tuple(zip(ids[i][:tops[i]], values[i][:tops[i]], strict=True)))
            for i, (t, c) in enumerate(zip(tokens, chosen, strict=True))]


class Output:
    """Turns scores into tokens, text and answers for the rows in `active` (the engine's dict)."""

    def __init__(self, tokenizer, eos: set[int], active: dict[int, Request], metrics: Metrics | None = None):
        self.tokenizer, self.eos, self.active, self.metrics = tokenizer, eos, active, metrics
        self.special = set(tokenizer.all_special_ids)

    def take(self, scores) -> dict[int, int]:
        """A forward's scores (runner/model_runner.Scores): prompt log-probabilities first, then the next tokens.
        Returns, for each row that ran a draft, how many of its computed tokens stand (planner.ran)."""
        asked = [s for s in scores.spans if self.active[s.row].row.prompt_logprobs]
        if asked:
            self.guarded([s.row for s in asked], lambda: self._prompt_logprobs(scores.logits, asked))
        drafted = [s for s in scores.spans if s.sample and s.draft]
        plain = [s for s in scores.spans if s.sample and not s.draft]
        if plain:
            rows, sample = [s.row for s in plain], scores.sampled(plain)
            self.guarded(rows, lambda: self._sample_rows(rows, sample))
        kept: dict[int, int] = {}
        for span in drafted:
            self.guarded([span.row], lambda span=span: self._verify(span, scores.logits, kept))
        return kept

    def guarded(self, rows: list[int], work: Callable[[], None]) -> None:
        """Rank 0's own work on a forward's scores: what it raises fails `rows` with 500 and nothing else."""
        try:
            work()
        except Exception as e:  # noqa: BLE001 - one request must not take the server down
            log(f"rank 0's work on the scores of {len(rows)} rows failed; they get 500 and the server goes on: "
                f"{describe(e)}")
            for row in rows:
                a = self.active.get(row)
                if a is not None and not a.done:
                    a.fail(500, f"generation failed: {describe(e)}")

    def _sample_rows(self, rows: list[int], scores: torch.Tensor) -> None:
        """scores (rows, vocab): each row's next token (one host sync for all: sampler.sample), then its
        log-probabilities where it asked for them."""
        live = [i for i, row in enumerate(rows) if not self.active[row].done]  # not failed earlier in this step
        drawn = sample([self.active[rows[i]].sampler for i in live], scores[live]) if live else []
        picked: dict[int, int] = {}
        for i, token in zip(live, drawn, strict=True):
            if self._taken(self.active[rows[i]], token):
                picked[i] = token
        want = [i for i in picked if self.active[rows[i]].row.logprobs is not None]
        logprobs: dict[int, TokenLogprob] = {}

        def compute() -> None:
            tops = [self.active[rows[i]].row.logprobs for i in want]
            logprobs.update(zip(want, token_logprobs(scores[want], [picked[i] for i in want], tops), strict=True))

        self.guarded([rows[i] for i in want], compute)
        for i, token in picked.items():
            if not self.active[rows[i]].done:
                self._advance(self.active[rows[i]], token, logprobs.get(i))

    @staticmethod
    def _taken(a: Request, token: int | SampleError) -> bool:
        """Whether a row's draw gave a token; a SampleError fails the row with 500."""
        if isinstance(token, SampleError):
            log(f"{a.request_id} prompt {a.index} failed: {token}")
            a.fail(500, str(token))
            return False
        return True

    def _verify(self, span, logits: torch.Tensor, kept: dict[int, int]) -> None:
        """A row that ran its last token and a draft d1 .. dm: column i scores the token after d_i (d_0 its last
        token). Its sampler draws at each column in turn, exactly as it would have one step at a time, and
        each token drawn is the row's; it goes on while the token drawn is the draft's next one. So the text
        is the text without a draft; the draft only saves the forwards of the tokens it guessed.

        Every column is drawn on the device before one host sync; a sampling row's generator is then put back
        to its state after the last column the row keeps, as if the others had never been drawn."""
        row, a, b = span.row, span.a, span.b
        active = self.active[row]
        draft = active.draft[:span.draft]
        scores = logits[a:b]
        generator = active.sampler.generator
        if generator is None:
            drawn = sample([active.sampler] * (b - a), scores)
        else:  # column by column, each generator state kept (on CUDA: its seed and offset, no sync)
            states, columns = [generator.get_state()], []
            for i in range(b - a):
                columns.append(draws([active.sampler], scores[i:i + 1]))
                states.append(generator.get_state())
            drawn = read(torch.cat(columns).tolist())
        used = 0
        for i, token in enumerate(drawn):
            used = i + 1
            if isinstance(token, SampleError) or i == len(draft) or token != draft[i]:
                break
        if generator is not None:
            generator.set_state(states[used])
        tops = active.row.logprobs
        tokens = [t for t in drawn[:used] if not isinstance(t, SampleError)]
        logprobs = token_logprobs(scores[:len(tokens)], tokens, [tops] * len(tokens)) if tops is not None else []
        accepted = 0
        for i, token in enumerate(drawn[:used]):
            if not self._taken(active, token):
                break
            self._advance(active, token, logprobs[i] if tops is not None else None)
            kept[row] = i + 1
            if active.done or i == len(draft) or token != draft[i]:
                break
            accepted += 1
        if self.metrics is not None:
            self.metrics.speculated(len(draft), accepted)

    def _prompt_logprobs(self, logits: torch.Tensor, spans: list[tuple]) -> None:
        """Each prompt token's log-probability given the ones before it: the column at position j
        predicts the prompt's token j + 1."""
        for row, start, a, b, *_ in spans:
            active = self.active[row]
            ids = active.row.ids
            positions = range(max(start, len(active.prompt_logprobs) - 1), min(start + b - a, len(ids) - 1))
            if positions:
                targets = [ids[j + 1] for j in positions]
                picked = logits[a + positions.start - start:a + positions.stop - start]
                active.prompt_logprobs += token_logprobs(picked, targets, [active.row.logprobs or 0] * len(targets))

    def _advance(self, a: Request, token: int, logprob: TokenLogprob | None) -> None:
        """A row's new token: it finishes here (eos, stop string, budget) or feeds the next step."""
        a.tokens.append(token)
        if logprob is not None:
            a.logprobs.append(logprob)
        row, job = a.row, a
        if self.metrics is not None:
            a.last = self.metrics.token(job.arrived, a.last)
        try:
            watched = bool(row.stop) or job.stream is not None  # text needed at every token, not only the last
            text = stopped_by = ""
            if watched:
                if a.text is None:
                    a.text = Detokenizer(self.tokenizer, row.ids)  # the prompt is its left context
                checked = len(a.text.text)
                text = a.text.add(token)
                stopped_by = first_stop(text, row.stop, checked) if row.stop else ""
            if token in self.eos or stopped_by:
                reason = "stop"
            elif len(a.tokens) >= row.max_tokens:
                reason = "length"
            else:
                a.next, reason = token, ""
            if reason:
                text = a.text.final() if watched else added_text(self.tokenizer, row.ids, a.tokens)
                text = cut_at_stop(text, row.stop)[0]
            if job.stream is not None:
                delta = job.stream.delta(text, final=bool(reason))
                job.emit(("token", job.index, Piece(token, delta, token in self.special, logprob)))
            if reason:
                a.done = True
                if self.metrics is not None:
                    self.metrics.finished(job.arrived, reason, len(row.ids), len(a.tokens))
                job.emit(("done", job.index, Result(text, reason, len(a.tokens), tuple(a.tokens), tuple(a.logprobs),
                                                    tuple(a.prompt_logprobs), stopped_by)))
        except Exception as e:  # noqa: BLE001 - rank 0's decoding, between steps: this request only
            log(f"{job.request_id} prompt {job.index} failed after generating: {describe(e)}")
            a.fail(500, f"decoding the completion failed: {type(e).__name__}")
