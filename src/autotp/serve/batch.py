"""One batch of completions through HF `generate`, identically on every rank.

A batch is a list of `Row`s (types.py: plain data, broadcast from rank 0). Prompts are left-padded into one
`generate` call; each row keeps its own sampling parameters, seed, token budget and stop strings:

- `RowSampler` (a logits processor) samples each sampled row with the row's own seeded generator and
  turns its scores into a one-hot, so HF's greedy argmax picks that token; greedy rows pass through
  untouched, which keeps them identical to `autotp generate`. A row's tokens depend on its seed, not on
  the rest of the batch.
- `RowStop` (a stopping criterion) ends each row on its eos, stop string or `max_tokens`, and reports
  each new token to rank 0's streaming callback. It also ends a row that failed (non-finite scores) and
  a row whose client went away (`cancelled`, rank 0's flags as every rank receives them).

Every rank sees the same gathered logits and the same seeds, so every rank takes the same decisions and
the collectives inside `generate` stay in lockstep. A row whose scores cannot be sampled fails alone:
that is decided from the gathered scores, so identically on every rank. This module knows nothing of
HTTP or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from autotp.generate import pad_token_id
from autotp.serve.types import Outcome, Row


def decode(tokenizer, tokens: list[int]) -> str:
    """The completion text as `autotp generate --json` writes it."""
    return tokenizer.decode(tokens, skip_special_tokens=True)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """text up to the earliest stop string (excluded), and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


class RowSampler(LogitsProcessor):
    """scores (batch, vocab) -> the same scores for greedy rows, a one-hot of the sampled token for the others.

    A row whose scores are NaN, +inf or all -inf anywhere cannot be sampled (nor argmax'ed meaningfully):
    it is recorded in `failed` and gets a one-hot on token 0 so the batch goes on; RowStop ends it."""

    def __init__(self, rows: list[Row], device: torch.device):
        self.rows = rows
        self.generators = [torch.Generator(device=device).manual_seed(r.seed) for r in rows]
        self.failed: dict[int, str] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = scores
        top = scores.max(dim=-1).values.float()  # NaN anywhere makes the max NaN
        for i in (~torch.isfinite(top)).nonzero().flatten().tolist():
            self.failed.setdefault(i, f"the model's scores for this prompt are not finite (max {top[i].item()})")
        for i, row in enumerate(self.rows):
            if row.temperature == 0 and i not in self.failed:
                continue
            if out is scores:
                out = scores.clone()
            out[i] = float("-inf")
            if i not in self.failed:
                try:
                    out[i, self._sample(i, scores[i], top[i])] = 0
                    continue
                except RuntimeError as e:  # same scores, same error on every rank: this row fails alone
                    self.failed[i] = f"sampling failed: {e}".splitlines()[0]
            out[i, 0] = 0
        return out

    def _sample(self, i: int, scores: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        row = self.rows[i]
        # minus the max first: the largest score becomes 0 and a small temperature can only push the
        # others towards -inf (probability 0), never the largest to inf (NaN after the softmax)
        probs = torch.softmax((scores.float() - top) / row.temperature, dim=-1)
        if row.top_p < 1:
            # nucleus: keep the most likely tokens whose mass before them is < top_p, and always the first
            # (a top_p below float32's smallest number, 5e-324, is 0 in the comparison)
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= row.top_p
            drop[0] = False
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0))
        return torch.multinomial(probs, 1, generator=self.generators[i])


class RowStop(StoppingCriteria):
    """input_ids (batch, prompt_len + t) after step t -> (batch,) bool: which rows are finished.

    cancelled() is called once per step on every rank and must return the same flags on all of them
    (rank 0's, broadcast): a cancelled row ends like any finished one, in the same step everywhere."""

    def __init__(self, rows: list[Row], prompt_len: int, eos: set[int], tokenizer, sampler: RowSampler,
                 on_token: Callable[[int, list[int]], None] | None,
                 cancelled: Callable[[], list[bool]] | None = None):
        self.rows, self.prompt_len, self.eos, self.tokenizer = rows, prompt_len, eos, tokenizer
        self.sampler, self.on_token, self.cancelled = sampler, on_token, cancelled
        self.outcomes: list[Outcome | None] = [None] * len(rows)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        generated = input_ids[:, self.prompt_len:].tolist()
        cancelled = self.cancelled() if self.cancelled is not None else [False] * len(self.rows)
        for i, row in enumerate(self.rows):
            if self.outcomes[i] is not None:
                continue  # finished rows keep being computed (padding) until the whole batch ends
            tokens = generated[i]
            if i in self.sampler.failed:
                self.outcomes[i] = Outcome(tokens[:-1], "error", self.sampler.failed[i])
            elif cancelled[i]:
                self.outcomes[i] = Outcome(tokens, "cancelled")
            elif tokens[-1] in self.eos or (row.stop and cut_at_stop(decode(self.tokenizer, tokens), row.stop)[1]):
                self.outcomes[i] = Outcome(tokens, "stop")
            elif len(tokens) >= row.max_tokens:
                self.outcomes[i] = Outcome(tokens, "length")
            elif self.on_token is not None:  # the finishing token is left to the final text, cut at its stop
                self.on_token(i, tokens)
        done = [o is not None for o in self.outcomes]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()


def run_batch(model, tokenizer, rows: list[Row], on_token: Callable[[int, list[int]], None] | None = None,
              cancelled: Callable[[], list[bool]] | None = None) -> list[Outcome]:
    """Generate every row; on_token(row index, tokens so far) after each token that leaves its row unfinished;
    cancelled() -> per row, whether to end it now (the same on every rank)."""
    eos = _eos_ids(model)
    pad = pad_token_id(model.generation_config)
    width = max(len(r.ids) for r in rows)
    # left padding: (batch, width); HF derives position ids from the mask, so each row sees positions 0..len-1
    ids = torch.tensor([[pad] * (width - len(r.ids)) + list(r.ids) for r in rows])
    mask = torch.tensor([[0] * (width - len(r.ids)) + [1] * len(r.ids) for r in rows])
    sampler = RowSampler(rows, model.device)
    stop = RowStop(rows, width, eos, tokenizer, sampler, on_token, cancelled)
    with torch.inference_mode():
        model.generate(ids.to(model.device), attention_mask=mask.to(model.device), pad_token_id=pad,
                       do_sample=False, num_beams=1, max_new_tokens=max(r.max_tokens for r in rows),
                       logits_processor=LogitsProcessorList([sampler]),
                       stopping_criteria=StoppingCriteriaList([stop]))
    return stop.outcomes
