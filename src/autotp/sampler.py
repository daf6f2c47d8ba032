"""The one per-row sampler: `autotp generate`, the library's `generate` helper and `autotp serve` draw here.

A row's draw depends only on its scores, its parameters and its own seeded generator, never on the other
rows of a batch, so the same prompt, parameters and seed give the same text through every front end
(the CLI and the helper run it as an HF logits processor, the server calls it in its own decode loop).
Order as in HF: temperature, then top-k, then top-p (nucleus), then one multinomial draw.

A row whose scores are NaN or +inf anywhere, or all -inf, cannot be sampled (nor argmax'ed meaningfully):
`pick` reports it as failed instead of raising, so one bad row never takes its batch down. The rules on
the parameters' ranges are autotp.sampling's; anything they let through is safe here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessor


class SampleError(Exception):
    """This row's scores cannot be sampled; the message says why (the same on every rank)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0


class RowSampler:
    """One row's draws: scores (vocab,) -> token id, from the row's own generator seeded once."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def pick(self, scores: torch.Tensor) -> int:
        """The next token; SampleError when the scores cannot give one."""
        top = scores.max().float()  # NaN anywhere makes the max NaN
        if not torch.isfinite(top):
            raise SampleError(f"the model's scores for this prompt are not finite (max {top.item()})")
        if self.generator is None:
            return int(scores.argmax())
        p = self.params
        # minus the max first: the largest score becomes 0 and a small temperature can only push the others
        # towards -inf (probability 0), never the largest to inf (NaN after the softmax)
        logits = (scores.float() - top) / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            # nucleus: keep the most likely tokens whose mass before them is < top_p, and always the first
            # (a top_p below float32's smallest number, 5e-324, is 0 in the comparison)
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            drop[0] = False
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0))
        try:
            return int(torch.multinomial(probs, 1, generator=self.generator))
        except RuntimeError as e:  # same scores, same error on every rank
            raise SampleError(f"sampling failed: {e}".splitlines()[0]) from None


class SamplerProcessor(LogitsProcessor):
    """RowSampler inside HF `generate` (run with do_sample=False): scores (batch, vocab) -> a one-hot of
    each row's draw, so HF's argmax picks exactly that token. A row that cannot be sampled raises."""

    def __init__(self, params: SamplingParams, batch: int, device: torch.device | str = "cpu"):
        self.rows = [RowSampler(params, device) for _ in range(batch)]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = torch.full_like(scores, float("-inf"))
        for i, row in enumerate(self.rows):
            out[i, row.pick(scores[i])] = 0
        return out
